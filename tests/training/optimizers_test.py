"""build_optimizer: every setting it takes is applied, or refused."""

import numpy as np
import pytest
import keras

from tfdp.training import optimizers


def _steps(optimizer, grads, w0, n=3):
    w = keras.Variable(np.array(w0, np.float32))
    for g in grads[:n]:
        optimizer.apply_gradients([(np.array(g, np.float32), w)])
    return np.array(w.numpy(), np.float64)


def _reference(w0, grads, *, lr, momentum, l2):
    """De et al.'s update in float64: m <- mu m + (g + l2 w); w <- w - lr m."""
    w = np.array(w0, np.float64)
    m = np.zeros_like(w)
    for g in grads:
        m = momentum * m + (np.asarray(g, np.float64) + l2 * w)
        w = w - lr * m
    return w


@pytest.mark.parametrize("name,momentum", [("sgd", 0.0), ("momentum", 0.9)])
@pytest.mark.parametrize("l2", [0.0, 0.05])
def test_sgd_weight_decay_is_added_to_the_gradient_before_momentum(name, momentum, l2):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=4)
    grads = rng.normal(size=(3, 4))
    opt = optimizers.build_optimizer(name, learning_rate=0.3, momentum=momentum,
                                     weight_decay=l2)
    np.testing.assert_allclose(_steps(opt, grads, w0),
                               _reference(w0, grads, lr=0.3, momentum=momentum, l2=l2),
                               rtol=1e-5)


def test_weight_decay_changes_the_momentum_trajectory():
    # Coupled (this) and decoupled (Keras' weight_decay) L2 differ under momentum.
    w0, grads = np.ones(3), np.zeros((3, 3))
    coupled = _steps(optimizers.build_optimizer("momentum", learning_rate=0.3,
                                                weight_decay=0.1), grads, w0)
    decoupled = _steps(keras.optimizers.SGD(0.3, momentum=0.9, weight_decay=0.1), grads, w0)
    assert not np.allclose(coupled, decoupled)
    np.testing.assert_allclose(
        coupled, _reference(w0, grads, lr=0.3, momentum=0.9, l2=0.1), rtol=1e-6)


def test_weight_decay_is_in_the_serialized_config():
    opt = optimizers.build_optimizer("momentum", learning_rate=0.3, weight_decay=5e-5)
    assert keras.optimizers.serialize(opt)["config"]["l2"] == 5e-5


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="adam", weight_decay=1e-4), "adamw"),
    (dict(name="momentum", weight_decay=-1.0), ">= 0"),
    (dict(name="rmsprop"), "choose one of"),
])
def test_settings_that_would_be_ignored_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimizers.build_optimizer(learning_rate=0.1, **kwargs)


@pytest.mark.parametrize("name", optimizers.OPTIMIZERS)
def test_an_integer_learning_rate_is_a_learning_rate(name):
    # `--gin_param=LEARNING_RATE=1` binds the int 1, which Keras refused with a traceback.
    opt = optimizers.build_optimizer(name, learning_rate=2)
    assert float(opt.learning_rate) == 2.0


@pytest.mark.parametrize("learning_rate",
                         [0, -0.1, float("nan"), float("inf"), "0.1", True, None])
def test_a_learning_rate_that_is_not_a_positive_number_is_refused(learning_rate):
    with pytest.raises(ValueError, match="learning_rate must be a positive, finite number"):
        optimizers.build_optimizer("momentum", learning_rate=learning_rate)
