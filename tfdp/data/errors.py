"""Errors raised by tfdp.data."""


class DatasetNotFoundError(FileNotFoundError):
    """A known TFDS dataset is not prepared in the data directory.

    Raised by `tfdp.data.load_split` instead of TFDS's own AssertionError, with a
    message that says the command that prepares the dataset (tfdp never
    downloads: TFDS downloads are always off).
    """
