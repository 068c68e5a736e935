"""Fine-tuning a pretrained backbone: loading routes, trainable modes, cached features."""

import os
import shutil
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import accounting
from tfdp import data
from tfdp import features as features_lib
from tfdp import models
from tfdp.export import privacy_report
from tfdp.export import saved_model
from tfdp.training.dp_model import DPModel


@pytest.fixture(scope="module")
def pretrain_workdir(once_per_session, run_smoke_module):
    """A finished 2-step tfdp workdir of build_tramer_cnn (28x28x1, 10 classes) with an EMA.

    Trained on the mock 'test' split: disjoint from the 'train' split the fine-tuning tests
    train on, as a backbone's data must be (`tfdp.features.check_backbone_data`).
    """
    def pretrain(folder):
        run_smoke_module(folder / "wd", ["fashion_mnist.gin"], [
            "tfdp.OptimizationConfig.ema_decay = 0.9", "tfdp.DataConfig.train_split = 'test'"])

    # The tests read it (and copy it to change it): one run for both xdist workers.
    return str(once_per_session("finetune_pretrain", pretrain) / "wd")


@pytest.fixture(scope="module")
def keras_backbone(tmp_path_factory):
    """A `.keras` file of build_tramer_cnn with random weights, and the model."""
    keras.utils.set_random_seed(1)
    model = models.build_tramer_cnn(10)
    path = str(tmp_path_factory.mktemp("keras") / "tramer.keras")
    model.save(path)
    return path, model


def _images(shape, n=4, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (n, *shape)).astype(np.uint8)


def _trainable_layers(model):
    return sorted({v.path.split("/")[0] for v in model.trainable_variables})


# -- Loading routes ----------------------------------------------------------------------


def test_keras_file_backbone_keeps_its_weights_and_gets_a_new_head(keras_backbone):
    path, original = keras_backbone
    model = models.build_finetune_model(3, (28, 28, 1), backbone=path, trainable="all")
    assert model.output_shape == (None, 3)
    trunk = model.get_layer("trunk")
    # The trunk is the backbone up to its last Dense layer's input (32 tanh units).
    assert trunk.output_shape == (None, 32)
    x = _images((28, 28, 1)).astype(np.float32)
    features = keras.Model(original.inputs, original.get_layer("logits").input)(x)
    np.testing.assert_allclose(trunk(x), features, atol=1e-6)
    head = model.get_layer("head").get_layer("head_logits")
    assert not np.any(head.kernel.numpy())  # head_initializer="zeros"


def test_head_initializer_is_used(keras_backbone):
    model = models.build_finetune_model(3, (28, 28, 1), backbone=keras_backbone[0],
                                        head_initializer="ones")
    np.testing.assert_array_equal(model.get_layer("head").get_layer("head_logits").kernel, 1.0)


@pytest.mark.slow
def test_workdir_backbone_holds_the_exported_ema_parameters(pretrain_workdir):
    backbone, preprocess = models.load_backbone(pretrain_workdir)
    assert preprocess is None
    x = _images((28, 28, 1))
    loaded = tf.saved_model.load(os.path.join(pretrain_workdir, "export"))
    served = loaded.serve
    np.testing.assert_allclose(backbone(x.astype(np.float32)),
                               served(images=tf.constant(x))["logits"], atol=1e-5)
    # The EMA differs from the last iterate after 2 steps, so this tells them apart.
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(
        os.path.join(pretrain_workdir, "checkpoints")))
    last = reader.get_tensor("optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE")
    assert not np.allclose(backbone.trainable_variables[0].numpy(), last)


