"""Tests for tfdp.data.fashion_mnist: local IDX files -> stock TFDS fashion_mnist."""

import gzip
import pathlib
import struct
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tfdp.data import fashion_mnist
from tfdp.data import loading

_NUM_TRAIN = 12
_NUM_TEST = 5


def _write_idx(path, magic, array):
  """Writes uint8 `array` as a gzipped IDX file: big-endian magic, dims, raw bytes."""
  header = struct.pack(f">{1 + array.ndim}I", magic, *array.shape)
  with gzip.open(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def _write_source_dir(source_dir, rng, num_train=_NUM_TRAIN, num_test=_NUM_TEST):
  """Writes the 4 synthetic IDX files; returns {split: (images [n,28,28], labels [n])}."""
  arrays = {}
  for split, prefix, n in (("train", "train", num_train), ("test", "t10k", num_test)):
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
    _write_idx(source_dir / f"{prefix}-images-idx3-ubyte.gz", 0x00000803, images)
    _write_idx(source_dir / f"{prefix}-labels-idx1-ubyte.gz", 0x00000801, labels)
    arrays[split] = (images, labels)
  return arrays


def _as_sorted_pairs(images, labels):
  """(image bytes, label) pairs sorted; TFDS stores examples in a shuffled order."""
  return sorted((image.tobytes(), int(label)) for image, label in zip(images, labels))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """Synthetic source files, converted once: (source arrays, data_dir)."""
  source_dir = tmp_path_factory.mktemp("idx")
  arrays = _write_source_dir(source_dir, np.random.default_rng(0))
  data_dir = fashion_mnist.prepare_fashion_mnist(
      source_dir=source_dir, data_dir=tmp_path_factory.mktemp("tfds")
  )
  return arrays, data_dir


@pytest.mark.parametrize("split", ["train", "test"])
def test_load_split_returns_exactly_the_source_pixels_and_labels(prepared, split):
  arrays, data_dir = prepared
  images, labels = arrays[split]
  got = loading.load_split("fashion_mnist", split, data_dir=data_dir)
  # The stock builder reads 28x28 uint8 and adds a channel axis.
  assert got.images.dtype == np.uint8 and got.images.shape == images.shape + (1,)
  assert got.labels.dtype == np.int32 and got.labels.shape == labels.shape
  assert got.num_classes == 10
  assert _as_sorted_pairs(got.images[..., 0], got.labels) == _as_sorted_pairs(images, labels)


def test_stock_builder_reads_the_converted_dataset(prepared):
  arrays, data_dir = prepared
  builder = tfds.builder("fashion_mnist", data_dir=data_dir)
  assert type(builder).__module__.startswith("tensorflow_datasets.")  # the stock class
  assert builder.info.splits["train"].num_examples == _NUM_TRAIN
  assert builder.info.splits["test"].num_examples == _NUM_TEST
  # Random access, as tfdp reads it: the stock builder's own data source (ArrayRecord).
  source = tfds.data_source("fashion_mnist", split="test", data_dir=data_dir, download=False)
  images = np.stack([example["image"] for example in source])
  labels = np.array([example["label"] for example in source])
  assert _as_sorted_pairs(images[..., 0], labels) == _as_sorted_pairs(*arrays["test"])


def test_prepare_is_idempotent_and_needs_no_source_once_prepared(prepared):
  _, data_dir = prepared
  info_file = pathlib.Path(data_dir) / "fashion_mnist" / "3.0.1" / "dataset_info.json"
  mtime = info_file.stat().st_mtime_ns
  again = fashion_mnist.prepare_fashion_mnist(source_dir="/nonexistent", data_dir=data_dir)
  assert again == pathlib.Path(data_dir)
  assert info_file.stat().st_mtime_ns == mtime  # nothing rewritten


def test_a_tfrecord_only_copy_is_rewritten_as_array_record(tmp_path):
  # An older tfdp wrote TFRecord, which cannot be read by index.
  source_dir = tmp_path / "idx"
  source_dir.mkdir()
  arrays = _write_source_dir(source_dir, np.random.default_rng(5))
  old = fashion_mnist._LocalFashionMNIST(source_dir=source_dir, data_dir=tmp_path / "tfds")
  old.download_and_prepare()
  assert [f.value for f in old.info.available_file_formats()] == ["tfrecord"]
  data_dir = fashion_mnist.prepare_fashion_mnist(source_dir=source_dir, data_dir=tmp_path / "tfds")
  got = loading.load_split("fashion_mnist", "train", data_dir=data_dir)
  assert _as_sorted_pairs(got.images[..., 0], got.labels) == _as_sorted_pairs(*arrays["train"])


def test_missing_source_file_says_what_to_run(tmp_path):
  source_dir = tmp_path / "idx"
  source_dir.mkdir()
  _write_source_dir(source_dir, np.random.default_rng(1))
  (source_dir / "t10k-labels-idx1-ubyte.gz").unlink()
  with pytest.raises(FileNotFoundError) as error:
    fashion_mnist.prepare_fashion_mnist(source_dir=source_dir, data_dir=tmp_path / "tfds")
  message = str(error.value)
  assert "t10k-labels-idx1-ubyte.gz" in message
  assert "apt-get update && apt-get install dataset-fashion-mnist" in message
  assert "--source_dir" in message
  assert not (tmp_path / "tfds" / "fashion_mnist").exists()


def test_image_and_label_counts_must_match(tmp_path):
  _write_source_dir(tmp_path, np.random.default_rng(2))
  _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 0x00000801, np.zeros([11], np.uint8))
  with pytest.raises(ValueError, match="holds 12 images but .* holds 11 labels"):
    fashion_mnist.prepare_fashion_mnist(source_dir=tmp_path, data_dir=tmp_path / "tfds")


