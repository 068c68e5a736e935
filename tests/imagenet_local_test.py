"""imagenet.gin and imagenet_tan.gin, end to end on a local ImageNet-shaped dataset.

Not mock data: `synthetic_imagenet` (conftest.py's fixture) is a real TFDS
dataset in ArrayRecord with ImageNet's features, so these runs go through the
data path a real ImageNet run takes: random access by index, Poisson sampling,
JPEG decoding and resizing of images of varying sizes, augmult views, and the
evaluation split streamed from disk. Only the sizes shrink: 2 steps
(smoke.gin), N = 40, B = 8, and, to fit the default suite on 2 CPU cores,
IMAGE_SIZE = 32, 2 views, 2 accumulation chunks and an NF-ResNet-50 of width 1
(all 50 layers; the full-size step is measured in benchmarks/input_pipeline.py).
"""

import os

import pytest

from tfdp import data

SMOKE_PARAMS = [
    "tfdp.DataConfig.dataset = 'synthetic_imagenet'",
    "tfdp.DataConfig.train_split = 'train'",
    "tfdp.DataConfig.test_split = 'validation'",
    "BATCH_SIZE = 8",
    "IMAGE_SIZE = 32",
    "AUGMULT = 2",
    "ACCUMULATION_STEPS = 2",
    "tfdp.models.build_nf_resnet.width = 1",
]


# imagenet_tan.gin includes imagenet.gin and changes only privacy-coupled values (its epsilon
# is checked in configs_test): the same code path, so its 40 s run is slow-only (CI budget).
# Both are slow-only (imagenet.gin: 112 s on the 2-core host, twice its time before the
# float32 rules' larger graphs): the default suite runs imagenet.gin end to end in
# tests/runbook_test.py (the pure-TF input), and the ArrayRecord reads of this synthetic
# ImageNet (varying sizes, JPEG decoding, Poisson batches) in tests/data/tfds_source_test.py.
@pytest.mark.slow
@pytest.mark.parametrize("config", ["imagenet.gin", "imagenet_tan.gin"])
def test_config_runs_two_steps_on_local_imagenet_shaped_data(
        config, tmp_path, run_smoke, synthetic_imagenet_dir, tensorflow_warnings):
    num_train = data.TFDSSource("synthetic_imagenet", "train", data_dir=synthetic_imagenet_dir,
                                image_size=32).num_examples
    report = run_smoke(tmp_path, [config], [
        *SMOKE_PARAMS, f"DATA_DIR = '{synthetic_imagenet_dir}'",
        f"NUM_EXAMPLES = {num_train}"], mock=False)
    assert report["steps"] == 2
    assert report["num_examples"] == num_train
    assert os.path.isdir(tmp_path / "export")
    assert not any("while_loop" in m for m in tensorflow_warnings), tensorflow_warnings


# The runbook test (tests/runbook_test.py) runs the same path in the default suite, on a
# ram:// folder, with the same check that no Python input is called; this local-folder run
# is slow-only (129 s on the 2-core host: the suite's 15-minute budget).
@pytest.mark.slow
def test_imagenet_gin_runs_on_a_jpeg_folder_through_the_pure_tf_input(
        tmp_path, run_smoke, synthetic_jpeg_dir, monkeypatch):
    # ImageNet's own layout (train/<synset>/*.JPEG), read with tf.io.read_file and sampled in
    # the graph: the numpy sampler and the ArrayRecord reader are never called.
    from tfdp.data import sampling  # pylint: disable=g-import-not-at-top
    from tfdp.data import tfds_source  # pylint: disable=g-import-not-at-top

    def python_input(*args, **kwargs):
        raise AssertionError("the pure-TF input called the Python input path")

    monkeypatch.setattr(sampling, "poisson_indices", python_input)
    monkeypatch.setattr(tfds_source.TFDSSource, "_fetch", python_input)
    report = run_smoke(tmp_path, ["imagenet.gin"], [
        *SMOKE_PARAMS, f"DATA_DIR = '{synthetic_jpeg_dir}'", "NUM_EXAMPLES = 40",
        "tfdp.data.open_split.source = 'jpeg_folder'"], mock=False)
    assert report["steps"] == 2 and report["num_examples"] == 40
    assert "open_split.source = 'jpeg_folder'" in (tmp_path / "operative_config.gin").read_text()
    assert os.path.isdir(tmp_path / "export")


def test_a_truncated_shard_is_refused_before_the_workdir_is_touched(
        tmp_path, run_smoke, synthetic_imagenet_dir):
    # Before: a 200-line "Corrupted Riegeli/records file" traceback, and checkpoints/ckpt-0
    # left in the workdir.
    import shutil  # pylint: disable=g-import-not-at-top

    copy = tmp_path / "data"
    shutil.copytree(synthetic_imagenet_dir, copy)
    shard = next(copy.rglob("*train.array_record*"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(data.DatasetNotFoundError, match=rf"corrupt shard.*{shard.name}"):
        run_smoke(tmp_path / "wd", ["imagenet.gin"], [
            *SMOKE_PARAMS, f"DATA_DIR = '{copy}'", "NUM_EXAMPLES = 40"], mock=False)
    assert not (tmp_path / "wd").exists()


@pytest.mark.slow
def test_a_corrupt_record_met_in_training_is_named_with_the_command(
        tmp_path, run_smoke, synthetic_imagenet_dir, monkeypatch):
    # A split too large to be read whole at start (monkeypatched here): before, a
    # "Corrupted Riegeli/records file: chunk data hash mismatch" traceback from inside
    # tf.data; now the shard and the command that prepares it again.
    import shutil  # pylint: disable=g-import-not-at-top

    from tfdp.data import tfds_source  # pylint: disable=g-import-not-at-top

    monkeypatch.setattr(tfds_source, "FULL_CHECK_MAX_BYTES", 0)
    copy = tmp_path / "data"
    shutil.copytree(synthetic_imagenet_dir, copy)
    shard = next(copy.rglob("*train.array_record*"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # bytes flipped all over the records (footer intact)
        for offset in range(size // 10, size * 8 // 10, 1000):
            f.seek(offset)
            chunk = f.read(4)
            f.seek(offset)
            f.write(bytes(b ^ 0xFF for b in chunk))
    assert shard.stat().st_size == size
    with pytest.raises(data.DatasetNotFoundError) as error:
        run_smoke(tmp_path / "wd", ["fashion_mnist.gin"], [
            "tfdp.DataConfig.dataset = 'synthetic_imagenet'",
            "tfdp.DataConfig.test_split = 'validation'",
            f"tfdp.DataConfig.data_dir = '{copy}'",
            "tfdp.DataConfig.image_size = 32", "NUM_EXAMPLES = 40", "BATCH_SIZE = 8",
            "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0"], mock=False)
    message = str(error.value)
    assert f"corrupt shard of split 'train': {shard.name}" in message, message
    assert "make_synthetic_imagenet.py" in message and "same command resumes" in message