def test_a_workdir_backbone_named_like_a_glob_pattern(pretrain_workdir, tmp_path):
    # TensorFlow reads checkpoint paths as glob patterns: `sweep[lr=0.5]/checkpoints` held
    # no checkpoint for it.
    named = tmp_path / "sweep[lr=0.5] {a,b}*?"
    shutil.copytree(pretrain_workdir, named)
    backbone, _ = models.load_backbone(str(named))
    expected, _ = models.load_backbone(pretrain_workdir)
    for got, want in zip(backbone.weights, expected.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.slow
def test_workdir_backbone_errors(pretrain_workdir, tmp_path):
    with pytest.raises(models.BackboneError, match="does not exist"):
        models.load_backbone(str(tmp_path / "nowhere"))
    with pytest.raises(models.BackboneError, match="not a tfdp workdir"):
        models.load_backbone(str(tmp_path))
    no_checkpoint = tmp_path / "no_checkpoint"
    no_checkpoint.mkdir()
    shutil.copy(os.path.join(pretrain_workdir, "operative_config.gin"), no_checkpoint)
    with pytest.raises(models.BackboneError, match="no checkpoint.*Run \\(or resume\\)"):
        models.load_backbone(str(no_checkpoint))
    unfinished = tmp_path / "unfinished"
    shutil.copytree(pretrain_workdir, unfinished)
    os.remove(unfinished / "FINISHED")
    with pytest.raises(models.BackboneError, match="not finished"):
        models.load_backbone(str(unfinished))
    with pytest.raises(models.BackboneError, match="not a '.keras' file"):
        models.load_backbone(str(unfinished / "privacy_report.json"))
    with pytest.raises(models.BackboneError, match="only for keras.applications"):
        models.load_backbone(pretrain_workdir, backbone_weights="w.h5")


@pytest.mark.slow
def test_workdir_backbone_whose_weights_do_not_match(pretrain_workdir, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(pretrain_workdir, changed)
    config = (changed / "operative_config.gin").read_text()
    (changed / "operative_config.gin").write_text(config.replace(
        "@tfdp.models.build_tramer_cnn", "@tfdp.models.build_scatternet_linear"))
    with pytest.raises(models.BackboneError, match="do not match the model rebuilt"):
        models.load_backbone(str(changed))


@pytest.fixture(scope="module")
def application_weights(tmp_path_factory):
    """EfficientNetB0 at 32x32 (random weights, nothing downloads) saved as a weights file."""
    keras.utils.set_random_seed(2)
    app = keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3))
    path = str(tmp_path_factory.mktemp("app") / "efficientnetb0.weights.h5")
    app.save_weights(path)
    return path, app


