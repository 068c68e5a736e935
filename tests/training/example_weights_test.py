"""Per-example weights never scale an example's sensitivity.

Keras turns `fit(..., class_weight=...)` into per-example sample weights, and reads
the third element of a batch as one. Before this fix DPModel took either as its
padding mask, so `class_weight={1: 50}` let one example move the update by 50 C.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import accounting
from tfdp.training.dp_model import DPModel

C = 0.5


class _Noiseless(DPModel):
    def add_noise(self, summed):
        return summed


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4, 4, 1))
    x = keras.layers.Conv2D(3, 3, activation="tanh")(inputs)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def _dp(clipping, num_microbatches=None, seed=0):
    mechanism = accounting.DPMechanism(
        num_examples=100, batch_size=2, num_steps=10, noise_multiplier=1.0, l2_clip_norm=C,
        delta=1e-5, num_microbatches=num_microbatches)
    dp = _Noiseless(_model(seed), mechanism, clipping=clipping)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    return dp


def _data(batch=2):
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (batch, 4, 4, 1)).astype(np.float32)
    return images, np.arange(batch) % 2


WEIGHTS = "weighting an example's loss scales its"


@pytest.mark.parametrize("kwargs", [{"class_weight": {0: 1.0, 1: 50.0}},
                                    {"sample_weight": np.array([1.0, 50.0])}])
def test_fit_refuses_class_and_sample_weights(kwargs):
    dp = _dp("auto")
    batches = tf.data.Dataset.from_tensors(_data()).repeat(2)
    with pytest.raises(ValueError, match=f"DPModel.fit does not take .*{WEIGHTS}"):
        dp.fit(batches, epochs=1, verbose=0, **kwargs)
    assert int(dp.optimizer.iterations.numpy()) == 0


def test_fit_refuses_class_weight_given_by_position():
    dp = _dp("auto")
    batches = tf.data.Dataset.from_tensors(_data())
    args = [None, None, 1, 0, None, 0.0, None, False, {0: 1.0, 1: 50.0}]  # ... class_weight
    with pytest.raises(ValueError, match=f"DPModel.fit does not take class_weight: {WEIGHTS}"):
        dp.fit(batches, *args)


def test_train_on_batch_refuses_weights_and_takes_a_0_1_mask():
    dp = _dp("auto")
    images, labels = _data()
    with pytest.raises(ValueError, match=f"does not take class_weight: {WEIGHTS}"):
        dp.train_on_batch(images, labels, class_weight={0: 1.0, 1: 50.0})
    with pytest.raises(ValueError, match=f"does not take sample_weight: {WEIGHTS}"):
        dp.train_on_batch(images, labels, sample_weight=np.array([1.0, 50.0]))
    assert int(dp.optimizer.iterations.numpy()) == 0
    dp.train_on_batch(images, labels, sample_weight=np.array([1.0, 0.0]))  # a padding mask
    assert int(dp.optimizer.iterations.numpy()) == 1


def test_make_private_refuses_weights():
    images, labels = _data(20)
    config = tfdp.PrivateTrainingConfig(
        privacy=tfdp.PrivacyConfig(target_delta=1e-5, l2_clip_norm=1.0, noise_multiplier=1.0),
        optimization=tfdp.OptimizationConfig(optimizer_fn=keras.optimizers.SGD, batch_size=4,
                                             num_steps=2))
    for name, value in (("class_weight", {0: 1.0, 1: 5.0}), ("sample_weight", np.ones(20))):
        with pytest.raises(ValueError, match=f"make_private does not take {name}: {WEIGHTS}"):
            tfdp.make_private(_model(), (images.astype(np.uint8), labels), config,
                              **{name: value})


@pytest.mark.parametrize("clipping, num_microbatches",
                         [("ghost", None), ("vectorized", None), ("vectorized", 2)])
def test_a_weight_in_the_mask_moves_the_sum_by_at_most_the_sensitivity(clipping,
                                                                        num_microbatches):
    # The clipped sum with a "mask" of 50 for one example equals the sum with 1: each
    # example's clipped gradient has norm <= C (microbatches: each clipped mean).
    images, labels = _data()
    dp = _dp(clipping, num_microbatches)
    run = lambda mask: dp.clip_and_accumulate(  # noqa: E731
        tf.constant(images), tf.constant(labels), tf.constant(mask, tf.float32))[0]
    if num_microbatches:  # one microbatch draw per call: fix it
        dp.draw_microbatch_ids = lambda mask: tf.zeros(tf.shape(mask), tf.int32)
    weighted = run([0.0, 50.0])
    one = run([0.0, 1.0])
    for w, o in zip(weighted, one):
        np.testing.assert_array_equal(w.numpy(), o.numpy())
    norm = np.sqrt(sum(np.sum(np.square(w.numpy().astype(np.float64))) for w in weighted))
    assert norm <= C * (1 + 1e-6)


def test_a_dataset_whose_third_element_is_a_weight_stops_with_a_message():
    images, labels = _data()
    dp = _dp("auto")
    weighted = tf.data.Dataset.from_tensors((images, labels, np.array([1.0, 50.0], np.float32)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="padding mask and must be 0 or 1"):
        dp.fit(weighted, epochs=1, verbose=0)

