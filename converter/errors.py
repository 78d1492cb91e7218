"""The converter's error type: bad input, reported as one line naming the file or field."""

from jaxmodel.errors import UsageError, UserError


class ConversionError(UserError):
    """A source or destination the converter cannot use; `str()` is the whole message for the user."""


class ConversionUsageError(ConversionError, UsageError):
    """Options that cannot work together (exit 2, as argparse's own usage errors)."""
