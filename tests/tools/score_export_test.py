"""Tests of tools/score_export.py: accuracy through an export's serve signature."""

import importlib.util
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.export import saved_model

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "tools", "score_export.py")
_spec = importlib.util.spec_from_file_location("score_export", SCRIPT)
score_export = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(score_export)


@pytest.fixture(scope="module")
def argmax_pixel_export(tmp_path_factory):
    """An export whose logits are the 4 pixels of a 2x2 image: it predicts the brightest."""
    inputs = keras.Input((2, 2, 1))
    dense = keras.layers.Dense(4, use_bias=False)
    model = keras.Model(inputs, dense(keras.layers.Flatten()(inputs)))
    dense.kernel.assign(np.eye(4, dtype=np.float32))
    path = str(tmp_path_factory.mktemp("score") / "export")
    saved_model.export_saved_model(model, path, image_shape=(2, 2, 1))
    return path


def test_score_counts_the_serve_signatures_argmax_over_every_batch(argmax_pixel_export):
    serve = tf.saved_model.load(argmax_pixel_export).signatures["serve"]
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 25)
    images = rng.integers(0, 100, (25, 2, 2, 1)).astype(np.uint8)
    images.reshape(25, 4)[np.arange(25), labels] = 255   # the label's pixel is the brightest
    wrong = [3, 10, 24]                                      # ... except in these
    labels[wrong] = (labels[wrong] + 1) % 4
    result = score_export.score(serve, images, labels, batch_size=7)   # 4 calls, last one short
    assert result == {"accuracy": 22 / 25, "correct": 22, "num_examples": 25}


@pytest.mark.parametrize("images, labels, message", [
    (np.zeros((3, 2, 2, 1), np.float32), np.zeros(3), "must be uint8"),
    (np.zeros((3, 2, 2, 1), np.uint8), np.zeros(2), "3 images and 2 labels"),
    (np.zeros((0, 2, 2, 1), np.uint8), np.zeros(0), "at least one"),
])
def test_score_refuses_what_the_signature_would_misread(images, labels, message):
    with pytest.raises(ValueError, match=message):
        score_export.score(None, images, labels)


def test_the_command_refuses_a_folder_that_is_not_an_export(tmp_path, capsys):
    assert score_export.main([str(tmp_path), "--dataset", "fashion_mnist"]) == 2
    assert "is not a tfdp export" in capsys.readouterr().err


def test_an_export_in_a_folder_named_like_a_glob_pattern_loads(argmax_pixel_export, tmp_path,
                                                                 capsys):
    # TensorFlow read `sweep[lr=0.5]/export/variables/...` as a pattern and found no variables.
    import shutil  # pylint: disable=g-import-not-at-top

    from tfdp import data  # pylint: disable=g-import-not-at-top

    named = tmp_path / "sweep[lr=0.5] {a,b}" / "export"
    shutil.copytree(argmax_pixel_export, named)
    with data.mock_data(num_examples=3):
        status = score_export.main([str(named), "--dataset", "fashion_mnist", "--split", "test"])
    # Loaded: the refusal is the one that reads the export's signature (2x2 images, not 28x28).
    assert status == 2
    assert "the export takes images of shape (2, 2, 1)" in capsys.readouterr().err
