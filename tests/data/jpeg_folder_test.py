"""Tests for tfdp.data.jpeg_folder: ImageNet's JPEG-folder layout, indexed once, read in the graph.

A real folder of JPEG files of varying sizes (`write_jpeg_folder`, the same
examples as the synthetic TFDS dataset), read by index with TensorFlow ops:
the pixels are those of the files, the labels those of their class folders,
eagerly and inside tf.data; a table that does not match its folder is
refused with the command that checks or rebuilds it. Real folders (tiny
hand-made ones): any name reads back; a bad file, a dangling link or an image
listed twice is refused at index time by name, through the API and the tool.
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


# Three processes that start TensorFlow (13 s): under -m slow. The default suite runs the tool
# in the three tests below, and the check's finding in process
# (test_a_changed_folder_is_found_at_open_and_by_the_check).
@pytest.mark.slow
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


# Real folders: names, broken files and duplicates, each refused or read
# correctly at index time, never a traceback from inside TensorFlow or Python mid-training.


def _jpeg(seed, size=8):
    """A distinct tiny JPEG (random pixels from `seed`), uint8 [size, size, 3] before encoding."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return tf.io.encode_jpeg(pixels).numpy()


def _tiny_folder(root, relatives):
    """DATA_DIR/train/<relative> for each relative path, each a distinct 8 x 8 JPEG."""
    for seed, relative in enumerate(relatives):
        path = os.path.join(root, "train", relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(_jpeg(seed))
    return str(root)


def _tool(*args):
    return subprocess.run([sys.executable, "tools/index_jpeg_folder.py", *args],
                          capture_output=True, text=True, check=False)


def _assert_reads_every_file(data_dir):
    """Each row's image is its file's pixels (8 x 8: no resize), its label its folder's rank."""
    source = _open(data_dir, image_size=8)
    header, relative, labels, _ = jpeg_folder.read_index(jpeg_folder.index_path(data_dir,
                                                                                "train"))
    images, read_labels = source.read(tf.range(source.num_examples, dtype=tf.int64))
    for i, name in enumerate(relative):
        with open(os.path.join(data_dir, "train", name), "rb") as f:
            pixels = tf.io.decode_jpeg(f.read(), channels=3).numpy()
        np.testing.assert_array_equal(images[i].numpy(), pixels, err_msg=repr(name))
        assert header["classes"][read_labels[i]] == name.split("/")[0] == header["classes"][
            labels[i]]
    assert jpeg_folder.check_index(data_dir, "train") == []


@pytest.mark.parametrize("relatives", [
    # Before: "'ascii' codec can't encode character '\xe9'" at every open.
    ["café/é.jpg", "日本/ü.JPEG", "b/2.jpg"],
    # Before: "not a valid tfdp index table (invalid literal for int() ...: '2.jpg')", and
    # the tool it points to wrote the same table again.
    ["a/1\t2.jpg", "b\tc/3.jpg"],
    # Before: "not a valid tfdp index table (3 rows, the header says 2)".
    ["a/1\n2.jpg", "a/3\r4.jpg", "b/5.jpg"],
    # Before: str.splitlines() also split rows at U+2028 and NEL (U+0085).
    ["a/1\u20282.jpg", "a/3\x854.jpg", "b/x.jpg"],
    ['a/"1".jpg', "a/back\\slash.jpg", "b/2.jpg"],  # the quoting round-trips its own quotes
], ids=["non_ascii", "tab", "newline_and_cr", "line_separators", "quotes_backslashes"])
def test_any_file_or_class_name_indexes_and_reads_back(tmp_path, relatives):
    data_dir = _tiny_folder(tmp_path, relatives)
    jpeg_folder.index_split(data_dir, "train")
    _, relative, _, _ = jpeg_folder.read_index(jpeg_folder.index_path(data_dir, "train"))
    assert sorted(relative) == sorted(relatives)
    _assert_reads_every_file(data_dir)


def test_a_data_dir_and_names_like_glob_patterns_index_and_read_back(tmp_path):
    # Paths are paths: `[`, `]`, `*`, `?`, `{`, `}` and spaces are never read as a pattern.
    relatives = ["n[0]/a*.jpg", "n {1,2}/b?.JPEG", "n {1,2}/[c].jpg"]
    data_dir = _tiny_folder(tmp_path / "data [x] {a,b}*?", relatives)
    jpeg_folder.index_split(data_dir, "train")
    assert jpeg_folder.check_index(data_dir, "train") == []
    _assert_reads_every_file(data_dir)


@pytest.mark.slow
def test_the_tool_writes_a_table_that_reads_back_names_with_tabs_newlines_and_non_ascii(
        tmp_path):
    data_dir = _tiny_folder(tmp_path, ["café/1\t2.jpg", "café/3\n4.JPEG", "z/ü.png.jpg"])
    done = _tool(f"--data_dir={data_dir}", "--split=train")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "3 images in 2 classes" in done.stdout
    _assert_reads_every_file(data_dir)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)  # the header is intact, the scan is not


