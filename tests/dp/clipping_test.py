"""Tests for tfdp.dp.clipping: bounded norms, loop equivalence, edge cases."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.dp import clipping
from tfdp.dp import device_arithmetic
from tfdp.dp import precision

# Every example is clipped to C / (1 + kappa): 1e-5 on this host's float32 matmuls.
KAPPA = precision.CLIP_MARGINS["float32"]


def _linear_problem(batch=6, dim=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(batch, dim)) * 3.0, tf.float32)
    y = tf.constant(rng.integers(0, classes, size=batch), tf.int32)
    w = tf.Variable(rng.normal(size=(dim, classes)), dtype=tf.float32)
    b = tf.Variable(rng.normal(size=(classes,)), dtype=tf.float32)

    def example_loss(example):
        xi, yi = example
        logits = tf.linalg.matvec(w, xi, transpose_a=True) + b
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(yi, logits)
        return loss, logits

    return x, y, [w, b], example_loss


def test_per_example_gradients_equal_a_python_loop():
    x, y, variables, example_loss = _linear_problem()
    grads, logits = clipping.per_example_gradients(example_loss, variables, (x, y))
    assert logits.shape == (6, 3)
    for i in range(6):
        with tf.GradientTape() as tape:
            loss, _ = example_loss((x[i], y[i]))
        expected = tape.gradient(loss, variables)
        for g, e in zip(grads, expected):
            np.testing.assert_allclose(g[i], e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
def test_clipped_sum_equals_explicit_loop_and_norms_are_bounded(normalize):
    x, y, variables, example_loss = _linear_problem()
    c = 0.5
    grads, _ = clipping.per_example_gradients(example_loss, variables, (x, y))
    summed, norms, clipped = clipping.clipped_sum(grads, c, normalize=normalize)

    expected = [np.zeros(v.shape, np.float32) for v in variables]
    for i in range(6):
        gi = [g[i].numpy() for g in grads]
        norm = np.sqrt(sum(np.sum(g**2) for g in gi))
        np.testing.assert_allclose(norms[i], norm, rtol=1e-5)
        scale = min(1.0, c / (1 + KAPPA) / norm) / (c if normalize else 1.0)
        contribution = [g * scale for g in gi]
        # Every example's clipped contribution is bounded: <= C, or <= 1 normalized.
        bound = 1.0 if normalize else c
        assert np.sqrt(sum(np.sum(g**2) for g in contribution)) <= bound
        for e, g in zip(expected, contribution):
            e += g
        assert clipped[i] == float(norm > c / (1 + KAPPA))
    for s, e in zip(summed, expected):
        np.testing.assert_allclose(s, e, rtol=1e-5, atol=1e-6)


def test_clip_factors_edge_cases():
    # norms:       0    0.5  2.0          inf  nan   with C = 1, C' = C / (1 + kappa)
    # factors:     1    1    C' / 2.0     0    0
    norms = tf.constant([0.0, 0.5, 2.0, np.inf, np.nan])
    np.testing.assert_allclose(
        clipping.clip_factors(norms, 1.0), [1.0, 1.0, 0.5 / (1 + KAPPA), 0.0, 0.0], rtol=1e-7)
    # Normalized (De et al. eq. 3) with C = 2: min(1, C' / norm) / C (the noise's C).
    np.testing.assert_allclose(
        clipping.clip_factors(tf.constant([1.0, 4.0]), 2.0, normalize=True),
        [0.5, 0.25 / (1 + KAPPA)], rtol=1e-7)


@pytest.mark.parametrize("device", [device_arithmetic.FLOAT32, device_arithmetic.TF32,
                                    device_arithmetic.BF16], ids=lambda d: d.name)
def test_the_clip_margin_follows_the_device_class(device):
    # Clipped to C / (1 + kappa), kappa by the device's matmul inputs, read when the
    # factors are traced; a norm of exactly C / (1 + kappa) is not scaled down.
    kappa = {"float32": 1e-5, "tf32": 1e-3, "bf16": 1e-2}[device.name]
    with device_arithmetic.emulate(device):
        assert precision.clip_margin() == kappa
        factors = clipping.clip_factors(tf.constant([4.0, 1.0 / (1 + kappa)], tf.float64), 1.0)
    np.testing.assert_allclose(factors, [0.25 / (1 + kappa), 1.0], rtol=1e-12)


def test_non_finite_and_masked_examples_contribute_exactly_zero():
    # Example 0: finite, norm 5 -> clipped to 1 (C = 1): [0.6, 0.8].
    # Example 1: inf -> dropped. Example 2: finite but masked (padding) -> dropped.
    g = tf.constant([[3.0, 4.0], [np.inf, 1.0], [10.0, 10.0]])
    summed, norms, clipped = clipping.clipped_sum([g], 1.0, mask=tf.constant([1.0, 1.0, 0.0]))
    np.testing.assert_allclose(summed[0], np.array([0.6, 0.8]) / (1 + KAPPA), rtol=1e-6)
    np.testing.assert_allclose(clipped, [1.0, 1.0, 0.0])
