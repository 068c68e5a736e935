"""Tests for tfdp.data.jpeg_folder: ImageNet's JPEG-folder layout, indexed once, read in the graph.

A real folder of JPEG files of varying sizes (`write_jpeg_folder`, the same
examples as the synthetic TFDS dataset), read by index with TensorFlow ops:
the pixels are those of the files, the labels those of their class folders,
eagerly and inside tf.data; a table that does not match its folder is
refused with the command that checks or rebuilds it.
"""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfdp import data
from tfdp.data import jpeg_folder
from tfdp.data import synthetic_imagenet
from tfdp import graph_checks

NUM_TRAIN, NUM_VALIDATION, SIZES, SEED = 24, 8, (40, 80), 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return synthetic_imagenet.write_jpeg_folder(
        tmp_path_factory.mktemp("jpeg") / "imagenet", num_train=NUM_TRAIN,
        num_validation=NUM_VALIDATION, image_size=SIZES, seed=SEED)


@pytest.fixture
def copy(folder, tmp_path):
    shutil.copytree(folder, tmp_path / "copy")
    return str(tmp_path / "copy")


def _open(data_dir, split="train", image_size=32):
    return data.open_split("imagenet2012", split, data_dir=data_dir, image_size=image_size,
                           source="jpeg_folder")


def _expected(data_dir, source, indices):
    """The resized pixels of each file, and the label its synthetic index was drawn with."""
    _, relative, labels, _ = jpeg_folder.read_index(
        jpeg_folder.index_path(data_dir, source.split.split("[")[0]))
    images, truth = [], []
    for i in indices:
        path = os.path.join(data_dir, source.split.split("[")[0], relative[i])
        pixels = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        resized = tf.image.resize(pixels, [source.image_size] * 2, method="area")
        images.append(tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8).numpy())
        index = int(re.search(r"_(\d+)\.JPEG$", relative[i]).group(1))
        _, label = synthetic_imagenet.synthetic_image(SEED, "train", index, SIZES)
        assert labels[i] == label and relative[i].startswith(f"n{label:08d}/")
        truth.append(label)
    return np.stack(images), np.array(truth, np.int32)


def test_read_gives_each_file_s_pixels_and_its_folder_s_label_eagerly_and_in_tf_data(folder):
    source = _open(folder)
    assert (source.num_examples, source.num_classes, source.image_shape) == (
        NUM_TRAIN, 1000, (32, 32, 3))
    assert source.pure_tf
    indices = [7, 0, 23, 7]
    want_images, want_labels = _expected(folder, source, indices)
    images, labels = source.read(tf.constant(indices, tf.int64))
    np.testing.assert_array_equal(images.numpy(), want_images)
    np.testing.assert_array_equal(labels.numpy(), want_labels)
    ds = tf.data.Dataset.from_tensors(tf.constant(indices, tf.int64)).map(source.read)
    (images, labels), = list(ds.as_numpy_iterator())
    np.testing.assert_array_equal(images, want_images)
    np.testing.assert_array_equal(labels, want_labels)
    serialized = ds._as_serialized_graph().numpy()  # pylint: disable=protected-access
    graph = tf.compat.v1.GraphDef.FromString(serialized)
    nodes = graph_checks.graph_nodes(graph)
    assert "ReadFile" in {n.op for n in nodes} and graph_checks.host_callbacks(nodes) == []


def test_the_table_order_is_a_fixed_permutation_and_a_slice_is_a_slice_of_it(folder):
    whole, tail = _open(folder), _open(folder, "train[5:]")
    assert tail.num_examples == NUM_TRAIN - 5
    a = whole.read(tf.constant([5, 9], tf.int64))
    b = tail.read(tf.constant([0, 4], tf.int64))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    _, relative, _, _ = jpeg_folder.read_index(jpeg_folder.index_path(folder, "train"))
    assert list(relative) != sorted(relative)  # not the first classes first
    assert _open(folder, "validation").num_examples == NUM_VALIDATION