def _garbage_body(path):
    with open(path, "wb") as f:
        f.write(b"\xff\xd8\xff\xe0" + bytes(range(256)) * 2)  # a JPEG's magic, then noise


@pytest.mark.parametrize("spoil, message", [
    # Before: indexed (only the magic number was checked); a training step that sampled
    # it stopped with "jpeg::Uncompress failed. Invalid JPEG data or crop window", naming
    # no file.
    (_truncate, r"a/1\.jpg \(does not decode: jpeg::Uncompress failed\. Invalid JPEG data or "
                r"crop window\)"),
    (_garbage_body, r"a/1\.jpg \(does not decode: jpeg::Uncompress failed\. Invalid JPEG data "
                    r"or crop window\)"),
    # Before: "NotFoundError: .../train/a/1.jpg; No such file or directory", a traceback.
    (lambda path: (os.remove(path), os.symlink(path + ".gone", path)),
     r"a/1\.jpg \(a symbolic link to .*1\.jpg\.gone, which does not exist\)"),
    # Before: "FailedPreconditionError: .../train/a/1.jpg; Is a directory", a traceback.
    (lambda path: (os.remove(path), os.makedirs(path)), r"a/1\.jpg \(a folder, not a file\)"),
    (lambda path: open(path, "wb").close(), r"a/1\.jpg \(empty\)"),
], ids=["truncated", "garbage_body", "dangling_symlink", "folder_named_x_jpg", "empty"])
def test_every_file_is_read_and_decoded_at_index_time(tmp_path, spoil, message):
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "a/2.jpg", "b/3.jpg"])
    spoil(os.path.join(data_dir, "train", "a", "1.jpg"))
    with pytest.raises(ValueError, match=rf"1 files of .*train are not readable images: "
                                         rf"{message}\. Replace or remove them"):
        jpeg_folder.index_split(data_dir, "train")
    assert not os.path.exists(jpeg_folder.index_path(data_dir, "train"))


def test_a_dangling_symlink_in_place_of_a_class_folder_is_refused(tmp_path):
    # Before: indexed without it, so every later class's label shifted by one (b's 1 -> 0).
    data_dir = _tiny_folder(tmp_path, ["b/1.jpg", "c/2.jpg"])
    os.symlink("/mnt/unmounted/a", os.path.join(data_dir, "train", "a"))
    with pytest.raises(ValueError, match=r"1 entries of .*train are symbolic links to folders "
                                         r"that do not exist: a -> /mnt/unmounted/a\. Each "
                                         r"would have been a class"):
        jpeg_folder.index_split(data_dir, "train")


@pytest.mark.slow
def test_the_tool_names_every_bad_file_and_ends_without_a_traceback(tmp_path):
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "a/2.jpg", "b/3.jpg", "b/4.jpg", "b/5.jpg"])
    _truncate(os.path.join(data_dir, "train", "a", "1.jpg"))
    _garbage_body(os.path.join(data_dir, "train", "a", "2.jpg"))
    os.symlink(os.path.join(data_dir, "gone.jpg"), os.path.join(data_dir, "train", "b",
                                                                 "dangling.jpg"))
    os.makedirs(os.path.join(data_dir, "train", "b", "x.jpg"))
    done = _tool(f"--data_dir={data_dir}", "--split=train")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.search(r"error: 4 files of .*train are not readable images: "
                     r"a/1\.jpg \(does not decode: .*\), a/2\.jpg \(does not decode: .*\), "
                     r"b/dangling\.jpg \(a symbolic link to .*gone\.jpg, which does not "
                     r"exist\), b/x\.jpg \(a folder, not a file\)\. Replace or remove them, "
                     r"then index again\.", done.stderr), done.stderr[-3000:]


