"""Tests for tfdp.data.load_split: not-prepared errors, mock data, argument checks."""

import re

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tfdp import data
from tfdp.data import errors
from tfdp.data import loading
from tfdp.data import tfds_source


def test_missing_fashion_mnist_says_to_run_the_prepare_tool(tmp_path):
  command = f"python tools/prepare_fashion_mnist.py --data_dir={tmp_path}"
  with pytest.raises(errors.DatasetNotFoundError, match=re.escape(command)) as error:
    loading.load_split("fashion_mnist", "train", data_dir=tmp_path)
  assert "apt-get update && apt-get install dataset-fashion-mnist" in str(error.value)
  assert isinstance(error.value, FileNotFoundError)
  assert error.value.__cause__ is None and error.value.__suppress_context__  # no TFDS traceback


def test_missing_cifar10_says_to_run_tfds_build(tmp_path):
  command = f"tfds build cifar10 --data_dir={tmp_path} --file_format=array_record"
  with pytest.raises(errors.DatasetNotFoundError, match=re.escape(command)) as error:
    loading.load_split("cifar10", "test", data_dir=tmp_path)
  assert "network" in str(error.value)
  assert "pip install apache-beam" in str(error.value)  # the tfds command needs it
  assert "manual download" not in str(error.value)


def test_missing_imagenet_mentions_the_manual_download(tmp_path):
  with pytest.raises(errors.DatasetNotFoundError) as error:
    loading.load_split("imagenet2012", "train", data_dir=tmp_path, image_size=32)
  message = str(error.value)
  assert f"tfds build imagenet2012 --data_dir={tmp_path}" in message
  assert f"{tmp_path}/downloads/manual" in message
  assert "ILSVRC2012_img_train.tar" in message


def test_unknown_dataset_name_is_a_value_error(tmp_path):
  with pytest.raises(ValueError, match="Unknown TFDS dataset 'no_such_dataset'"):
    loading.load_split("no_such_dataset", "train", data_dir=tmp_path)


@pytest.mark.parametrize("image_size", [0, -3, 32.0])
def test_bad_image_size(image_size):
  with pytest.raises(ValueError, match="image_size must be None or a positive int"):
    loading.load_split("cifar10", "train", image_size=image_size)


@pytest.mark.parametrize(
    "name, image_size, shape, num_classes",
    [
        ("fashion_mnist", None, (6, 28, 28, 1), 10),
        ("cifar10", None, (6, 32, 32, 3), 10),
        ("imagenet2012", 16, (6, 16, 16, 3), 1000),
    ],
)
def test_mock_data(tmp_path, name, image_size, shape, num_classes):
  # USE_CODE: examples are generated from the builder's code; the data_dir passed
  # to load_split is ignored (mock_data injects its own) and need not exist.
  with data.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE):
    split = loading.load_split(name, "train", data_dir=tmp_path / "absent", image_size=image_size)
  assert split.images.dtype == np.uint8 and split.images.shape == shape
  assert split.labels.dtype == np.int32 and split.labels.shape == (6,)
  assert split.num_classes == num_classes
  assert np.all((split.labels >= 0) & (split.labels < num_classes))
  images, labels, n = split  # unpacks like a tuple
  assert images is split.images and n == num_classes


def test_variable_size_images_need_image_size():
  with data.mock_data(num_examples=2, policy=tfds.testing.MockPolicy.USE_CODE):
    with pytest.raises(ValueError, match="varying sizes .* pass image_size=S"):
      loading.load_split("imagenet2012", "validation")


def test_resize_keeps_uint8_and_averages_boxes():
  # 4x4 image 10 * [[0, 1, 2, 3], [4, 5, 6, 7], ...] -> 2x2 area resize gives the
  # 2x2 block means: (0+10+40+50)/4 = 25, (20+30+60+70)/4 = 45, 105, 125.
  image = (10 * np.arange(16).reshape(4, 4)).astype(np.uint8)
  resized = tfds_source._resize_uint8(image[:, :, None], 2).numpy()
  assert resized.dtype == np.uint8
  np.testing.assert_array_equal(resized[:, :, 0], [[25, 45], [105, 125]])