@pytest.mark.slow
def test_keras_application_with_local_weights(application_weights):
    path, app = application_weights
    model = models.build_finetune_model(
        5, (28, 28, 1), backbone="keras.applications.EfficientNetB0", backbone_weights=path,
        backbone_input_shape=(32, 32, 3), trainable="all")
    x = _images((28, 28, 1), n=2)
    rgb = tf.image.resize(tf.image.grayscale_to_rgb(tf.constant(x, tf.float32)), (32, 32))
    # EfficientNet's preprocess_input is the identity (it rescales inside the model).
    expected = keras.Model(app.inputs, app.get_layer("predictions").input)(rgb)
    np.testing.assert_allclose(model.get_layer("trunk")(x.astype(np.float32)), expected,
                               atol=1e-4)
    batch_norms = [layer for layer in app.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert batch_norms
    bn_names = {layer.name for layer in model.get_layer("trunk").get_layer(
        "backbone_trunk").layers if isinstance(layer, keras.layers.BatchNormalization)}
    assert bn_names and not bn_names & set(_trainable_layers(model))
    models.validate_dp_model(model)  # frozen BatchNorm is accepted


@pytest.mark.slow
def test_keras_application_errors(application_weights, keras_backbone, tmp_path):
    with pytest.raises(models.BackboneError, match="Unknown Keras application.*ResNet50"):
        models.load_backbone("keras.applications.ResNet5O")
    with pytest.raises(models.BackboneError, match="needs backbone_weights.*nothing downloads"):
        models.load_backbone("keras.applications.EfficientNetB0")
    with pytest.raises(models.BackboneError, match="does not exist"):
        models.load_backbone("keras.applications.EfficientNetB0",
                             backbone_weights=str(tmp_path / "missing.h5"))
    other = str(tmp_path / "other.weights.h5")
    keras_backbone[1].save_weights(other)
    with pytest.raises(models.BackboneError, match="does not match keras.applications.Eff"):
        models.load_backbone("keras.applications.EfficientNetB0", backbone_weights=other,
                             input_shape=(32, 32, 3))


@pytest.mark.parametrize("layers", [
    # Before: AttributeError "The layer sequential has never been called" in _feature_tensor.
    lambda: [keras.layers.Conv2D(2, 3, name="conv"), keras.layers.GlobalAveragePooling2D(
        name="pool")],
    lambda: [keras.layers.Conv2D(2, 3, name="conv")],
])
def test_a_keras_backbone_without_a_dense_layer_is_a_backbone_error(layers, tmp_path):
    path = str(tmp_path / "nodense.keras")
    keras.Sequential([keras.Input((8, 8, 1)), *layers()]).save(path)
    with pytest.raises(models.BackboneError, match=r"has no Dense layer whose input would be "
                                                   r"the features; name the layer .*"
                                                   r"feature_layer=.*its layers: conv"):
        models.build_finetune_model(3, (8, 8, 1), backbone=path)
    # Doing as told works.
    model = models.build_finetune_model(3, (8, 8, 1), backbone=path, feature_layer="conv")
    assert model.output_shape == (None, 3)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_keras_file_is_called_corrupt_not_missing(keras_backbone, tmp_path, damage):
    # Before: "File not found: filepath=... Please ensure the file is an accessible `.keras`
    # zip file", for a file that exists.
    path = tmp_path / "backbone.keras"
    original = open(keras_backbone[0], "rb").read()
    path.write_bytes(b"not a zip" * 20 if damage == "garbage" else original[:len(original) // 2])
    with pytest.raises(models.BackboneError) as error:
        models.load_backbone(str(path))
    message = str(error.value)
    assert "exists" in message and "not a valid '.keras' file" in message, message
    assert "not found" not in message.lower()


# -- Trainable modes -----------------------------------------------------------------------


def test_trainable_modes(keras_backbone):
    build = lambda trainable: models.build_finetune_model(  # noqa: E731
        10, (28, 28, 1), backbone=keras_backbone[0], trainable=trainable)
    # Keras numbers layer names per session: read them from the backbone.
    original = keras_backbone[1]
    convs = sorted(layer.name for layer in original.layers
                   if isinstance(layer, keras.layers.Conv2D))
    dense = [layer.name for layer in original.layers
             if isinstance(layer, keras.layers.Dense) and layer.name != "logits"]
    assert len(convs) == 2 and len(dense) == 1
    head = build("head")
    assert _trainable_layers(head) == ["head_logits"]
    everything = build("all")
    assert _trainable_layers(everything) == sorted(convs + dense + ["head_logits"])
    assert _trainable_layers(build(["conv2d*"])) == sorted(convs + ["head_logits"])
    by_path = build([f"trunk/backbone_trunk/{dense[0]}"])
    assert _trainable_layers(by_path) == sorted(dense + ["head_logits"])
    # The old classifier is not part of the model.
    assert "logits" not in {layer.name for layer in everything.get_layer("trunk").get_layer(
        "backbone_trunk").layers}


def test_trainable_errors(keras_backbone):
    model = models.build_finetune_model(10, (28, 28, 1), backbone=keras_backbone[0])
    with pytest.raises(ValueError, match="'conv3d\\*' matches no layer.*conv2d"):
        models.set_trainable(model, ["conv2d*", "conv3d*"])
    for bad in ("everything", [], [3], "conv2d"):
        with pytest.raises(ValueError, match="trainable="):
            models.set_trainable(model, bad)


def test_a_pattern_matching_only_batch_norm_is_an_error():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(x))
    with pytest.raises(ValueError, match="only BatchNormalization.*always stay frozen"):
        models.set_trainable(model, ["bn"])
    assert models.set_trainable(model, ["*"]) == ["conv", "out"]
    assert not model.get_layer("bn").trainable
    assert models.set_trainable(model, "head") == ["out"]


# -- Inputs, export -------------------------------------------------------------------------


def test_rgb_images_into_a_grayscale_backbone_are_converted_and_resized(keras_backbone):
    path, original = keras_backbone
    model = models.build_finetune_model(10, (32, 32, 3), backbone=path)
    x = _images((32, 32, 3), n=3)
    gray = tf.image.resize(tf.image.rgb_to_grayscale(tf.constant(x, tf.float32)), (28, 28))
    expected = keras.Model(original.inputs, original.get_layer("logits").input)(gray)
    np.testing.assert_allclose(model.get_layer("trunk")(x.astype(np.float32)), expected,
                               atol=1e-4)
    with pytest.raises(ValueError, match="Cannot convert 2-channel"):
        models.build_finetune_model(10, (32, 32, 2), backbone=path)


def test_fine_tuned_model_exports_images_in_logits_out(keras_backbone, tmp_path):
    model = models.build_finetune_model(10, (32, 32, 3), backbone=keras_backbone[0],
                                        head_initializer="glorot_uniform")
    saved_model.export_saved_model(model, str(tmp_path / "export"), image_shape=(32, 32, 3))
    loaded = tf.saved_model.load(str(tmp_path / "export"))
    served = loaded.serve
    x = _images((32, 32, 3))
    np.testing.assert_allclose(served(images=tf.constant(x))["logits"],
                               model(x.astype(np.float32)), atol=1e-5)


# -- The frozen trunk: cached features, and augmult without a backward pass ---------------


def _mechanism(batch_size):
    return accounting.plan_mechanism(num_examples=64, batch_size=batch_size, num_steps=5,
                                     l2_clip_norm=0.1, target_delta=1e-5, noise_multiplier=1.0)


@pytest.mark.slow
def test_head_on_cached_features_equals_head_on_the_frozen_model(keras_backbone):
    model = models.build_finetune_model(10, (28, 28, 1), backbone=keras_backbone[0],
                                        head_initializer="glorot_uniform")
    extractor = models.frozen_feature_extractor(model)
    assert extractor is not None and extractor.compose(extractor.head) is model
    x, y = _images((28, 28, 1), n=8, seed=3), np.arange(8) % 10
    features = extractor.compute_features(x)
    assert features.shape == (8, 32) and features.dtype == np.float32
    start = [v.numpy() for v in extractor.head.trainable_variables]

    def one_step(wrapped, inputs):
        for v, s in zip(extractor.head.trainable_variables, start):
            v.assign(s)
        dp = DPModel(wrapped, _mechanism(8), noise_seed=7)
        dp.compile(optimizer=keras.optimizers.SGD(1.0))
        dp.train_on_batch(inputs, y)
        return [v.numpy() for v in extractor.head.trainable_variables]

    cached = one_step(extractor.head, features)
    on_the_fly = one_step(model, x.astype(np.float32))
    for a, b, s in zip(cached, on_the_fly, start):
        assert not np.allclose(a, s)  # the step moved the head
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_models_that_train_more_than_the_head_have_no_frozen_extractor(keras_backbone):
    model = models.build_finetune_model(10, (28, 28, 1), backbone=keras_backbone[0],
                                        trainable="all")
    assert models.frozen_feature_extractor(model) is None
    assert models.frozen_feature_extractor(models.build_tramer_cnn(10)) is None


def _op_types(concrete):
    graph_def = concrete.graph.as_graph_def()
    ops = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        ops.update(node.op for node in function.node_def)
    return ops


@pytest.mark.parametrize("trainable", ["head", pytest.param("all", marks=pytest.mark.slow)])
def test_augmult_views_run_no_backward_pass_through_a_frozen_trunk(keras_backbone, trainable):
    model = models.build_finetune_model(10, (28, 28, 1), backbone=keras_backbone[0],
                                        trainable=trainable)
    dp = DPModel(model, _mechanism(4), noise_seed=1)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    assert dp.clipping_path == "ghost"  # the frozen layers need no rule
    views = tf.TensorSpec([None, 2, 28, 28, 1], tf.float32)  # augmult = 2
    concrete = tf.function(dp.clip_and_accumulate).get_concrete_function(
        views, tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.float32))
    backward_convs = {"Conv2DBackpropFilter", "Conv2DBackpropInput"} & _op_types(concrete)
    if trainable == "head":
        assert not backward_convs
        assert [v.path for v in dp.trainable_variables] == ["head_logits/kernel",
                                                             "head_logits/bias"]
    else:
        assert backward_convs  # the check can fail


# -- End to end: train_and_evaluate from a tfdp workdir ------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("trainable, augmult, cached", [
    ("head", 0, True),
    pytest.param("head", 2, False, marks=pytest.mark.slow),
    pytest.param("all", 0, False, marks=pytest.mark.slow),
])
def test_train_and_evaluate_fine_tunes_a_workdir_backbone(
        pretrain_workdir, run_smoke, tmp_path, monkeypatch, trainable, augmult, cached):
    from tfdp.models import finetune  # pylint: disable=g-import-not-at-top

    computed = []

    def counting(trunk, images, **kwargs):
        computed.append(images.shape)
        return models.compute_model_features(trunk, images, **kwargs)

    monkeypatch.setattr(finetune, "compute_model_features", counting)
    workdir = tmp_path / "finetune"
    report = run_smoke(workdir, ["fashion_mnist_finetune.gin"], [
        f'PRETRAINED_BACKBONE = "{pretrain_workdir}"', f'TRAINABLE = "{trainable}"',
        "tfdp.DataConfig.train_split = 'train'",  # mock data: one 64-example split
        f"tfdp.AugmentationConfig.augmult = {augmult}"])
    assert report["steps"] == 2
    # Features of the train and test splits, computed once each, or never.
    assert computed == ([(64, 28, 28, 1)] * 2 if cached else [])
    # The feature cache (private state) is gone once the run is finished, and was never
    # exported: the export holds the SavedModel and the report only.
    assert not (workdir / features_lib.FEATURE_CACHE_DIR).exists()
    assert not [name for _, _, names in os.walk(workdir / "export") for name in names
                if name.endswith(".npy") or name == features_lib.FEATURE_CACHE_RECORD]
    checkpoint = tf.train.latest_checkpoint(str(workdir / "checkpoints"))
    trained = [name for name, _ in tf.train.list_variables(checkpoint)
               if name.startswith("optimizer/_trainable_variables/")]
    assert len(trained) == (2 if trainable == "head" else 8)
    # The export composes trunk and head: uint8 images in, logits out, the backbone's
    # trunk unchanged under "head".
    loaded = tf.saved_model.load(str(workdir / "export"))
    served = loaded.serve
    x = _images((28, 28, 1))
    logits = served(images=tf.constant(x))["logits"]
    assert logits.shape == (4, 10)
    if trainable == "head":
        backbone, _ = models.load_backbone(pretrain_workdir)
        features = keras.Model(backbone.inputs[0], backbone.get_layer("logits").input)(
            x.astype(np.float32))
        reader = tf.train.load_checkpoint(checkpoint)
        kernel, bias = (reader.get_tensor(name) for name in sorted(trained))
        np.testing.assert_allclose(logits, features @ kernel + bias, atol=1e-5)