def test_a_file_replaced_by_bytes_of_its_size_is_named_when_a_batch_reads_it(tmp_path):
    # Before: "jpeg::Uncompress failed" naming no file (only a size change was named).
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "b/2.jpg"])
    jpeg_folder.index_split(data_dir, "train")
    source = _open(data_dir, image_size=8)
    _, relative, _, sizes = jpeg_folder.read_index(jpeg_folder.index_path(data_dir, "train"))
    path = os.path.join(data_dir, "train", relative[1])
    with open(path, "wb") as f:
        f.write(bytes(np.random.default_rng(0).integers(0, 256, sizes[1], dtype=np.uint8)))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"(?s)changed after it was indexed.*train/{relative[1]}.*is no "
                             rf"longer an image.*--check") as error:
        source.read(tf.constant([0, 1], tf.int64))
    from tfdp import experiment  # pylint: disable=g-import-not-at-top

    line = experiment.changed_file_message(str(error.value.message))  # what the trainer says
    assert line.startswith("A file of the JPEG folder changed after it was indexed: ")
    assert f"train/{relative[1]} is no longer an image" in line and "b'" not in line
    graph = ("assertion failed: [A file of the JPEG folder changed after it was indexed:] "
             "[/d/sweep[a]/x.jpg] [is no longer an image. Check, then restore the file or "
             "index again.] [[{{node Assert}}]]")  # as a tf.data pipeline says it
    assert experiment.changed_file_message(graph) == (
        "A file of the JPEG folder changed after it was indexed: /d/sweep[a]/x.jpg is no "
        "longer an image. Check, then restore the file or index again.")


def test_a_file_changed_after_indexing_is_named_when_a_batch_reads_it(tmp_path):
    # Before: "jpeg::Uncompress failed. Invalid JPEG data or crop window", naming no file.
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "b/2.jpg"])
    jpeg_folder.index_split(data_dir, "train")
    source = _open(data_dir, image_size=8)
    _, relative, _, sizes = jpeg_folder.read_index(jpeg_folder.index_path(data_dir, "train"))
    _truncate(os.path.join(data_dir, "train", relative[1]))
    source.read(tf.constant([0], tf.int64))  # the other file still reads
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"(?s)changed after it was indexed.*train/{relative[1]}.*"
                             rf"{sizes[1] // 2}.*the index table says.*{sizes[1]}.*--check"):
        source.read(tf.constant([0, 1], tf.int64))
    ds = tf.data.Dataset.from_tensors(tf.constant([1], tf.int64)).map(source.read)
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(relative[1])):
        list(ds)


def test_a_name_that_is_not_utf8_is_refused_with_how_to_rename_it(tmp_path):
    # Before: "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff", a traceback.
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "b/2.jpg"])
    os.rename(os.path.join(data_dir, "train", "a", "1.jpg"),
              os.path.join(os.fsencode(data_dir), b"train/a/caf\xe9.jpg"))
    with pytest.raises(ValueError, match=r"1 files of .*train are not readable images: "
                                         r"a/caf\\xe9\.jpg \(its name is not UTF-8: rename "
                                         r"it in UTF-8, e\.g\. with convmv"):
        jpeg_folder.index_split(data_dir, "train")


def _symlinked_class(data_dir):
    os.symlink("a", os.path.join(data_dir, "train", "c"))


def _copied_into_b(data_dir):
    shutil.copy(os.path.join(data_dir, "train", "a", "1.jpg"),
                os.path.join(data_dir, "train", "b", "1.jpg"))


def _hard_link_in_a(data_dir):
    os.link(os.path.join(data_dir, "train", "a", "1.jpg"),
            os.path.join(data_dir, "train", "a", "1_again.jpg"))


