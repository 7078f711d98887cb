"""Typed errors for everything a user can get wrong.

Every error a user can cause derives from :class:`DsvError`; the CLI prints
``dsv4c: error: <message>`` on one line and exits 2 for these, and never shows a
traceback. Messages are single lines that say what is wrong and what to do.
"""


class DsvError(Exception):
    """Base class of user-facing errors (bad input, not a bug in dsv4c)."""


class ConfigError(DsvError):
    """A model configuration is malformed or inconsistent."""


class UnsupportedModelError(ConfigError):
    """A configuration describes a model variant dsv4c does not implement."""


class CheckpointError(DsvError):
    """A checkpoint file or directory is unreadable, truncated or inconsistent."""


class IRError(DsvError):
    """An IR program failed verification."""


class UsageError(DsvError):
    """An API or CLI call was made with invalid arguments."""


class ArtifactError(DsvError):
    """An artifact is missing, tampered with, from another format version, or for another host."""


class ShardingError(UsageError):
    """A model cannot be split across the requested number of devices (``--tensor-parallel``)."""
