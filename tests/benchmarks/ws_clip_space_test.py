"""benchmarks/ws_clip_space.py: its clone's gradients are those with respect to W_hat."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("ws_clip_space", BENCHMARKS / "ws_clip_space.py")
ws_clip_space = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ws_clip_space)

from tfdp.models.wide_resnet import build_wide_resnet  # noqa: E402
from tfdp.models.ws_conv2d import WSConv2D  # noqa: E402


def test_the_raw_gradient_is_the_standardizations_jacobian_applied_to_the_clones():
    tf.random.set_seed(3)
    model = build_wide_resnet(10, 1, 10, input_shape=(32, 32, 1), groups=4)
    for layer in model.layers:  # kernels far from the initializer's scale: s_o != 1
        if isinstance(layer, WSConv2D):
            layer.kernel.assign(layer.kernel * 3.0 + 0.5)
    clone = ws_clip_space.standardized_clone(model)
    images = np.random.default_rng(0).normal(size=(2, 32, 32, 1)).astype(np.float32)
    labels = np.array([1, 7])
    np.testing.assert_allclose(clone(images).numpy(), model(images).numpy(), atol=1e-5)

    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        raw_loss = loss(labels, model(images))
    with tf.GradientTape() as tape_hat:
        hat_loss = loss(labels, clone(images))
    ws = [layer for layer in model.layers if isinstance(layer, WSConv2D)]
    raw = tape.gradient(raw_loss, [layer.kernel for layer in ws])
    cloned = dict(zip([layer.name for layer in model.layers], clone.layers))
    hat = tape_hat.gradient(hat_loss, [cloned[layer.name].kernel for layer in ws])
    for layer, g_raw, g_hat in zip(ws, raw, hat):
        kernel = tf.convert_to_tensor(layer.kernel)
        with tf.GradientTape() as jacobian:
            jacobian.watch(kernel)
            standardized = layer.standardize_kernel(kernel)
        pulled_back = jacobian.gradient(standardized, kernel, output_gradients=g_hat)
        np.testing.assert_allclose(pulled_back.numpy(), g_raw.numpy(), rtol=2e-3,
                                   atol=2e-6 * float(tf.reduce_max(tf.abs(g_raw))))
        # ... and the clone's own gradient is not the raw one: the projection removes a part.
        assert float(tf.norm(g_hat - g_raw)) > 1e-3 * float(tf.norm(g_raw))


def test_per_example_norms_are_each_examples_own():
    model = build_wide_resnet(10, 1, 10, input_shape=(32, 32, 1), groups=4)
    images = np.random.default_rng(1).normal(size=(3, 32, 32, 1)).astype(np.float32)
    labels = np.array([0, 4, 9])
    norms = ws_clip_space.per_example_norms(model, images, labels)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:  # example 1 alone, eagerly
        alone = loss(labels[1:2], model(images[1:2]))
    alone = tf.linalg.global_norm(tape.gradient(alone, model.trainable_variables))
    assert norms.shape == (3,) and np.all(norms > 0)
    np.testing.assert_allclose(norms[1], float(alone), rtol=1e-5)
    assert not np.allclose(norms[0], norms[2])


def test_images_are_pixels_the_model_rescales_itself():
    images, labels = ws_clip_space.load_images("generated", 5, seed=0)
    assert images.shape == (5, 32, 32, 1) and images.dtype == np.float32
    assert images.max() > 100 and images.min() >= 0 and images.max() <= 255
    assert np.all(images[:, :2] == 0)  # the padding is black
    assert labels.shape == (5,)


@pytest.mark.slow  # 8 s: a training step and two traced per-example loops
def test_the_script_trains_measures_and_prints_strict_json(capsys):
    ws_clip_space.main(["--model=wrn10_1", "--data=generated", "--examples=2",
                        "--train_steps=1"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))
    assert result["train_steps"] == 1 and result["train_loss"] > 0
    assert result["logit_gap"] <= 1e-4
    ratio = result["raw_over_standardized"]
    assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
