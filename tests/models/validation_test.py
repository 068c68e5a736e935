"""Tests for validate_dp_model (De et al. 2022, App. C.1; How to DP-fy ML, Sec. 5.5.1)."""

import keras
import numpy as np
import pytest
from keras import ops

from tfdp.models.tramer_cifar_cnn import build_tramer_cifar_cnn
from tfdp.models.validation import iter_layers, validate_dp_model


def _conv_model(norm_layer, name="model"):
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(16, 3, name="conv")(inputs)
    x = norm_layer(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x), name=name)


class _BlockWithBatchNorm(keras.layers.Layer):
    """A subclassed layer hiding a BatchNorm in an attribute list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.parts = [keras.layers.Dense(4), keras.layers.BatchNormalization(name="hidden_bn")]

    def call(self, x):
        for part in self.parts:
            x = part(x)
        return x


class _BatchMean(keras.layers.Layer):
    """Subtracts the batch mean: mixes examples without being a BatchNorm."""

    def call(self, x):
        return x - ops.mean(x, axis=0, keepdims=True)


def test_rejects_batch_norm_with_a_clear_message():
    model = _conv_model(keras.layers.BatchNormalization(name="bn"))
    with pytest.raises(ValueError) as error:
        validate_dp_model(model)
    message = str(error.value)
    assert "model/bn (BatchNormalization)" in message
    assert "keras.layers.GroupNormalization" in message
    assert "De et al. 2022" in message and "Sec. 5.5.1" in message


def test_a_trainable_batch_norm_is_refused_with_how_to_freeze_it():
    model = _conv_model(keras.layers.BatchNormalization(name="bn"))
    with pytest.raises(ValueError, match=r"model/bn.*layer\.trainable = False"):
        validate_dp_model(model)


@pytest.mark.parametrize("synchronized", [False, True])
def test_accepts_a_frozen_batch_norm(synchronized):
    # Keras 3 runs a BatchNormalization with trainable=False in inference mode even
    # with training=True: it normalizes with its moving statistics, per example.
    bn = keras.layers.BatchNormalization(synchronized=synchronized, name="bn")
    model = _conv_model(bn)
    bn.trainable = False
    images = np.random.default_rng(0).normal(size=(3, 8, 8, 3)).astype(np.float32)
    validate_dp_model(model, check_inputs=images)  # does not raise


def test_a_frozen_batch_norm_subclass_is_still_refused():
    class MyBatchNorm(keras.layers.BatchNormalization):  # may override call
        pass

    bn = MyBatchNorm(name="my_bn")
    model = _conv_model(bn)
    bn.trainable = False
    with pytest.raises(ValueError, match="model/my_bn"):
        validate_dp_model(model)


def test_rejects_synchronized_batch_norm():
    model = _conv_model(keras.layers.BatchNormalization(synchronized=True, name="sync_bn"))
    with pytest.raises(ValueError, match="model/sync_bn"):
        validate_dp_model(model)


def test_rejects_batch_norm_nested_in_models_and_layers():
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(name="inner_bn"),
        ],
        name="inner",
    )
    inputs = keras.Input((4,))
    outputs = _BlockWithBatchNorm(name="block")(inner(inputs))
    model = keras.Model(inputs, outputs, name="outer")
    with pytest.raises(ValueError) as error:
        validate_dp_model(model)
    # Both offenders are named, with their nesting path.
    assert "outer/inner/inner_bn (BatchNormalization)" in str(error.value)
    assert "outer/block/hidden_bn (BatchNormalization)" in str(error.value)


@pytest.mark.parametrize(
    "norm_layer",
    [
        keras.layers.GroupNormalization(groups=4),
        keras.layers.LayerNormalization(),
        keras.layers.UnitNormalization(),
    ],
)
def test_accepts_per_example_normalization(norm_layer):
    model = _conv_model(norm_layer)
    images = np.random.default_rng(0).normal(size=(3, 8, 8, 3)).astype(np.float32)
    validate_dp_model(model, check_inputs=images)  # does not raise


def test_functional_check_catches_custom_batch_mixing_and_dropout():
    images = np.random.default_rng(1).normal(size=(3, 8, 8, 3)).astype(np.float32)
    validate_dp_model(_conv_model(_BatchMean()))  # invisible to the structural check
    with pytest.raises(ValueError, match="example 0 differs between a call on the whole batch"):
        validate_dp_model(_conv_model(_BatchMean()), check_inputs=images)
    with pytest.raises(ValueError, match="random in training mode"):
        validate_dp_model(_conv_model(keras.layers.Dropout(0.5)), check_inputs=images)


def test_functional_check_needs_two_examples():
    model = _conv_model(keras.layers.LayerNormalization())
    with pytest.raises(ValueError, match="at least 2"):
        validate_dp_model(model, check_inputs=np.zeros((1, 8, 8, 3), np.float32))


def test_iter_layers_visits_every_layer_once_with_paths():
    model = build_tramer_cifar_cnn(10, size="small")
    paths = [path for path, _ in iter_layers(model)]
    assert paths[0] == model.name
    assert len(paths) == len(set(paths)) == 1 + len(model.layers)
    assert f"{model.name}/logits" in paths
