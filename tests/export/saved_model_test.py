"""Export: the SavedModel serves uint8 images the three ways users load it."""

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
        out = loaded.signatures[name](images=tf.constant(images))
        assert set(out) == {"logits"}
        np.testing.assert_allclose(out["logits"], _expected(model, images), rtol=1e-5, atol=1e-5)


def test_keras_tfsm_layer(exported):
    model, export_dir, images = exported
    layer = keras.layers.TFSMLayer(export_dir, call_endpoint="serve")
    out = layer(tf.constant(images))
    np.testing.assert_allclose(out["logits"], _expected(model, images), rtol=1e-5, atol=1e-5)


def test_saved_model_cli_run(exported, tmp_path):
    # It failed with "Could not find variable logits/bias" for the tf.Module export.
    model, export_dir, images = exported
    np.save(tmp_path / "images.npy", images)
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "saved_model_cli"), "run",
         "--dir", export_dir, "--tag_set", "serve", "--signature_def", "serving_default",
         "--inputs", f"images={tmp_path / 'images.npy'}", "--outdir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "out" / "logits.npy"),
                               _expected(model, images), rtol=1e-5, atol=1e-5)


def test_wrong_images_get_a_message_naming_the_expected_shape(tmp_path):
    # A model with GroupNorm: a wrong image size used to fail deep inside it.
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.GroupNormalization(groups=3)(keras.layers.Conv2D(6, 3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x)))
    export_dir = str(tmp_path / "export")
    saved_model.export_saved_model(model, export_dir, image_shape=(8, 8, 3))
    serve = tf.saved_model.load(export_dir).signatures["serve"]
    with pytest.raises(Exception, match=r"uint8 images \[batch, 8, 8, 3\]"):
        serve(images=tf.zeros([2, 9, 9, 3], tf.uint8))
    with pytest.raises(Exception, match="uint8"):
        serve(images=tf.zeros([2, 8, 8, 3], tf.float32))


def test_float_images_scaled_to_one_are_refused_with_how_to_convert(exported):
    # A float array in [0, 1] was converted to uint8 by TensorFlow and served as a black
    # image, without a word.
    _, export_dir, images = exported
    serve = tf.saved_model.load(export_dir).signatures["serve"]
    scaled = images.astype(np.float32) / 255.0
    scaled[0, 0, 0, 0] = 1.0
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"brightest pixel of this batch is 1.*\* 255\)\.round\(\)"):
        serve(images=scaled)
    np.testing.assert_array_equal(  # an all-black batch is served
        serve(images=np.zeros((2, 28, 28, 1), np.uint8))["logits"].shape, (2, 10))


def test_an_empty_batch_and_a_wrong_rank(exported, tmp_path):
    # An empty batch failed with an unrelated graph error; a rank-3 input got "Incompatible
    # shapes: [3] vs. [2]" where it reached the graph (serve's own check names the shape now).
    _, export_dir, _ = exported
    serve = tf.saved_model.load(export_dir).signatures["serve"]
    assert serve(images=np.zeros((0, 28, 28, 1), np.uint8))["logits"].shape == (0, 10)
    with pytest.raises(TypeError, match=r"\(None, 28, 28, 1\)"):  # Python: TF's binding
        serve(images=np.zeros((28, 28, 1), np.uint8))
    np.save(tmp_path / "one.npy", np.zeros((28, 28, 1), np.uint8))  # saved_model_cli: serve
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "saved_model_cli"), "run",
         "--dir", export_dir, "--tag_set", "serve", "--signature_def", "serving_default",
         "--inputs", f"images={tmp_path / 'one.npy'}", "--outdir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "which has shape (None, 28, 28, 1)" in result.stderr, result.stderr[-2000:]
