"""Loads a prepared TFDS split whole into memory as uint8 numpy arrays.

Every dataset (fashion_mnist, cifar10, imagenet2012, ...) goes through the one
path here: `tfds.builder(name, data_dir=...)` with downloads always off. The
datasets are prepared beforehand: Fashion-MNIST from local files with
`tools/prepare_fashion_mnist.py`, anything else with `tfds build` on a machine
with network. Pixels stay uint8; scaling to floats happens in the model with
fixed constants, so no statistic is ever computed from the private training set
(Tramer & Boneh 2021, App. B, on private data normalization).
"""

import sys
import textwrap
from typing import NamedTuple

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdp.data import errors
from tfdp.data import fashion_mnist


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

    Downloads are always off: the dataset must already be prepared in `data_dir`.
    Examples come in the order TFDS stored them (deterministic, no shuffling).
    Memory: num_examples * height * width * channels bytes, e.g. 47 MB for the
    Fashion-MNIST train split, 154 MB for CIFAR-10 train, 3.9 GB for ImageNet
    train at image_size=32 and 15.7 GB at 64 (ImageNet at 224x224 does not fit).

    Works under `tfds.testing.mock_data` (random examples, no files needed), e.g.
    `with tfds.testing.mock_data(num_examples=8, policy=MockPolicy.USE_CODE):`.

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
      DatasetNotFoundError: the dataset is not prepared in `data_dir`; the message
        says the command that prepares it (`python tools/prepare_fashion_mnist.py
        --data_dir=...` for fashion_mnist, `tfds build NAME --data_dir=...` on a
        machine with network for anything else, plus the manual download for
        datasets such as imagenet2012).
      ValueError: unknown dataset name; a dataset without (uint8 image, class
        label) supervised keys; varying image sizes without `image_size`;
        image_size < 1; an empty split. A bad split string raises TFDS's own
        ValueError that lists the valid splits.
    """
    if image_size is not None and (not isinstance(image_size, int) or image_size < 1):
        raise ValueError(f"image_size must be None or a positive int, got {image_size!r}.")
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:
        raise ValueError(
            f"Unknown TFDS dataset {name!r}. Use a TFDS name such as 'fashion_mnist', "
            "'cifar10' or 'imagenet2012' (list: `tfds.list_builders()`)."
        ) from None
    image_key, label_key = _supervised_keys(builder)
    image_feature = builder.info.features[image_key]
    try:
        ds = builder.as_dataset(
            split=split,
            as_supervised=True,
            shuffle_files=False,
            read_config=tfds.ReadConfig(try_autocache=False),
        )
    except AssertionError:
        # TFDS raises AssertionError("could not find data") when not prepared.
        if builder.is_prepared():
            raise
        raise errors.DatasetNotFoundError(_not_prepared_message(builder)) from None
    if image_size is not None:
        ds = ds.map(
            lambda image, label: (_resize_uint8(image, image_size), label),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    elif None in image_feature.shape:
        raise ValueError(
            f"Images of {name!r} have varying sizes {image_feature.shape}; pass "
            "image_size=S to resize them to S x S (e.g. 32 or 64 for ImageNet)."
        )
    if ds.cardinality() == 0:
        raise ValueError(f"Split {split!r} of {name!r} is empty; check the split slice.")
    images, labels = ds.batch(sys.maxsize).get_single_element()
    return Split(
        images=images.numpy(),
        labels=labels.numpy().astype(np.int32),
        num_classes=int(builder.info.features[label_key].num_classes),
    )


def _supervised_keys(builder):
    """Returns (image_key, label_key), checking they are uint8 Image and ClassLabel."""
    keys = builder.info.supervised_keys
    if not keys or len(keys) != 2 or not all(isinstance(k, str) for k in keys):
        raise ValueError(
            f"TFDS dataset {builder.name!r} has no (image, label) supervised keys "
            f"(got {keys!r}); tfdp needs an image classification dataset."
        )
    image_key, label_key = keys
    image_feature = builder.info.features[image_key]
    if not isinstance(image_feature, tfds.features.Image) or image_feature.np_dtype != np.uint8:
        raise ValueError(
            f"Feature {image_key!r} of {builder.name!r} is not a uint8 image "
            f"({image_feature!r}); tfdp needs uint8 images."
        )
    if not isinstance(builder.info.features[label_key], tfds.features.ClassLabel):
        raise ValueError(
            f"Feature {label_key!r} of {builder.name!r} is not a class label; tfdp "
            "needs a classification dataset."
        )
    return image_key, label_key


def _resize_uint8(image, image_size):
    """Resizes uint8 [height, width, channels] to uint8 [image_size, image_size, channels]."""
    image = tf.image.resize(image, [image_size, image_size], method=tf.image.ResizeMethod.AREA)
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def _not_prepared_message(builder):
    """The message of DatasetNotFoundError: what is missing and the command to run."""
    data_dir = builder.data_dir_root
    header = (
        f"TFDS dataset {builder.name!r} (version {builder.version}) is not prepared "
        f"in {data_dir} (looked for {builder.data_dir}). tfdp never downloads "
        "(TFDS downloads are off)."
    )
    if builder.name == fashion_mnist.DATASET_NAME:
        return (
            f"{header} Convert the local Fashion-MNIST files once:\n"
            f"  {fashion_mnist.INSTALL_COMMAND}\n"
            f"  python tools/prepare_fashion_mnist.py --data_dir={data_dir}"
        )
    message = (
        f"{header} Prepare it on a machine with network access:\n"
        f"  tfds build {builder.info.full_name.rsplit('/', 1)[0]} --data_dir={data_dir}\n"
        f"then copy its folder {builder.data_dir} to the same path on this machine."
    )
    instructions = getattr(builder, "MANUAL_DOWNLOAD_INSTRUCTIONS", None)
    if instructions:
        message += (
            f"\n{builder.name!r} needs a manual download first, into "
            f"{data_dir}/downloads/manual (or pass --manual_dir to `tfds build`):\n"
            + textwrap.indent(textwrap.dedent(instructions).strip(), "  ")
        )
    return message
