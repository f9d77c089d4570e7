"""The river-hf version, in a module of its own so that any module can read it without importing
the package's ``__init__`` (whose lazy exports reach every subpackage)."""

__version__ = "0.1.0"
