"""Export: the SavedModel serves images (pixel values 0 to 255) the three ways users load it."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.export import saved_model
from tfdp.models import build_tramer_cnn


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A Tramer & Boneh CNN exported with its privacy report; (model, export_dir, images)."""
    tmp_path = tmp_path_factory.mktemp("export")
    model = build_tramer_cnn(10)
    report = tmp_path / "privacy_report.json"
    report.write_text(json.dumps({"epsilon": 1.5, "delta": 1e-5}))
    export_dir = str(tmp_path / "export")
    saved_model.export_saved_model(
        model, export_dir, image_shape=(28, 28, 1), asset_paths=[str(report)]
    )
    images = np.random.default_rng(0).integers(0, 256, size=(5, 28, 28, 1), dtype=np.uint8)
    return model, export_dir, images


def _expected(model, images):
    return model(images.astype(np.float32), training=False).numpy()


def test_written_atomically_with_the_privacy_report_inside(exported):
    _, export_dir, _ = exported
    assert not os.path.exists(export_dir + ".tmp")
    asset = os.path.join(export_dir, "assets", "privacy_report.json")
    assert json.loads(open(asset).read())["epsilon"] == 1.5


def test_tf_saved_model_load_signatures(exported):
    model, export_dir, images = exported
    loaded = tf.saved_model.load(export_dir)
    for name in ("serve", "serving_default"):
        out = loaded.signatures[name](images=tf.constant(images, tf.float32))
        assert set(out) == {"logits"}
        np.testing.assert_allclose(out["logits"], _expected(model, images), rtol=1e-5, atol=1e-5)


def test_keras_tfsm_layer(exported):
    model, export_dir, images = exported
    layer = keras.layers.TFSMLayer(export_dir, call_endpoint="serve")
    for batch in (tf.constant(images), images.astype(np.float32), images.astype(np.float64)):
        out = layer(batch)
        np.testing.assert_allclose(out["logits"], _expected(model, images), rtol=1e-5, atol=1e-5)


def test_the_loaded_serve_function_takes_uint8_and_float_images_alike(exported):
    model, export_dir, images = exported
    loaded = tf.saved_model.load(export_dir)  # its variables live as long as it does
    serve = loaded.serve
    for batch in (images, tf.constant(images), images.astype(np.float32),
                  images.astype(np.float64), tf.constant(images, tf.float64),
                  images.astype(np.float32).tolist()):
        np.testing.assert_allclose(serve(batch)["logits"], _expected(model, images),
                                   rtol=1e-5, atol=1e-5)


def _saved_model_cli(export_dir, npy, out_dir):
    return subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "saved_model_cli"), "run",
         "--dir", export_dir, "--tag_set", "serve", "--signature_def", "serving_default",
         "--inputs", f"images={npy}", "--outdir", str(out_dir)],
        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_saved_model_cli_run(exported, tmp_path):
    # It failed with "Could not find variable logits/bias" for the tf.Module export.
    model, export_dir, images = exported
    np.save(tmp_path / "images.npy", images)
    result = _saved_model_cli(export_dir, tmp_path / "images.npy", tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "out" / "logits.npy"),
                               _expected(model, images), rtol=1e-5, atol=1e-5)


def test_saved_model_cli_refuses_a_float_npy_scaled_to_one(exported, tmp_path):
    # A float .npy in [0, 1] was converted to uint8 (0s and 1s) and served as a black image.
    _, export_dir, images = exported
    np.save(tmp_path / "scaled.npy", images / 255.0)
    result = _saved_model_cli(export_dir, tmp_path / "scaled.npy", tmp_path / "out")
    assert result.returncode != 0
    assert "images scaled to [0, 1]? Pass images * 255" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out" / "logits.npy").exists()