@pytest.mark.slow
def test_a_resume_reads_the_feature_cache_instead_of_computing_the_features(
        pretrain_workdir, run_smoke, tmp_path, monkeypatch):
    # The features live in the workdir, and a resumed run reads them (after
    # checking them against the data and the extractor: tests/feature_cache_test.py).
    from tfdp.models import finetune  # pylint: disable=g-import-not-at-top

    computed = []

    def counting(trunk, images, **kwargs):
        computed.append(images.shape[0])
        return models.compute_model_features(trunk, images, **kwargs)

    monkeypatch.setattr(finetune, "compute_model_features", counting)
    params = [f'PRETRAINED_BACKBONE = "{pretrain_workdir}"', 'TRAINABLE = "head"',
              "tfdp.DataConfig.train_split = 'train'", "TARGET_EPSILON = None",
              "NOISE_MULTIPLIER = 1.0"]
    workdir = tmp_path / "finetune"
    # A run stopped after its checkpoint at step 2 still holds its cache: here, a finished
    # run whose cache was kept, extended to 4 steps.
    with monkeypatch.context() as keep:
        keep.setattr(features_lib, "remove_feature_cache", lambda workdir: None)
        run_smoke(workdir, ["fashion_mnist_finetune.gin"], params)
    assert computed == [64, 64]
    assert (workdir / features_lib.FEATURE_CACHE_DIR / features_lib.FEATURE_CACHE_RECORD).exists()
    kept = tmp_path / "kept_cache"
    shutil.copytree(workdir / features_lib.FEATURE_CACHE_DIR, kept)
    report = run_smoke(workdir, ["fashion_mnist_finetune.gin"], [*params, "NUM_STEPS = 4"])
    assert report["steps"] == 4
    assert computed == [64, 64, features_lib.PROBE_EXAMPLES]  # the probe only
    assert not (workdir / features_lib.FEATURE_CACHE_DIR).exists()
    # A finished workdir that still holds a cache (a kill after FINISHED, a tfdp that removed
    # it later): the same command again returns the finished run and removes the cache.
    shutil.copytree(kept, workdir / features_lib.FEATURE_CACHE_DIR)
    again = run_smoke(workdir, ["fashion_mnist_finetune.gin"], [*params, "NUM_STEPS = 4"])
    assert again["epsilon"] == report["epsilon"]
    assert computed == [64, 64, features_lib.PROBE_EXAMPLES]
    assert not (workdir / features_lib.FEATURE_CACHE_DIR).exists()


