"""make_private refuses what it cannot train right; PrivateTraining.export never deletes."""

import dataclasses
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import private_training

IMAGES = np.zeros((40, 8, 8, 1), np.uint8)
LABELS = np.arange(40) % 2
PRIVACY = dict(noise_multiplier=1.0, target_delta=1e-5, l2_clip_norm=1.0)
OPTIMIZATION = dict(optimizer_fn=keras.optimizers.SGD, batch_size=10, num_steps=1)
OPTIMIZATION_FIELDS = {field.name for field in dataclasses.fields(tfdp.OptimizationConfig)}


def config(trainable=None, data_dir=None, **settings):
    """A PrivateTrainingConfig of PRIVACY and OPTIMIZATION, with `settings` in their groups."""
    privacy = dict(PRIVACY, **{k: v for k, v in settings.items()
                               if k not in OPTIMIZATION_FIELDS})
    optimization = dict(OPTIMIZATION, **{k: v for k, v in settings.items()
                                         if k in OPTIMIZATION_FIELDS})
    return tfdp.PrivateTrainingConfig(
        privacy=tfdp.PrivacyConfig(**privacy),
        optimization=tfdp.OptimizationConfig(**optimization),
        trainable=trainable, data_dir=data_dir)


def _model(shape=(8, 8, 1)):
    return keras.Sequential([keras.Input(shape), keras.layers.Flatten(), keras.layers.Dense(2)])


def _private(**settings):
    return tfdp.make_private(_model(), (IMAGES, LABELS), config(**settings))


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
        tfdp.make_private(_model(), data, config())


