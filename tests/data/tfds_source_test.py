"""Tests for tfdp.data.TFDSSource on a real local ArrayRecord dataset.

The dataset is `synthetic_imagenet` (ImageNet's features: JPEGs of varying
sizes, 1000 classes), written by the `synthetic_imagenet_dir` fixture.
"""

import json
import pathlib
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdp import data
from tfdp.data import synthetic_imagenet

SIZE = 48


def _tfds_numpy_source(data_dir, split="train"):
    """TFDS's own random-access reader, decoding in numpy (PIL): the reference."""
    return tfds.builder("synthetic_imagenet", data_dir=data_dir).as_data_source(split=split)


def test_source_describes_the_split(synthetic_imagenet_dir):
    source = data.TFDSSource("synthetic_imagenet", "train", data_dir=synthetic_imagenet_dir,
                             image_size=SIZE)
    assert source.num_examples == 40
    assert source.num_classes == synthetic_imagenet.NUM_CLASSES == 1000
    assert source.image_shape == (SIZE, SIZE, 3)
    sliced = data.TFDSSource("synthetic_imagenet", "train[10:]",
                             data_dir=synthetic_imagenet_dir, image_size=SIZE)
    assert sliced.num_examples == 30


def test_read_returns_the_examples_at_the_indices(synthetic_imagenet_dir):
    source = data.TFDSSource("synthetic_imagenet", "train", data_dir=synthetic_imagenet_dir,
                             image_size=SIZE)
    reference = _tfds_numpy_source(synthetic_imagenet_dir)
    indices = np.array([39, 0, 17, 17, 5], np.int64)  # any order, repeats allowed
    read = tf.function(source.read)
    for images, labels in [read(tf.constant(indices)),  # in a graph
                           source.read(tf.constant(indices))]:  # and eagerly
        assert images.dtype == tf.uint8 and images.shape == (5, SIZE, SIZE, 3)
        assert labels.dtype == tf.int32
        for image, label, i in zip(images.numpy(), labels.numpy(), indices):
            example = reference[int(i)]
            assert label == example["label"]
            # TFDS decodes with PIL, tfdp with tf.io (libjpeg): the same pixels up to
            # IDCT rounding, after the same area resize.
            expected = data.tfds_source._resize_uint8(example["image"], SIZE).numpy()
            assert np.mean(np.abs(image.astype(int) - expected.astype(int))) < 1.5


def test_a_data_dir_named_like_a_glob_pattern_reads_the_same(synthetic_imagenet_dir, tmp_path):
    # Paths are paths: a data_dir holding `[`, `]`, `*`, `?`, `{`, `}` or spaces.
    named = tmp_path / "data [x] {a,b}*?"
    shutil.copytree(synthetic_imagenet_dir, named)
    indices = tf.constant([39, 0, 17], tf.int64)
    got, want = (data.TFDSSource("synthetic_imagenet", "train", data_dir=str(d),
                                 image_size=SIZE).read(indices)
                 for d in (named, synthetic_imagenet_dir))
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