# -- The backbone's data: outside the fine-tuning guarantee, so public or disjoint ---------


@pytest.mark.parametrize("private", [True, False])
def test_a_backbone_trained_on_the_private_split_is_refused_before_any_output(
        run_smoke, tmp_path, pretrain_workdir, private):
    # (Mock data ignores slices; test_splits_overlap covers slices.) The private backbone is
    # the shared one, trained at epsilon = 3 on 'test': fine-tuning on 'test' shares it.
    if private:
        backbone, split = pretrain_workdir, "test"
    else:
        backbone, split = tmp_path / "backbone", "train"
        run_smoke(backbone, ["fashion_mnist.gin"], ["tfdp.train_and_evaluate.privacy = None"])
    workdir = tmp_path / "finetune"
    workdir.mkdir()
    trained = "at epsilon = 3" if private else "WITHOUT privacy"
    with pytest.raises(ValueError, match=trained + r".*shares examples with this run's private "
                                                   rf"split '{split}'.*disjoint public split"):
        run_smoke(workdir, ["fashion_mnist_finetune.gin"], [
            f'PRETRAINED_BACKBONE = "{backbone}"', 'TRAINABLE = "head"',
            f"tfdp.DataConfig.train_split = '{split}'"])
    assert os.listdir(workdir) == []