def test_unknown_cardinality_is_read_up_to_a_documented_limit(monkeypatch):
    monkeypatch.setattr(private_training, "MAX_UNKNOWN_CARDINALITY_EXAMPLES", 100)
    endless = tf.data.Dataset.from_tensor_slices((IMAGES, LABELS)).repeat().filter(
        lambda image, label: True)
    assert int(endless.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    with pytest.raises(ValueError, match=r"unknown cardinality with more than 100 examples"):
        tfdp.make_private(_model(), endless, config())
    short = tf.data.Dataset.from_tensor_slices((IMAGES, LABELS)).filter(lambda i, l: True)
    private = tfdp.make_private(_model(), short, config())
    assert private.source.num_examples == 40


@pytest.mark.parametrize("settings, message", [
    # Before: ZeroDivisionError.
    (dict(batch_size=0), r"batch_size must be a positive int .* got 0"),
    (dict(batch_size=2.5), r"batch_size must be a positive int .* got 2\.5"),
    # Before: accepted, then failed in fit.
    (dict(optimizer_fn=None), r"optimizer_fn=None is not a builder"),
    (dict(optimizer_fn="sgd"), r"optimizer_fn='sgd' is not a builder: .*lambda: "),
    (dict(optimizer_fn=lambda: "sgd"), r"optimizer_fn\(\) returned str, not a "
                                       r"keras.optimizers.Optimizer"),
])
def test_bad_batch_size_and_optimizer_fn_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        tfdp.make_private(_model(), (IMAGES, LABELS), config(**settings))


@pytest.mark.parametrize("shape", [(9, 8, 1), (8, 9, 1), (8, 8, 3)])
def test_images_that_do_not_match_the_model_are_refused(shape):
    # Before: accepted, then failed deep in TF at the first step.
    with pytest.raises(ValueError, match=r"The images are \[N, 8, 8, 1\] but the model takes "
                                         rf"inputs \(None, {shape[0]}, {shape[1]}, {shape[2]}\)"):
        tfdp.make_private(_model(shape), (IMAGES, LABELS), config())


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
    private = tfdp.make_private(model, (IMAGES + 100, LABELS), config(
        trainable=trainable, optimizer_fn=lambda: keras.optimizers.SGD(1.0)))
    private.fit(verbose=False)
    changed = {v.path.split("/")[0] for v in model.variables
               if not np.array_equal(v.numpy(), before[v.path])}
    # The BatchNorm is frozen in every mode: its statistics and scale never move.
    assert changed == trained


def test_make_private_refuses_a_pattern_that_matches_no_layer():
    with pytest.raises(ValueError, match="'dense_typo' matches no layer"):
        tfdp.make_private(_pretrained_with_batch_norm(), (IMAGES, LABELS),
                          config(trainable=["dense_typo"]))
    # Without trainable=, a trainable BatchNorm is refused as before.
    with pytest.raises(ValueError, match="BatchNorm"):
        tfdp.make_private(_pretrained_with_batch_norm(), (IMAGES, LABELS), config())


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
        tfdp.make_private(model(), data, config())


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
        tfdp.make_private(_model(), (IMAGES, LABELS), config(
            target_delta=0.05, noise_multiplier=None, num_steps=3, target_epsilon=3.0))
    deltas = [w for w in caught if "1/num_examples" in str(w.message)]
    assert len(deltas) == 1, [str(w.message) for w in deltas]
    assert "delta=0.05 >= 1/num_examples=0.025" in str(deltas[0].message)


# -- The config: the CLI's own groups, each setting used or refused -------------------


@pytest.mark.parametrize("settings, message", [
    (dict(data_normalization={"l2_clip_norm_mean": 1.0}),
     r"tfdp.PrivacyConfig.data_normalization=\{.*\}: make_private does not support it "
     r"\(private feature normalization .*\). Leave it at None, or train with "
     r"python -m tfdp.main"),
    (dict(simulation={"reference": {}}), r"tfdp.PrivacyConfig.simulation=.*does not support"),
    (dict(study_dir="study"), r"tfdp.PrivacyConfig.study_dir='study': make_private does not "
                              r"support it \(only python -m tfdp.main appends"),
    (dict(sampling="shuffle"), r"tfdp.OptimizationConfig.sampling='shuffle': make_private "
                               r"does not support it \(PrivateTraining.fit draws Poisson "
                               r"batches.*Leave it at 'poisson'"),
])
def test_a_setting_only_the_trainer_supports_is_refused_naming_it(settings, message):
    with pytest.raises(ValueError, match=message):
        config(**settings)


def test_a_config_of_another_kind_is_refused():
    with pytest.raises(ValueError, match=r"config must be a tfdp.PrivateTrainingConfig, got "
                                         r"PrivacyConfig"):
        tfdp.make_private(_model(), (IMAGES, LABELS), tfdp.PrivacyConfig(**PRIVACY))
    with pytest.raises(ValueError, match=r"PrivateTrainingConfig.privacy must be a "
                                         r"tfdp.PrivacyConfig, got NoneType"):
        tfdp.PrivateTrainingConfig(privacy=None,
                                   optimization=tfdp.OptimizationConfig(**OPTIMIZATION))
    # Settings given as keywords: each is named with the group that takes it.
    with pytest.raises(ValueError, match=r"one config, not as keywords.*batch_size -> "
                                         r"OptimizationConfig.*epochs -> OptimizationConfig "
                                         r"\(as num_steps.*l2_clip_norm -> PrivacyConfig.*"
                                         r"optimizer -> OptimizationConfig \(as optimizer_fn"
                                         r".*trainable -> PrivateTrainingConfig.*"
                                         r"verbose -> no setting of make_private"):
        tfdp.make_private(_model(), (IMAGES, LABELS), batch_size=10, epochs=1, optimizer="sgd",
                          trainable="all", verbose=1, **PRIVACY)
    with pytest.raises(ValueError, match=r"config must be a tfdp.PrivateTrainingConfig, got "
                                         r"NoneType"):
        tfdp.make_private(_model(), (IMAGES, LABELS))


def test_a_gin_binding_that_would_fill_a_field_is_refused():
    import gin  # pylint: disable=g-import-not-at-top

    gin.parse_config("tfdp.PrivacyConfig.noise_multiplier = 3.0")
    try:
        with pytest.raises(ValueError, match=r"gin binds tfdp.PrivacyConfig.noise_multiplier in "
                                             r"this process.*gin.clear_config\(\)"):
            config()
    finally:
        gin.clear_config()
    config()


def test_each_supported_setting_reaches_the_mechanism_or_the_model():
    private = _private(accountant="pld", num_microbatches=2, normalize_update=True,
                       clipping="vectorized", noise_seed=7, sampling_seed=11,
                       accumulation_steps=2, ema_decay=0.9, num_steps=2)
    mechanism = private.mechanism
    assert (mechanism.accountant, mechanism.num_microbatches, mechanism.normalize_update,
            mechanism.num_steps, mechanism.batch_size, mechanism.sampling) == (
                "pld", 2, True, 2, 10, "poisson")
    assert mechanism.fixed_seeds == ("sampling_seed", "noise_seed")
    assert (private.model.clipping, private.model.accumulation_steps,
            private.model.ema_decay) == ("vectorized", 2, 0.9)
    assert private._sampling_seed == 11  # pylint: disable=protected-access
    private.fit(verbose=False)
    assert private.steps == 2
    report = private.privacy_report()
    assert report["exported_parameters"] == "ema"


# Slow-only (12 s of the 2-core host): by default, tests/training/one_step_path_test.py builds
# make_private's update and the CLI's, each from scratch, under the same fixed seeds and
# compares them bit for bit.
@pytest.mark.slow
def test_fixed_seeds_reproduce_the_run():
    keras.utils.set_random_seed(0)
    model = _model()
    start = [v.numpy() for v in model.weights]
    weights = []
    for _ in range(2):
        for variable, value in zip(model.weights, start):
            variable.assign(value)
        private = tfdp.make_private(model, (IMAGES + 50, LABELS), config(
            noise_seed=3, sampling_seed=4, num_steps=2))
        private.fit(verbose=False)
        weights.append([v.numpy() for v in model.weights])
    for first, second in zip(*weights):
        np.testing.assert_array_equal(first, second)
    assert not np.array_equal(weights[0][0], start[0])


def test_the_mechanism_is_planned_as_the_trainer_plans_it():
    from tfdp import planning  # pylint: disable=g-import-not-at-top

    settings = config(target_epsilon=3.0, noise_multiplier=None, num_steps=5)
    private = tfdp.make_private(_model(), (IMAGES, LABELS), settings)
    assert private.mechanism == planning.private_mechanism(
        settings.privacy, settings.optimization, num_examples=40)


@pytest.mark.parametrize("epochs, num_steps", [(3, 12), (0.5, 2), (0.01, 1), (2.5, 10)])
def test_num_steps_for_epochs(epochs, num_steps):
    assert tfdp.num_steps_for_epochs(epochs, num_examples=40, batch_size=10) == num_steps


@pytest.mark.parametrize("kwargs, message", [
    (dict(epochs=0), "epochs must be a finite number > 0, got 0"),
    (dict(epochs=float("inf")), "epochs must be a finite number > 0"),
    (dict(epochs=True), "epochs must be a finite number > 0"),
    (dict(epochs=1, num_examples=0), "num_examples must be a positive int, got 0"),
    (dict(epochs=1, batch_size=2.0), r"batch_size must be a positive int, got 2\.0"),
])
def test_num_steps_for_epochs_refuses_what_has_no_length(kwargs, message):
    args = dict(num_examples=40, batch_size=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        tfdp.num_steps_for_epochs(**args)


def test_doctests_pass():
    import doctest  # pylint: disable=g-import-not-at-top

    failed, attempted = doctest.testmod(private_training, verbose=False)
    assert attempted and not failed


class _Opened(Exception):
    """Raised by a stand-in TFDSSource once it has seen what it was asked to open."""


def test_evaluate_on_a_dataset_name_reads_its_test_split_from_the_training_data_dir(
        trained, monkeypatch):
    opened = []

    def source(name, split, *, data_dir=None, **kwargs):
        opened.append((name, split, data_dir))
        raise _Opened

    monkeypatch.setattr(private_training.data, "TFDSSource", source)
    monkeypatch.setattr(trained.source, "data_dir", "/data/tfds", raising=False)
    for kwargs in ({}, {"split": "validation", "data_dir": "/other"}):
        with pytest.raises(_Opened):
            trained.evaluate("fashion_mnist", **kwargs)
    assert opened == [("fashion_mnist", "test", "/data/tfds"),
                      ("fashion_mnist", "validation", "/other")]


def test_a_data_dir_with_arrays_is_refused_not_ignored(trained):
    with pytest.raises(ValueError, match=r"data_dir='/data/tfds' is read only for a prepared "
                                         r"TFDS dataset given by name, but the data is tuple"):
        tfdp.make_private(_model(), (IMAGES, LABELS), config(data_dir="/data/tfds"))
    with pytest.raises(ValueError, match=r"data_dir='/x' is read only .* data is tuple"):
        trained.evaluate((IMAGES, LABELS), data_dir="/x")
