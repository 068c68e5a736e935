"""make_private refuses what it cannot train right; PrivateTraining.export never deletes."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import private_training

IMAGES = np.zeros((40, 8, 8, 1), np.uint8)
LABELS = np.arange(40) % 2
COMMON = dict(noise_multiplier=1.0, target_delta=1e-5, l2_clip_norm=1.0)


def _model(shape=(8, 8, 1)):
    return keras.Sequential([keras.Input(shape), keras.layers.Flatten(), keras.layers.Dense(2)])


def _private(**kwargs):
    args = dict(COMMON, batch_size=10, num_steps=1, optimizer="sgd")
    args.update(kwargs)
    return tfdp.make_private(_model(), (IMAGES, LABELS), **args)


@pytest.mark.parametrize("data, message", [
    # Before: hung, reading an endless dataset into memory.
    (tf.data.Dataset.from_tensor_slices((IMAGES, LABELS)).repeat(),
     r"infinite tf\.data\.Dataset \(e\.g\. \.repeat\(\)\)"),
    # Before: "not enough values to unpack".
    (tf.data.Dataset.from_tensor_slices((IMAGES[:0], LABELS[:0])), "empty tf.data.Dataset"),
    ((IMAGES[:0], LABELS[:0]), "holds no examples"),
])
def test_infinite_and_empty_data_are_refused(data, message):
    with pytest.raises(ValueError, match=message):
        tfdp.make_private(_model(), data, batch_size=10, num_steps=1, optimizer="sgd",
                          **COMMON)


def test_unknown_cardinality_is_read_up_to_a_documented_limit(monkeypatch):
    monkeypatch.setattr(private_training, "MAX_UNKNOWN_CARDINALITY_EXAMPLES", 100)
    endless = tf.data.Dataset.from_tensor_slices((IMAGES, LABELS)).repeat().filter(
        lambda image, label: True)
    assert int(endless.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    with pytest.raises(ValueError, match=r"unknown cardinality with more than 100 examples"):
        tfdp.make_private(_model(), endless, batch_size=10, num_steps=1, optimizer="sgd",
                          **COMMON)
    short = tf.data.Dataset.from_tensor_slices((IMAGES, LABELS)).filter(lambda i, l: True)
    private = tfdp.make_private(_model(), short, batch_size=10, num_steps=1, optimizer="sgd",
                                **COMMON)
    assert private.source.num_examples == 40


@pytest.mark.parametrize("kwargs, message", [
    # Before: ZeroDivisionError.
    (dict(batch_size=0, epochs=1), r"batch_size must be a positive int .* got 0"),
    (dict(batch_size=2.5, epochs=1), r"batch_size must be a positive int .* got 2\.5"),
    # Before: accepted, then failed in fit.
    (dict(batch_size=10, epochs=1, optimizer=None), "optimizer is required"),
])
def test_bad_batch_size_and_missing_optimizer_are_refused(kwargs, message):
    args = dict(COMMON, optimizer="sgd")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        tfdp.make_private(_model(), (IMAGES, LABELS), **args)


@pytest.mark.parametrize("shape", [(9, 8, 1), (8, 9, 1), (8, 8, 3)])
def test_images_that_do_not_match_the_model_are_refused(shape):
    # Before: accepted, then failed deep in TF at the first step.
    with pytest.raises(ValueError, match=r"The images are \[N, 8, 8, 1\] but the model takes "
                                         rf"inputs \(None, {shape[0]}, {shape[1]}, {shape[2]}\)"):
        tfdp.make_private(_model(shape), (IMAGES, LABELS), batch_size=10, num_steps=1,
                          optimizer="sgd", **COMMON)


@pytest.fixture(scope="module")
def trained():
    private = _private()
    private.fit(verbose=False)
    return private


def test_export_before_fit_needs_allow_untrained(tmp_path):
    # Before: silently exported the untrained model with epsilon = 0.
    private = _private()
    with pytest.raises(ValueError, match=r"No training step.*allow_untrained=True"):
        private.export(tmp_path / "model")
    assert not os.listdir(tmp_path)
    private.export(tmp_path / "model", allow_untrained=True)
    assert (tmp_path / "model" / "saved_model.pb").exists()


def test_export_never_deletes_the_user_s_files(trained, tmp_path):
    # Before: the folder was replaced by the SavedModel (the files were gone), and a
    # user's `model.tmp/` beside it was deleted.
    target = tmp_path / "model"
    target.mkdir()
    (target / "thesis.tex").write_text("mine")
    (tmp_path / "model.tmp").mkdir()
    (tmp_path / "model.tmp" / "notes").write_text("mine too")
    with pytest.raises(ValueError, match=r"holds files that are not a tfdp export "
                                         r"\(thesis\.tex, \.\.\.\).*never deletes"):
        trained.export(target, overwrite=True)
    assert (target / "thesis.tex").read_text() == "mine"
    assert (tmp_path / "model.tmp" / "notes").read_text() == "mine too"
    assert sorted(os.listdir(tmp_path)) == ["model", "model.tmp"]


def test_export_to_a_file_is_refused_and_leaves_nothing(trained, tmp_path):
    # Before: NotADirectoryError, and `file.tmp/` left behind.
    (tmp_path / "model.bin").write_text("data")
    with pytest.raises(ValueError, match=r"it is a file, not a folder"):
        trained.export(tmp_path / "model.bin")
    assert sorted(os.listdir(tmp_path)) == ["model.bin"]


def test_an_earlier_export_is_replaced_only_with_overwrite(trained, tmp_path):
    target = tmp_path / "model"
    trained.export(target)
    first = (target / "saved_model.pb").stat().st_mtime_ns
    with pytest.raises(ValueError, match=r"holds an earlier tfdp export; pass overwrite=True"):
        trained.export(target)
    assert (target / "saved_model.pb").stat().st_mtime_ns == first
    trained.export(target, overwrite=True)
    assert (target / "assets" / "privacy_report.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no temporary left
    loaded = tf.saved_model.load(str(target))
    assert loaded.signatures["serve"](images=tf.zeros([1, 8, 8, 1], tf.uint8))[
        "logits"].shape == (1, 2)


def test_an_empty_folder_is_a_fine_target(trained, tmp_path):
    (tmp_path / "model").mkdir()
    trained.export(tmp_path / "model")
    assert (tmp_path / "model" / "saved_model.pb").exists()


def _pretrained_with_batch_norm():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="classifier")(x))


@pytest.mark.parametrize("trainable, trained", [
    ("head", {"classifier"}),
    ("all", {"conv", "classifier"}),
    (["con*"], {"conv", "classifier"}),
])
def test_make_private_fine_tuning_modes(trainable, trained):
    model = _pretrained_with_batch_norm()
    before = {v.path: v.numpy() for v in model.variables}
    private = tfdp.make_private(model, (IMAGES + 100, LABELS), batch_size=10, num_steps=1,
                                optimizer=keras.optimizers.SGD(1.0), trainable=trainable,
                                **COMMON)
    private.fit(verbose=False)
    changed = {v.path.split("/")[0] for v in model.variables
               if not np.array_equal(v.numpy(), before[v.path])}
    # The BatchNorm is frozen in every mode: its statistics and scale never move.
    assert changed == trained


def test_make_private_refuses_a_pattern_that_matches_no_layer():
    with pytest.raises(ValueError, match="'dense_typo' matches no layer"):
        tfdp.make_private(_pretrained_with_batch_norm(), (IMAGES, LABELS), batch_size=10,
                          num_steps=1, optimizer="sgd", trainable=["dense_typo"], **COMMON)
    # Without trainable=, a trainable BatchNorm is refused as before.
    with pytest.raises(ValueError, match="BatchNorm"):
        tfdp.make_private(_pretrained_with_batch_norm(), (IMAGES, LABELS), batch_size=10,
                          num_steps=1, optimizer="sgd", **COMMON)