@pytest.mark.slow
def test_every_spelling_of_the_private_dataset_is_recognised(run_smoke, tmp_path):
    # A backbone trained WITHOUT privacy on fashion_mnist 'train' must be refused for
    # private fine-tuning on 'train' however the config spells the dataset
    # ('fashion_mnist:3.0.1': names are compared as identities, not strings).
    backbone = tmp_path / "backbone"
    run_smoke(backbone, ["fashion_mnist.gin"], ["tfdp.train_and_evaluate.privacy = None",
                                                "tfdp.DataConfig.dataset = 'fashion_mnist:3.*.*'"])
    for i, spelling in enumerate(["fashion_mnist", "fashion_mnist:3.0.1", "Fashion_MNIST",
                                  "FashionMnist"]):
        workdir = tmp_path / f"finetune_{i}"
        workdir.mkdir()
        with pytest.raises(ValueError, match=r"WITHOUT privacy on fashion_mnist:3\.\*\.\* "
                                             r"'train', which shares examples"):
            run_smoke(workdir, ["fashion_mnist_finetune.gin"], [
                f'PRETRAINED_BACKBONE = "{backbone}"', 'TRAINABLE = "head"',
                f"tfdp.DataConfig.dataset = '{spelling}'",
                "tfdp.DataConfig.train_split = 'train'"])
        assert os.listdir(workdir) == [], spelling


@pytest.mark.parametrize("spelling", [
    "fashion_mnist", "fashion_mnist:3.0.1", "fashion_mnist:3.*.*", "Fashion_MNIST",
    "FashionMnist", "fashion_mnist/fashion_mnist", "fashion_mnist/fashion_mnist:3.0.1"])
def test_dataset_identity_of_every_tfds_spelling(spelling):
    assert data.dataset_identity(spelling) == "fashion_mnist"
    assert data.same_dataset(spelling, "fashion_mnist")
    assert not data.same_dataset(spelling, "mnist")


def test_dataset_identity_of_a_name_tfds_refuses():
    with pytest.raises(ValueError, match="dataset_name"):
        data.dataset_identity(" fashion_mnist")


@pytest.mark.slow
def test_the_report_says_whence_the_backbone_came(run_smoke, tmp_path, pretrain_workdir,
                                                    keras_backbone):
    checked = run_smoke(tmp_path / "a", ["fashion_mnist_finetune.gin"], [
        f'PRETRAINED_BACKBONE = "{pretrain_workdir}"', 'TRAINABLE = "head"',
        "tfdp.DataConfig.train_split = 'train'"])
    assert checked["backbone"] == {
        "source": os.path.abspath(pretrain_workdir), "kind": "tfdp workdir", "verified": True,
        "dataset": "fashion_mnist", "train_split": "test", "input_source": "array_record",
        "privacy": {"epsilon": pytest.approx(3.0, rel=1e-3), "delta": 1e-5}}
    card = (tmp_path / "a" / "privacy_report.md").read_text()
    assert "outside this guarantee" in card and "shares no example" in card
    unchecked = run_smoke(tmp_path / "b", ["fashion_mnist_finetune.gin"], [
        f'PRETRAINED_BACKBONE = "{keras_backbone[0]}"', 'TRAINABLE = "head"',
        "tfdp.DataConfig.train_split = 'train'"])
    assert unchecked["backbone"]["verified"] is False
    assert "Not checked" in (tmp_path / "b" / "privacy_report.md").read_text()


