"""The one exception type river-hf raises for a user's mistake.

The CLI prints such an error as a single ``error: ...`` line and exits with status 2; anything
else is a bug and keeps its traceback.
"""


class RiverError(Exception):
    """Bad input or a missing prerequisite. The message says what to do about it.

    Deliberately **not** a ``ValueError`` (nor ``OSError``, ``TypeError``, ``RuntimeError``):
    transformers takes those, raised by a model class's ``from_pretrained``, to mean "this class
    does not fit, try the next one". ``pipeline(...)`` (``pipelines.base.load_model``) then loads
    ``config.architectures[0]``, and ``transformers serve`` its plain class too, so a River folder
    with broken River settings would silently become the plain model. A RiverError stops there,
    as it does from ``AutoModelForCausalLM.from_pretrained``.
    """
