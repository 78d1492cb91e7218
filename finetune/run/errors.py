"""The errors of a run directory: `RunError` when reading one, `RunDirError` (a kind of it) when a run may not
use one as asked."""

from jaxmodel.errors import UserError


class RunError(ValueError, UserError):
    """A directory that is not a usable finetune-lora run; the message names the file and what is wrong."""


class RunDirError(RunError):
    """A run directory this run may not use as asked (in use, not empty, another run's settings, ...)."""
