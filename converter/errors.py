"""The converter's error type: bad input, reported as one line naming the file or field."""

from jaxmodel.errors import UserError


class ConversionError(UserError):
    """A source or destination the converter cannot use; `str()` is the whole message for the user."""