def test_wrong_images_get_a_message_naming_the_expected_shape(tmp_path):
    # A model with GroupNorm: a wrong image size used to fail deep inside it.
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.GroupNormalization(groups=3)(keras.layers.Conv2D(6, 3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x)))
    export_dir = str(tmp_path / "export")
    saved_model.export_saved_model(model, export_dir, image_shape=(8, 8, 3))
    serve = tf.saved_model.load(export_dir).signatures["serve"]
    with pytest.raises(Exception, match=r"images \[batch, 8, 8, 3\]"):
        serve(images=tf.zeros([2, 9, 9, 3], tf.float32))
    with pytest.raises(Exception, match="float"):  # a tf.Tensor of another dtype
        serve(images=tf.zeros([2, 8, 8, 3], tf.int32))


@pytest.mark.parametrize("scale", ["unit", "unit_without_a_one", "unit_overshot",
                                   "unit_beside_0_255", "signed", "nan", "over"])
def test_float_images_outside_0_255_are_refused_with_how_to_convert(exported, scale):
    # Images scaled to [0, 1] were converted to uint8 by TensorFlow and served as a black
    # image without a word; those in [-1, 1] wrapped around.
    _, export_dir, images = exported
    loaded = tf.saved_model.load(export_dir)
    batch = images.astype(np.float64) / 255.0
    match = r"largest value in \(0, 2\]: images scaled to \[0, 1\]\? Pass images \* 255"
    if scale == "unit_without_a_one":
        batch = np.minimum(batch, 0.99)
    elif scale == "unit_overshot":  # a resize's overshoot
        batch[:, 0, 0, 0] = 1.01
    elif scale == "unit_beside_0_255":  # one caller's [0, 1] image batched with others'
        batch = images.astype(np.float64)
        batch[2] /= 255.0
    elif scale == "signed":
        batch, match = batch * 2 - 1, r"below 0, above 255 or NaN.*\(images \+ 1\) \* 127\.5"
    elif scale == "nan":
        batch, match = images.astype(np.float64), "below 0, above 255 or NaN"
        batch[1, 3, 3, 0] = np.nan
    elif scale == "over":
        batch, match = images.astype(np.float64), "below 0, above 255 or NaN"
        batch[4, 0, 0, 0] = 255.5
    for serve in (loaded.serve, loaded.signatures["serve"]):
        with pytest.raises(tf.errors.InvalidArgumentError, match=match):
            serve(images=batch.astype(np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        loaded.serve(batch)  # float64


def test_black_and_dark_batches(exported):
    # An all-black float batch is the same in any scale: served. A uint8 batch is never read
    # as [0, 1], however dark.
    model, export_dir, _ = exported
    loaded = tf.saved_model.load(export_dir)
    assert loaded.signatures["serve"](images=np.zeros((2, 28, 28, 1), np.float32))[
        "logits"].shape == (2, 10)
    dark = np.zeros((2, 28, 28, 1), np.uint8)
    dark[0, 5, 5, 0] = 1
    np.testing.assert_allclose(loaded.serve(dark)["logits"], _expected(model, dark),
                               rtol=1e-5, atol=1e-5)


def test_an_empty_batch_and_a_wrong_rank(exported, tmp_path):
    # An empty batch failed with an unrelated graph error; a rank-3 input got "Incompatible
    # shapes: [3] vs. [2]" where it reached the graph (serve's own check names the shape now).
    _, export_dir, _ = exported
    serve = tf.saved_model.load(export_dir).signatures["serve"]
    assert serve(images=np.zeros((0, 28, 28, 1), np.float32))["logits"].shape == (0, 10)
    loaded = tf.saved_model.load(export_dir)
    assert loaded.serve(np.zeros((0, 28, 28, 1), np.uint8))["logits"].shape == (0, 10)
    with pytest.raises(TypeError, match=r"\(None, 28, 28, 1\)"):  # Python: TF's binding
        serve(images=np.zeros((28, 28, 1), np.uint8))
    np.save(tmp_path / "one.npy", np.zeros((28, 28, 1), np.uint8))  # saved_model_cli: serve
    result = _saved_model_cli(export_dir, tmp_path / "one.npy", tmp_path / "out")
    assert result.returncode != 0
    assert "which has shape (None, 28, 28, 1)" in result.stderr, result.stderr[-2000:]