def test_an_image_at_its_target_size_is_not_resampled(tmp_path):
    fixed = data.prepare_synthetic_imagenet(tmp_path, num_train=3, num_validation=1,
                                            image_size=SIZE)
    source = data.TFDSSource("synthetic_imagenet", "train", data_dir=fixed, image_size=SIZE)
    images, _ = source.read(tf.range(3, dtype=tf.int64))
    builder = tfds.builder("synthetic_imagenet", data_dir=fixed)
    raw = builder.as_data_source(
        split="train", deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
    for i in range(3):
        jpeg = builder.info.features.deserialize_example(
            raw[i], decoders={"image": tfds.decode.SkipDecoding()})["image"]
        np.testing.assert_array_equal(images[i].numpy(), tf.io.decode_jpeg(jpeg).numpy())


def test_train_batches_read_each_steps_poisson_sample(synthetic_imagenet_dir):
    source = data.TFDSSource("synthetic_imagenet", "train", data_dir=synthetic_imagenet_dir,
                             image_size=SIZE)
    labels_at = np.array([example["label"] for example in
                          _tfds_numpy_source(synthetic_imagenet_dir)])
    ds = data.train_batches(source, sampling="poisson", batch_size=8, num_steps=6, seed=99,
                            start_step=2)
    assert ds.element_spec == (tf.TensorSpec([None, SIZE, SIZE, 3], tf.uint8),
                               tf.TensorSpec([None], tf.int32))
    for t, (images, labels) in enumerate(ds.as_numpy_iterator(), start=2):
        indices = data.poisson_indices(99, t, num_examples=40, sampling_prob=8 / 40)
        np.testing.assert_array_equal(labels, labels_at[indices])
        assert images.shape == (len(indices), SIZE, SIZE, 3)


def test_eval_batches_stream_the_split_in_order(synthetic_imagenet_dir):
    source = data.TFDSSource("synthetic_imagenet", "validation",
                             data_dir=synthetic_imagenet_dir, image_size=SIZE)
    labels = [b for _, b in data.eval_batches(source, batch_size=5).as_numpy_iterator()]
    assert [len(b) for b in labels] == [5, 5, 2]
    expected = [e["label"] for e in _tfds_numpy_source(synthetic_imagenet_dir, "validation")]
    np.testing.assert_array_equal(np.concatenate(labels), expected)


def test_varying_sizes_need_image_size(synthetic_imagenet_dir):
    with pytest.raises(ValueError, match=r"varying sizes .* pass image_size=S"):
        data.TFDSSource("synthetic_imagenet", "train", data_dir=synthetic_imagenet_dir)


@pytest.mark.parametrize("image_size", [0, -3, 32.0, True])
def test_bad_image_size(synthetic_imagenet_dir, image_size):
    with pytest.raises(ValueError, match="image_size must be None or a positive int"):
        data.TFDSSource("synthetic_imagenet", "train", data_dir=synthetic_imagenet_dir,
                        image_size=image_size)


def test_empty_split_slice(synthetic_imagenet_dir):
    with pytest.raises(ValueError, match=r"Split 'train\[:0\]' of 'synthetic_imagenet' is empty"):
        data.TFDSSource("synthetic_imagenet", "train[:0]", data_dir=synthetic_imagenet_dir,
                        image_size=SIZE)


def test_missing_dataset_says_how_to_make_it(tmp_path):
    with pytest.raises(data.DatasetNotFoundError,
                       match=f"python tools/make_synthetic_imagenet.py --data_dir={tmp_path}"):
        data.TFDSSource("synthetic_imagenet", "train", data_dir=tmp_path, image_size=SIZE)


def test_tfrecord_only_dataset_says_how_to_convert_it(tmp_path):
    builder = synthetic_imagenet.SyntheticImagenet(
        data_dir=tmp_path, num_train=2, num_validation=1, image_size=16)
    builder.download_and_prepare()  # TFDS's default format: TFRecord
    with pytest.raises(data.DatasetNotFoundError) as error:
        data.TFDSSource("synthetic_imagenet", "train", data_dir=tmp_path, image_size=SIZE)
    message = str(error.value)
    assert "as tfrecord only" in message and "ArrayRecord" in message
    assert (f"tfds convert_format --dataset_version_dir={builder.data_dir} "
            "--out_file_format=array_record") in message
    assert "pip install apache-beam" in message
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_a_dataset_converted_in_place_is_read_from_its_array_record_files(tmp_path):
    # What `tfds convert_format --dataset_version_dir=DIR --out_file_format=array_record`
    # leaves (checked once by hand; its CLI needs apache-beam): the TFRecord files, the
    # ArrayRecord files beside them, and "alternativeFileFormats" in dataset_info.json.
    tfrecord = synthetic_imagenet.SyntheticImagenet(
        data_dir=tmp_path / "converted", num_train=4, num_validation=1, image_size=16)
    tfrecord.download_and_prepare()
    array_record = data.prepare_synthetic_imagenet(
        tmp_path / "array_record", num_train=4, num_validation=1, image_size=16)
    version_dir = pathlib.Path(tfrecord.data_dir)
    for shard in (array_record / "synthetic_imagenet" / "1.0.0").glob("*.array_record*"):
        shutil.copy(shard, version_dir)
    info_path = version_dir / "dataset_info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "alternativeFileFormats": ["array_record"]}))

    source = data.TFDSSource("synthetic_imagenet", "train", data_dir=tmp_path / "converted",
                             image_size=16)
    reference = data.TFDSSource("synthetic_imagenet", "train", data_dir=array_record,
                                image_size=16)
    np.testing.assert_array_equal(data.read_split(source).images,
                                  data.read_split(reference).images)


def _copy_and_first_train_shard(prepared_dir, tmp_path):
    """A copy of a prepared data_dir, and the path of one of its train shards."""
    copy = tmp_path / "data"
    shutil.copytree(prepared_dir, copy)
    return copy, next((copy / synthetic_imagenet.DATASET_NAME).rglob("*train.array_record*"))


def test_a_half_prepared_folder_names_the_missing_file_and_the_command(
        synthetic_imagenet_dir, tmp_path):
    # A preparation cut short (or a copy missing a shard) used to open fine and fail on
    # the first batch deep inside training, after the workdir was written.
    copy, shard = _copy_and_first_train_shard(synthetic_imagenet_dir, tmp_path)
    shard.unlink()
    with pytest.raises(data.DatasetNotFoundError,
                       match=rf"only partly prepared: split 'train' needs {shard.name}, which "
                             r"is missing.*\n.*make_synthetic_imagenet.py"):
        data.TFDSSource(synthetic_imagenet.DATASET_NAME, "train", data_dir=str(copy),
                        image_size=32)
    # The other split is whole and still opens.
    data.TFDSSource(synthetic_imagenet.DATASET_NAME, "validation", data_dir=str(copy),
                    image_size=32)


def test_a_truncated_shard_is_named_before_anything_is_read(synthetic_imagenet_dir, tmp_path):
    # Before: opened fine, then a 200-line "Corrupted Riegeli/records file" traceback at
    # the first batch, after the workdir's first checkpoint was written.
    copy, shard = _copy_and_first_train_shard(synthetic_imagenet_dir, tmp_path)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(data.DatasetNotFoundError,
                       match=rf"holds a corrupt shard of split 'train': {shard.name} \(.*\)\. "
                             r"A truncated copy.*\n.*make_synthetic_imagenet.py"):
        data.TFDSSource(synthetic_imagenet.DATASET_NAME, "train", data_dir=str(copy),
                        image_size=32)
    data.TFDSSource(synthetic_imagenet.DATASET_NAME, "validation", data_dir=str(copy),
                    image_size=32)


def _flip_bytes_in_the_middle(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert path.stat().st_size == size


def test_a_shard_with_flipped_bytes_is_named_before_anything_is_read(synthetic_imagenet_dir,
                                                                    tmp_path):
    # Before: opened fine (its footer is intact), then "Corrupted Riegeli/records file:
    # chunk data hash mismatch" from the first batch, after ckpt-0 was written.
    copy, shard = _copy_and_first_train_shard(synthetic_imagenet_dir, tmp_path)
    _flip_bytes_in_the_middle(shard)
    with pytest.raises(data.DatasetNotFoundError,
                       match=rf"holds a corrupt shard of split 'train': {shard.name} \(.*hash "
                             r"mismatch.*\)\. .*flipped bytes.*\n.*make_synthetic_imagenet.py"):
        data.TFDSSource(synthetic_imagenet.DATASET_NAME, "train", data_dir=str(copy),
                        image_size=32)


def test_a_corrupt_record_of_a_large_split_is_named_when_read(synthetic_imagenet_dir, tmp_path,
                                                             monkeypatch):
    # Splits above FULL_CHECK_MAX_BYTES (ImageNet) are not read whole when opened.
    from tfdp.data import tfds_source  # pylint: disable=g-import-not-at-top

    monkeypatch.setattr(tfds_source, "FULL_CHECK_MAX_BYTES", 0)
    copy, shard = _copy_and_first_train_shard(synthetic_imagenet_dir, tmp_path)
    _flip_bytes_in_the_middle(shard)
    source = data.TFDSSource(synthetic_imagenet.DATASET_NAME, "train", data_dir=str(copy),
                             image_size=32)
    with pytest.raises(tf.errors.OpError):  # inside tf.data, as in training
        for _ in data.eval_batches(source, batch_size=8):
            pass
    assert isinstance(source.read_error, data.DatasetNotFoundError)
    assert re.search(rf"corrupt shard of split 'train': {shard.name} \(.*hash mismatch",
                     str(source.read_error)), str(source.read_error)
    with pytest.raises(data.DatasetNotFoundError, match=shard.name):
        data.raise_read_error(source)


def test_the_data_readers_and_preparers_do_not_import_each_other():
    # fashion_mnist imported tfds_source (check_split_files) and tfds_source imported
    # fashion_mnist (DATASET_NAME): a cycle, broken by a function-level import. The names and
    # commands both need now live in tfdp.data.preparation.
    import ast  # pylint: disable=g-import-not-at-top
    import pathlib  # pylint: disable=g-import-not-at-top

    import tfdp  # pylint: disable=g-import-not-at-top

    def imports(module):
        tree = ast.parse((pathlib.Path(tfdp.__file__).parent / "data" / f"{module}.py")
                         .read_text())
        return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "tfdp.data" for alias in node.names}

    assert "fashion_mnist" not in imports("tfds_source")
    assert "tfds_source" in imports("fashion_mnist")
    assert not {"fashion_mnist", "tfds_source"} & imports("preparation")
