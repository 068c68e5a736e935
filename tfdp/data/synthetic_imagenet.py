"""A local, ImageNet-shaped TFDS dataset of synthetic JPEGs, in ArrayRecord.

ImageNet cannot be downloaded on the project's machines, yet the data path that
`imagenet.gin` needs (random access over ArrayRecord files, JPEG decoding,
resizing, Poisson sampling) has to be tested and measured on real files. This
builder writes a TFDS dataset with the features of TFDS's `imagenet2012`:

    image:     tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg")
    label:     tfds.features.ClassLabel(num_classes=1000)
    file_name: tfds.features.Text()

and the splits `train` and `validation`, so that `imagenet.gin` runs on it by
changing only the dataset name, the splits and NUM_EXAMPLES. The images are
smooth random colour fields plus pixel noise, encoded as JPEG at quality 90:
about 22 KB at 224 x 224, the order of ImageNet's own (about 110 KB at its typical
400 x 350; per pixel the same order). The label of image i is drawn
independently of its pixels, so nothing is learnable; the dataset is for
plumbing, speed and memory, not accuracy.

Everything is a pure function of (seed, split, index): the same arguments give
the same bytes. Prepare it with `tools/make_synthetic_imagenet.py` (or
`prepare_synthetic_imagenet`); the dataset is always written as ArrayRecord.
"""

import pathlib

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdp.data import preparation

DATASET_NAME = preparation.SYNTHETIC_IMAGENET
NUM_CLASSES = 1000  # as imagenet2012
JPEG_QUALITY = 90
_NOISE_STD = 14.0  # pixel noise on top of the smooth field; sets the JPEG size (~22 KB)
_LOW_RES = 8  # the smooth field is an upsampled 8 x 8 random image
_SPLIT_IDS = {"train": 0, "validation": 1}


def prepare_synthetic_imagenet(data_dir, *, num_train, num_validation, image_size=224, seed=0):
    """Writes the dataset `synthetic_imagenet` into `data_dir`, as ArrayRecord.

    Idempotent: if it is already prepared in `data_dir`, nothing is written
    (whatever the other arguments). Writes `<data_dir>/synthetic_imagenet/1.0.0/`.
    Takes a few ms per 224 x 224 image, plus TFDS's shuffling and
    writing (5,000 images: about 40 s; 50,000: about 6 min on 2 cores).

    Args:
      data_dir: TFDS data directory to write into.
      num_train: examples in the `train` split (>= 1).
      num_validation: examples in the `validation` split (>= 1).
      image_size: int S (every image S x S) or a pair (lo, hi): each image's
        height and width are drawn independently and uniformly from [lo, hi],
        so sizes vary as ImageNet's do.
      seed: int >= 0; the images and labels are a pure function of it.

    Returns:
      The TFDS data directory (pathlib.Path): pass it as `data_dir`.

    Raises:
      ValueError: num_train or num_validation < 1, or a bad image_size.
    """
    builder = SyntheticImagenet(
        data_dir=data_dir, num_train=num_train, num_validation=num_validation,
        image_size=image_size, seed=seed, file_format="array_record",
    )
    if not builder.is_prepared():
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(try_download_gcs=False)
        )
    return pathlib.Path(builder.data_dir_root)


def write_jpeg_folder(data_dir, *, num_train, num_validation, image_size=224, seed=0):
    """Writes the same examples as ImageNet's JPEG-folder layout, indexed for reading.

    DATA_DIR/{train,validation}/<class>/synthetic_<split>_<index>.JPEG, with
    the 1000 class folders n00000000 ... n00000999 (label k is folder k; some
    stay empty at small N), the same pixels, labels and JPEG bytes as the
    TFDS dataset (`synthetic_image`), then the index tables
    `tfdp.data.jpeg_folder.index_split` writes. Idempotent: a folder whose
    two tables exist is left alone.

    Args:
      data_dir: the folder to write (local or a gfile URL).
      num_train, num_validation, image_size, seed: as
        `prepare_synthetic_imagenet`.

    Returns:
      `data_dir`, for `tfdp.data.open_split(..., source="jpeg_folder")`.

    Raises:
      ValueError: num_train or num_validation < 1, or a bad image_size.
    """
    from tfdp.data import jpeg_folder  # pylint: disable=g-import-not-at-top

    counts = {"train": int(num_train), "validation": int(num_validation)}
    if min(counts.values()) < 1:
        raise ValueError(f"num_train and num_validation must be >= 1, got {num_train} and "
                         f"{num_validation}.")
    _size_range(image_size)
    data_dir = str(data_dir)
    if all(tf.io.gfile.exists(jpeg_folder.index_path(data_dir, s)) for s in counts):
        return data_dir
    for split, count in counts.items():
        for label in range(NUM_CLASSES):
            tf.io.gfile.makedirs(f"{data_dir}/{split}/{_synset(label)}")
        for index in range(count):
            pixels, label = synthetic_image(seed, split, index, image_size)
            path = f"{data_dir}/{split}/{_synset(label)}/synthetic_{split}_{index:08d}.JPEG"
            tf.io.write_file(path, tf.io.encode_jpeg(pixels, quality=JPEG_QUALITY))
    for split in counts:
        jpeg_folder.index_split(data_dir, split)
    return data_dir


