"""The one exception type river-hf raises for a user's mistake.

The CLI prints such an error as a single ``error: ...`` line and exits with status 2; anything
else is a bug and keeps its traceback.
"""


class RiverError(ValueError):
    """Bad input or a missing prerequisite. The message says what to do about it."""