def test_a_label_outside_the_classes_is_named_without_printing_the_data(tmp_path):
  # Before: TFDS refused the example and printed its 784 pixels (about 820 lines).
  _write_source_dir(tmp_path, np.random.default_rng(5))
  labels = np.zeros([12], np.uint8)
  labels[7] = 12
  _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 0x00000801, labels)
  with pytest.raises(ValueError) as error:
    fashion_mnist.prepare_fashion_mnist(source_dir=tmp_path, data_dir=tmp_path / "tfds")
  assert "label 12 of example 7 is not a Fashion-MNIST class (0 to 9)" in str(error.value)
  assert len(str(error.value).splitlines()) == 1
  assert not (tmp_path / "tfds" / "fashion_mnist").exists()


def test_labels_file_in_place_of_images_is_rejected(tmp_path):
  _write_source_dir(tmp_path, np.random.default_rng(3))
  _write_idx(tmp_path / "train-images-idx3-ubyte.gz", 0x00000801, np.zeros([12], np.uint8))
  with pytest.raises(ValueError, match="magic number 0x00000801, expected 0x00000803"):
    fashion_mnist.prepare_fashion_mnist(source_dir=tmp_path, data_dir=tmp_path / "tfds")


def test_images_must_be_28x28(tmp_path):
  _write_source_dir(tmp_path, np.random.default_rng(4))
  _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 0x00000803, np.zeros([5, 32, 32], np.uint8))
  with pytest.raises(ValueError, match="32x32 images; Fashion-MNIST images are 28x28"):
    fashion_mnist.prepare_fashion_mnist(source_dir=tmp_path, data_dir=tmp_path / "tfds")


_REAL = fashion_mnist.DEFAULT_SOURCE_DIR


@pytest.mark.slow
@pytest.mark.skipif(
    not all((_REAL / name).is_file() for name in fashion_mnist.SOURCE_FILES),
    reason=f"real Fashion-MNIST not installed ({fashion_mnist.INSTALL_COMMAND})",
)
def test_real_fashion_mnist_conversion(tmp_path):
  start = time.perf_counter()
  data_dir = fashion_mnist.prepare_fashion_mnist(data_dir=tmp_path)
  print(f"real conversion took {time.perf_counter() - start:.1f} s")
  train = loading.load_split("fashion_mnist", "train", data_dir=data_dir)
  test = loading.load_split("fashion_mnist", "test", data_dir=data_dir)
  assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
  # Fashion-MNIST is balanced: 6000 train and 1000 test images per class.
  np.testing.assert_array_equal(np.bincount(train.labels), [6000] * 10)
  np.testing.assert_array_equal(np.bincount(test.labels), [1000] * 10)


@pytest.mark.parametrize("damage", [pytest.param("delete", marks=pytest.mark.slow), "truncate"])
def test_a_half_prepared_folder_is_refused_naming_the_shard(tmp_path, damage):
  # Before: "Fashion-MNIST is in ..." and exit 0, with a shard missing.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  source_dir = tmp_path / "idx"
  source_dir.mkdir()
  _write_source_dir(source_dir, np.random.default_rng(3))
  data_dir = fashion_mnist.prepare_fashion_mnist(source_dir=source_dir,
                                                 data_dir=tmp_path / "tfds")
  shard = next(pathlib.Path(data_dir).rglob("*test.array_record*"))
  if damage == "delete":
    shard.unlink()
  else:
    with open(shard, "r+b") as f:
      f.truncate(shard.stat().st_size // 2)
  with pytest.raises(FileNotFoundError, match=rf"(?s)split 'test'.*{shard.name}.*\n.*"
                                              r"prepare_fashion_mnist\.py"):
    fashion_mnist.prepare_fashion_mnist(source_dir=source_dir, data_dir=data_dir)
  tool = pathlib.Path(__file__).parents[2] / "tools" / "prepare_fashion_mnist.py"
  result = subprocess.run(
      [sys.executable, str(tool), f"--source_dir={source_dir}", f"--data_dir={data_dir}"],
      capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert shard.name in result.stderr and "Fashion-MNIST is in" not in result.stdout
  assert "Traceback" not in result.stderr