def _synset(label):
    return f"n{label:08d}"


def synthetic_image(seed, split, index, image_size):
    """The uint8 [height, width, 3] pixels of one example (before JPEG encoding).

    Args:
      seed: the dataset seed (int >= 0).
      split: "train" or "validation".
      index: the example's index in generation order (int >= 0).
      image_size: as in `prepare_synthetic_imagenet`.

    Returns:
      `(image, label)`: image uint8 [height, width, 3]; label int in [0, 1000).
    """
    rng = np.random.default_rng([seed, _SPLIT_IDS[split], index])
    lo, hi = _size_range(image_size)
    height, width = (int(s) for s in rng.integers(lo, hi + 1, size=2))
    field = rng.integers(0, 256, size=(_LOW_RES, _LOW_RES, 3)).astype(np.float32)
    smooth = tf.image.resize(field, [height, width], method="bicubic").numpy()
    pixels = smooth + _NOISE_STD * rng.standard_normal((height, width, 3), dtype=np.float32)
    label = int(rng.integers(0, NUM_CLASSES))
    return np.clip(np.round(pixels), 0, 255).astype(np.uint8), label


def _size_range(image_size):
    """int S or (lo, hi) -> (lo, hi), checked."""
    if isinstance(image_size, int) and not isinstance(image_size, bool):
        image_size = (image_size, image_size)
    try:
        lo, hi = (int(s) for s in image_size)
    except (TypeError, ValueError):
        lo = hi = 0
    if not 1 <= lo <= hi or tuple(image_size) != (lo, hi):
        raise ValueError(
            f"image_size must be a positive int or a pair (lo, hi) with 1 <= lo <= hi, "
            f"got {image_size!r}."
        )
    return lo, hi


class SyntheticImagenet(tfds.core.GeneratorBasedBuilder):
    """ImageNet-shaped synthetic JPEGs (see the module docstring).

    The constructor arguments only matter when preparing; a prepared copy is
    read back by name like any TFDS dataset
    (`tfds.data_source("synthetic_imagenet", data_dir=...)`).
    """

    name = DATASET_NAME
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "ImageNet's features; smooth random JPEGs, random labels."}

    def __init__(self, *, num_train=8, num_validation=8, image_size=224, seed=0, **kwargs):
        if int(num_train) < 1 or int(num_validation) < 1:
            raise ValueError(
                f"num_train and num_validation must be >= 1, got {num_train} and "
                f"{num_validation}."
            )
        self._num_examples = {"train": int(num_train), "validation": int(num_validation)}
        _size_range(image_size)  # checks it
        self._image_size = image_size
        self._seed = int(seed)
        super().__init__(**kwargs)

    def _info(self):
        return self.dataset_info_from_configs(
            description="ImageNet-shaped synthetic JPEGs for tests and benchmarks (tfdp).",
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
                "file_name": tfds.features.Text(),
            }),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {split: self._generate_examples(split) for split in self._num_examples}

    def _generate_examples(self, split):
        for index in range(self._num_examples[split]):
            pixels, label = synthetic_image(self._seed, split, index, self._image_size)
            encoded = tf.io.encode_jpeg(pixels, quality=JPEG_QUALITY).numpy()
            file_name = f"synthetic_{split}_{index:08d}.JPEG"
            yield file_name, {
                "image": encoded, "label": label, "file_name": file_name,
            }