@pytest.mark.parametrize("duplicate, message", [
    # Before: indexed as 4 images in 3 classes: a/1.jpg and a/2.jpg also under label 2.
    (_symlinked_class, r"2 images are listed more than once: a/1\.jpg and c/1\.jpg \(the "
                       r"same file\), a/2\.jpg and c/2\.jpg \(the same file\)"),
    (_copied_into_b, r"1 images are listed more than once: a/1\.jpg and b/1\.jpg \(identical "
                     r"bytes\)"),
    (_hard_link_in_a, r"1 images are listed more than once: a/1\.jpg and a/1_again\.jpg \(the "
                      r"same file\)"),
], ids=["symlinked_class_folder", "copied_into_another_class", "hard_link_in_one_class"])
def test_an_image_listed_twice_is_refused_naming_both_paths(tmp_path, duplicate, message):
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "a/2.jpg", "b/3.jpg"])
    duplicate(data_dir)
    with pytest.raises(ValueError,  # a jpeg_folder.DuplicateImagesError
                       match=rf"(?s){message}.*one person's image would count twice.*"
                             r"Keep one copy of each.*For a non-private run only, "
                             r"--allow_duplicates writes the table anyway.*a private run "
                             r"refuses that table"):
        jpeg_folder.index_split(data_dir, "train")
    assert not os.path.exists(jpeg_folder.index_path(data_dir, "train"))


@pytest.mark.slow
def test_the_tool_refuses_a_symlinked_class_folder_and_lists_every_pair(tmp_path):
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "a/2.jpg", "b/3.jpg"])
    _symlinked_class(data_dir)
    done = _tool(f"--data_dir={data_dir}", "--split=train")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "error: 2 images are listed more than once: a/1.jpg and c/1.jpg" in done.stderr
    assert done.stdout.splitlines()[-2:] == ["a/1.jpg\tc/1.jpg", "a/2.jpg\tc/2.jpg"]


@pytest.mark.slow
def test_allowed_duplicates_are_listed_refused_by_a_private_run_and_warned_otherwise(
        tmp_path, caplog):
    # A non-private run may read a folder with duplicates (--allow_duplicates); a private one
    # must not: one person's image would count twice.
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "a/2.jpg", "b/3.jpg"])
    _symlinked_class(data_dir)
    done = _tool(f"--data_dir={data_dir}", "--split=train", "--allow_duplicates")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning: 2 images are listed more than once" in done.stdout
    source = _open(data_dir, image_size=8)
    assert source.num_examples == 5
    assert source.duplicates == [("a/1.jpg", "c/1.jpg"), ("a/2.jpg", "c/2.jpg")]
    with pytest.raises(ValueError, match=r"lists 2 images more than once \(a/1.jpg and c/1.jpg, "
                                         r"a/2.jpg and c/2.jpg\).*sensitivity doubles"):
        data.check_duplicates(source, private=True)
    data.check_duplicates(source, private=False)
    assert "counts as its own example in this non-private run" in caplog.text
    clean_dir = _tiny_folder(tmp_path / "clean", ["a/1.jpg", "b/2.jpg"])
    assert _tool(f"--data_dir={clean_dir}", "--split=train").returncode == 0
    data.check_duplicates(_open(clean_dir, image_size=8), private=True)  # nothing to refuse


def test_a_private_run_on_a_table_with_duplicates_is_refused_before_it_trains(tmp_path,
                                                                              run_smoke):
    data_dir = _tiny_folder(tmp_path, ["a/1.jpg", "a/2.jpg", "b/3.jpg"])
    _symlinked_class(data_dir)
    for relative in ("a/4.jpg", "b/5.jpg", "c/6.jpg"):
        path = os.path.join(data_dir, "validation", relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(_jpeg(len(relative) + ord(relative[0])))
    for split in ("train", "validation"):
        jpeg_folder.index_split(data_dir, split, allow_duplicates=True)
    workdir = tmp_path / "wd"
    with pytest.raises(ValueError, match=r"lists 2 images more than once .*--allow_duplicates.*"
                                         r"sensitivity doubles"):
        run_smoke(workdir, ["imagenet.gin"], [
            "tfdp.DataConfig.dataset = 'imagenet2012'", "BATCH_SIZE = 4",
            "IMAGE_SIZE = 8", "NUM_EXAMPLES = 5", f"DATA_DIR = '{data_dir}'",
            "tfdp.DataConfig.train_split = 'train'",
            "tfdp.data.open_split.source = 'jpeg_folder'"], mock=False)
    assert not workdir.exists()  # refused before the workdir was touched
