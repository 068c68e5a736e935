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