@pytest.mark.parametrize("a, b, overlap", [
    ("train[:2000]", "train[2000:]", False), ("train[:2001]", "train[2000:]", True),
    ("train", "test", False), ("train[:50%]", "train[2000:]", True),
    ("test+train[:10]", "train[10:]", False), ("train[:2000]", "train[-58000:]", False),
    ("train[:10%]", "train[5999:6001]", True)])
def test_splits_overlap(a, b, overlap):
    with data.mock_data(num_examples=60000):
        assert data.splits_overlap("fashion_mnist", a, b) is overlap
        assert data.splits_overlap("fashion_mnist", b, a) is overlap


@keras.saving.register_keras_serializable("finetune_test")
class _BatchCenter(keras.layers.Layer):
    """Subtracts the batch mean, in any mode."""

    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True)


def test_a_cached_trunk_that_mixes_examples_is_refused(tmp_path):
    # Head-only fine-tuning caches the trunk's features, and only
    # the head is wrapped in the DPModel, so a trunk layer that centres by the batch mean
    # would make every cached feature depend on the other images of its batch.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, activation="relu")(keras.layers.Rescaling(1 / 255)(inputs))
    x = keras.layers.GlobalAveragePooling2D()(_BatchCenter(name="batch_center")(x))
    path = str(tmp_path / "mixing_backbone.keras")
    keras.Model(inputs, keras.layers.Dense(5, name="classifier")(x)).save(path)
    model = models.build_finetune_model(10, (16, 16, 3), backbone=path, trainable="head")
    with pytest.raises(models.ExampleMixingError,
                       match=r"In inference mode.*batch_center mixes examples"):
        models.frozen_feature_extractor(model)


def _with_backbone(dataset, split, input_source="array_record"):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    setattr(model, models.finetune.PROVENANCE_ATTRIBUTE, {
        "source": "/pretrain", "kind": "tfdp workdir", "verified": True, "dataset": dataset,
        "train_split": split, "input_source": input_source, "privacy": "NOT PRIVATE"})
    return model


@pytest.mark.parametrize("dataset, split, input_source, outcome", [
    # Each must be reported "Not checked", not "verified", and must not raise TFDS's
    # "pass image_size" for ImageNet's varying image sizes.
    ("imagenet2012", "train[:50%]", "array_record", "checked"),
    ("imagenet2012", "train[:60%]", "array_record", "shares examples"),
    ("imagenet_resized/32x32", "train", "array_record", "same images"),
    ("imagenet2012_subset/10pct", "train", "array_record", "same images"),
    ("imagenet2012", "train[:50%]", "jpeg_folder", "not checked"),  # its own example order
    ("ilsvrc2012", "train", "array_record", "not checked"),  # not a TFDS dataset
    ("imagenet-2012 (jpeg)", "train", "array_record", "not checked"),
    ("cifar10", "train", "array_record", "checked"),
])
def test_backbone_data_that_cannot_be_matched_is_refused_or_reported(dataset, split,
                                                                     input_source, outcome):
    from tfdp import features  # pylint: disable=g-import-not-at-top

    train = types.SimpleNamespace(name="imagenet2012", split="train[50%:]", data_dir=None,
                                  image_size=32)
    with data.mock_data(num_examples=100):
        if outcome in ("shares examples", "same images"):
            with pytest.raises(ValueError, match=outcome):
                features.check_backbone_data(_with_backbone(dataset, split, input_source),
                                             train)
            return
        result = features.check_backbone_data(
            _with_backbone(dataset, split, input_source), train)
    assert result["verified"] is (outcome == "checked")
    if outcome == "not checked":
        assert result["not_checked_because"]
        card = "\n".join(privacy_report._backbone_lines({"backbone": result}))
        assert "Not checked" in card and result["not_checked_because"] in card