def test_a_missing_table_names_the_command_that_writes_it(copy):
    os.remove(jpeg_folder.index_path(copy, "train"))
    with pytest.raises(data.DatasetNotFoundError,
                       match=r"index table .*train\.tfdp_index\.tsv is missing.*\n  python "
                             rf"tools/index_jpeg_folder\.py --data_dir={re.escape(copy)} "
                             r"--split=train"):
        _open(copy)


def test_a_changed_folder_is_found_at_open_and_by_the_check(copy):
    _, relative, _, _ = jpeg_folder.read_index(jpeg_folder.index_path(copy, "train"))
    victim = os.path.join(copy, "train", relative[0])  # the first file is spot-checked
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(data.DatasetNotFoundError,
                       match=rf"(?s)does not match its index table: {re.escape(relative[0])} "
                             r"\(100 bytes, the table says \d+\).*--check"):
        _open(copy)
    os.remove(os.path.join(copy, "train", relative[1]))
    shutil.copy(os.path.join(copy, "validation", jpeg_folder.read_index(
        jpeg_folder.index_path(copy, "validation"))[1][0]),
        os.path.join(copy, "train", "n00000000", "extra.JPEG"))
    problems = jpeg_folder.check_index(copy, "train")
    assert any(f"1 files missing from the folder: {relative[1]}" in p for p in problems)
    assert any("1 files not in the table: n00000000/extra.JPEG" in p for p in problems)
    assert any(f"1 files changed (label or size): {relative[0]}" in p for p in problems)


def test_the_indexer_refuses_files_that_are_not_images_and_classes_that_differ(copy):
    with open(os.path.join(copy, "train", "n00000001", "broken.JPEG"), "wb") as f:
        f.write(b"<html>not found</html>")
    with pytest.raises(ValueError, match=r"1 files of .*train are not readable images: "
                                         r"n00000001/broken\.JPEG \(not a JPEG or PNG\)"):
        jpeg_folder.index_split(copy, "train")
    os.remove(os.path.join(copy, "train", "n00000001", "broken.JPEG"))
    os.makedirs(os.path.join(copy, "validation", "n99999999"))
    with pytest.raises(ValueError, match=r"class folders of .*validation differ from those "
                                         r"of .*train \(1 differ, e\.g\. n99999999\)"):
        jpeg_folder.index_split(copy, "validation")


def test_the_tool_indexes_checks_and_exits_1_on_a_mismatch(copy):
    os.remove(jpeg_folder.index_path(copy, "train"))
    tool = [sys.executable, "tools/index_jpeg_folder.py", f"--data_dir={copy}"]
    done = subprocess.run([*tool, "--split=train"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{NUM_TRAIN} images in 1000 classes" in done.stdout
    assert _open(copy).num_examples == NUM_TRAIN
    ok = subprocess.run([*tool, "--check"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and "matches its folder" in ok.stdout
    os.remove(os.path.join(copy, "validation", jpeg_folder.read_index(
        jpeg_folder.index_path(copy, "validation"))[1][2]))
    bad = subprocess.run([*tool, "--check"], capture_output=True, text=True, check=False)
    assert bad.returncode == 1 and "1 files missing from the folder" in bad.stdout


@pytest.mark.parametrize("kwargs, message", [
    (dict(image_size=None), r"source='jpeg_folder' needs image_size"),
    (dict(data_dir=None), r"set data_dir \(the configs' DATA_DIR\)"),
    (dict(split="train+validation"), r"is not NAME or NAME\[a:b\]"),
    (dict(split="train[30:]"), r"Split 'train\[30:\]' is not a valid slice of 'train' "
                               r"\(Requested slice \[30:24\] incompatible with 24 examples"),
])
def test_bad_arguments_are_refused_with_what_to_do(folder, kwargs, message):
    args = {**dict(split="train", data_dir=folder, image_size=32), **kwargs}
    with pytest.raises(ValueError, match=message):
        data.open_split("imagenet2012", args.pop("split"), source="jpeg_folder", **args)
