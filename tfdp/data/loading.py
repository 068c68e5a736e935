"""Loads a prepared TFDS split whole into memory as uint8 numpy arrays.

Only for what must be held: tfdp trains from disk (`TFDSSource`), but the fixed
ScatterNet features of Tramer & Boneh 2021 (App. C.1) are computed once from
every image of a small dataset (Fashion-MNIST, CIFAR-10) and kept in memory.
Reading goes through the same `TFDSSource` (ArrayRecord, random access, the
same errors), in the stored order.
"""

from typing import NamedTuple

import numpy as np

from tfdp.data import pipeline
from tfdp.data import tfds_source

# Examples decoded per batch while loading.
_LOAD_BATCH_SIZE = 1024


class Split(NamedTuple):
    """One dataset split in memory.

    Attributes:
      images: uint8 [num_examples, height, width, channels].
      labels: int32 [num_examples], class ids in [0, num_classes).
      num_classes: number of classes of the dataset (from the TFDS DatasetInfo,
        not counted from `labels`).
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int


def load_split(name, split, *, data_dir=None, image_size=None):
    """Loads a prepared TFDS split whole into memory.

    Downloads are always off: the dataset must already be prepared in `data_dir`,
    in ArrayRecord (see `TFDSSource`). Examples come in the order TFDS stored
    them (deterministic, no shuffling). Memory: num_examples * height * width *
    channels bytes, e.g. 47 MB for the Fashion-MNIST train split, 154 MB for
    CIFAR-10 train. Training does not need this (it reads from disk); use it
    for what must be computed from every image at once.

    Works under `tfdp.data.mock_data` (random examples, no files needed).

    Args:
      name: TFDS dataset name, optionally with config/version
        (e.g. "fashion_mnist", "cifar10", "imagenet2012", "imagenet_resized/32x32").
      split: TFDS split string, e.g. "train", "test", "train[:45000]",
        "train[45000:]" (TFDS slicing syntax).
      data_dir: TFDS data directory; None means the TFDS default
        (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`).
      image_size: None, or an int S: resize every image to S x S with area
        (box) interpolation, rounded back to uint8, as for ImageNet-32
        (De et al. 2022, App. C.2, following Chrabaszcz et al. 2017). Required
        when the dataset's images have varying sizes (imagenet2012).

    Returns:
      Split(images, labels, num_classes): images uint8
      [num_examples, height, width, channels], labels int32 [num_examples],
      num_classes int. A NamedTuple, so `images, labels, num_classes = ...` works.

    Raises:
      DatasetNotFoundError, ValueError: as `TFDSSource`.
    """
    return read_split(
        tfds_source.TFDSSource(name, split, data_dir=data_dir, image_size=image_size))


def read_split(source):
    """Reads every example of a source into memory, in the stored order.

    Args:
      source: a `TFDSSource` (or any source with `num_examples`, `num_classes`
        and `read`).

    Returns:
      Split(images, labels, num_classes), as `load_split`.

    Raises:
      tf.errors.OpError: a record cannot be read or decoded (e.g. a file
        deleted after the source was opened).
    """
    images, labels = [], []
    for batch_images, batch_labels in pipeline.eval_batches(
            source, batch_size=_LOAD_BATCH_SIZE).as_numpy_iterator():
        images.append(batch_images)
        labels.append(batch_labels)
    return Split(
        images=np.concatenate(images),
        labels=np.concatenate(labels).astype(np.int32),
        num_classes=source.num_classes,
    )
