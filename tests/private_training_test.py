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
    assert loaded.signatures["serve"](images=tf.zeros([1, 8, 8, 1]))[
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
    pytest.param("all", {"conv", "classifier"}, marks=pytest.mark.slow),
    pytest.param(["con*"], {"conv", "classifier"}, marks=pytest.mark.slow),
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


# -- What make_private and PrivateTraining refuse, with a message -------------------


def test_evaluate_refuses_images_that_fit_refuses():
    # Before: evaluate() returned an accuracy for 9x9 images on an 8x8 model.
    private = _private()
    with pytest.raises(ValueError, match=r"The images are \[N, 9, 9, 1\] but the model takes "
                                         r"inputs \(None, 8, 8, 1\)"):
        private.evaluate((np.zeros((6, 9, 9, 1), np.uint8), np.zeros(6, np.int64)))
    assert set(private.evaluate((IMAGES, LABELS))) >= {"loss", "accuracy"}


def _two_outputs():
    inputs = keras.Input((8, 8, 1))
    flat = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, [keras.layers.Dense(2)(flat), keras.layers.Dense(2)(flat)])


def _frozen():
    model = _model()
    model.trainable = False
    return model


@pytest.mark.parametrize("model, data, message", [
    # Before: TypeError in private_training.py.
    (_two_outputs, (IMAGES, LABELS), r"The model has 2 outputs; make_private trains a "
                                     r"classifier with one output"),
    # Before: ValueError from deep inside ghost_clipping.py.
    (_frozen, (IMAGES, LABELS), r"has no trainable variables \(every layer is frozen"),
    # Before: numpy's "inhomogeneous shape" (or "all input arrays must have the same shape").
    (_model, ([np.zeros((8, 8, 1), np.uint8), np.zeros((9, 8, 1), np.uint8)], [0, 1]),
     r"The images have different shapes \(\(8, 8, 1\), \(9, 8, 1\)\): make_private trains "
     r"on images of one shape"),
    (_model, tf.data.Dataset.from_generator(
        lambda: iter([(np.zeros((8, 8, 1), np.uint8), 0), (np.zeros((9, 8, 1), np.uint8), 1)]),
        output_signature=(tf.TensorSpec([None, 8, 1], tf.uint8), tf.TensorSpec([], tf.int64))),
     r"The dataset's images have different shapes \(\(8, 8, 1\), \(9, 8, 1\)\)"),
    # Before: numpy's "'<' not supported between instances of 'str' and 'int'".
    (_model, (IMAGES, np.array(["cat", "dog"] * 20)),
     r"labels must be integers \[N\] = \[40\].*got <U3 \[40\] \(e.g. np.str_\('cat'\)\)|"
     r"labels must be integers \[N\] = \[40\].*got <U3 \[40\] \(e.g. 'cat'\)"),
])
def test_models_and_data_make_private_cannot_train_are_refused_with_a_message(model, data,
                                                                              message):
    with pytest.raises(ValueError, match=message):
        tfdp.make_private(model(), data, batch_size=10, num_steps=1, optimizer="sgd", **COMMON)


def test_export_to_an_empty_path_is_refused(trained, tmp_path, monkeypatch):
    # Before: FileNotFoundError from os.makedirs('').
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"export_dir='' names no folder"):
        trained.export("")
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_delta_warning_is_given_once_per_make_private(recwarn):
    # Before: 16 copies of "delta >= 1/num_examples" from one call (calibration builds a
    # DPMechanism per candidate sigma), whenever warnings were shown "always".
    import warnings  # pylint: disable=g-import-not-at-top

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tfdp.make_private(_model(), (IMAGES, LABELS), target_delta=0.05, l2_clip_norm=1.0,
                          batch_size=10, num_steps=3, target_epsilon=3.0, optimizer="sgd")
    deltas = [w for w in caught if "1/num_examples" in str(w.message)]
    assert len(deltas) == 1, [str(w.message) for w in deltas]
    assert "delta=0.05 >= 1/num_examples=0.025" in str(deltas[0].message)
