"""`mock_data`: TFDS's mock data for tests, with data sources that read batches.

TFDS 4.9.10's `tfds.testing.mock_data` mocks `tfds.data_source` too, but sets
the mocked reader's `__getitems__` (the batched read `TFDSSource` uses, and the
one that reads in parallel from real ArrayRecord files) as a plain attribute
holding a function that expects `self`; calling it fails with "_getitems()
missing 1 required positional argument: 'record_keys'". Its `__getitem__`
works (MagicMock binds magic methods). `mock_data` passes TFDS a reader mock
whose `__getitems__` is bound the same way, through mock_data's documented
`mock_array_record_data_source` argument; everything else is TFDS's own.
"""

import contextlib
from unittest import mock

import tensorflow_datasets as tfds


class _BoundGetitemsMock(mock.MagicMock):
    """A MagicMock that binds a function assigned to `__getitems__` to itself."""

    def __setattr__(self, name, value):
        if name == "__getitems__" and not isinstance(value, mock.Mock):
            function = value
            value = lambda keys: function(self, keys)  # noqa: E731
        super().__setattr__(name, value)


class _DataSourceMock(tfds.testing.PickableDataSourceMock):
    """The reader class TFDS mocks; the readers it makes are `_BoundGetitemsMock`s."""

    def _get_child_mock(self, **kwargs):
        return _BoundGetitemsMock(**kwargs)


@contextlib.contextmanager
def mock_data(num_examples=1, **kwargs):
    """`tfds.testing.mock_data` whose data sources also read batches of records.

    Inside the context, `TFDSSource` (and so `train_batches`, `eval_batches`,
    `load_split` and the trainer) reads `num_examples` deterministic random
    examples of any registered TFDS dataset; no files are needed and any
    `data_dir` is ignored. Train and test splits hold the same examples.

    Args:
      num_examples: examples in every split (>= 1).
      **kwargs: passed to `tfds.testing.mock_data` (e.g. `policy`).

    Yields:
      None.
    """
    with tfds.testing.mock_data(
            num_examples=num_examples, mock_array_record_data_source=_DataSourceMock(),
            **kwargs):
        yield
