"""The converter's error type: bad input, reported as one line naming the file or field."""


class ConversionError(Exception):
    """A source or destination the converter cannot use; `str()` is the whole message for the user."""
