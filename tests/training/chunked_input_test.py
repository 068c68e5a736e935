"""DPModel.fit on accumulation chunks (`tfdp.training.distribute.ChunkedInput`).

One train-function call takes `accumulation_steps` chunk elements and makes ONE
update; it must equal the update of the same logical batch fed whole (chunks
cut inside `train_step`), noise included. Multi-replica and multi-host runs of
the same path: tests/training/distribute_test.py and tests/multi_worker_test.py.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import accounting
from tfdp.training import distribute
from tfdp.training.dp_model import DPModel

A, N = 2, 4  # chunks per update, slots per chunk


def _batches():
    """Two logical batches of 8 slots (the second with 3 masked)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, A * N, 8)).astype(np.float32)
    y = rng.integers(0, 10, (2, A * N)).astype(np.int32)
    mask = np.ones((2, A * N), np.float32)
    mask[1, 5:] = 0.0
    return x, y, mask


def _dp_model(accumulation_steps=A, num_microbatches=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Dense(16)(inputs)))
    mechanism = accounting.DPMechanism(num_examples=100, batch_size=8, num_steps=10,
                                       noise_multiplier=1.0, l2_clip_norm=0.1, delta=1e-5,
                                       num_microbatches=num_microbatches)
    dp = DPModel(model, mechanism, accumulation_steps=accumulation_steps, noise_seed=3)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    return model, dp


@pytest.mark.slow
def test_chunk_elements_give_the_update_of_whole_logical_batches():
    x, y, mask = _batches()
    model, dp = _dp_model()
    whole = tf.data.Dataset.from_tensor_slices((x, y, mask))
    dp.fit(whole, epochs=1, steps_per_epoch=2, verbose=0)
    expected = [w.numpy() for w in model.trainable_variables]

    model, dp = _dp_model()
    chunks = tf.data.Dataset.from_tensor_slices(
        tuple(t.reshape(2 * A, N, *t.shape[2:]) for t in (x, y, mask)))
    history = dp.fit(distribute.ChunkedInput(chunks, A), epochs=1, steps_per_epoch=2,
                     verbose=0)
    # One Keras step per logical batch: 2 updates from 4 chunk elements.
    assert int(dp.optimizer.iterations.numpy()) == 2
    assert np.isfinite(history.history["loss"][0])
    for got, want in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)
    # Noise included (the same noise_seed): a noiseless update would differ.
    assert max(np.abs(w.numpy()).max() for w in model.trainable_variables) > 0


class _Noiseless(DPModel):
    def add_noise(self, summed):
        return summed


@pytest.mark.slow
def test_the_accumulators_are_zeroed_per_update_and_kept_out_of_checkpoints(tmp_path):
    x, y, mask = _batches()
    chunks = tf.data.Dataset.from_tensor_slices(
        tuple(t.reshape(2 * A, N, *t.shape[2:]) for t in (x, y, mask)))

    def noiseless():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(10)(inputs))
        dp = _Noiseless(model, _dp_model()[1].mechanism, accumulation_steps=A)
        dp.compile(optimizer=keras.optimizers.SGD(1.0))
        return model, dp

    def update(model, dp, ds, steps):
        before = [w.numpy() for w in model.trainable_variables]
        dp.fit(distribute.ChunkedInput(ds, A), epochs=1, steps_per_epoch=steps, verbose=0)
        return [w.numpy() - b for w, b in zip(model.trainable_variables, before)]

    model, dp = noiseless()
    update(model, dp, chunks, 2)
    path = tf.train.Checkpoint(model=dp).save(os.path.join(tmp_path, "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert names and not any("accumulator" in name for name in names)
    # A third update equals a fresh model's update from the same weights: nothing of the
    # earlier updates is left in the accumulators.
    third = update(model, dp, chunks.skip(A), 1)
    fresh_model, fresh = noiseless()
    for w, v, d in zip(fresh_model.trainable_variables, model.trainable_variables, third):
        w.assign(v.numpy() - d)  # the weights before the third update
    again = update(fresh_model, fresh, chunks.skip(A), 1)
    assert max(np.abs(d).max() for d in third) > 0
    for a, b in zip(third, again):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_chunked_input_with_other_accumulation_steps_is_refused():
    _, dp = _dp_model(accumulation_steps=2)
    chunks = tf.data.Dataset.from_tensors((tf.zeros([4, 8]), tf.zeros([4], tf.int32)))
    with pytest.raises(ValueError, match="cut into 4 accumulation chunks per replica, but this "
                                         "DPModel has accumulation_steps=2"):
        dp.fit(distribute.ChunkedInput(chunks, 4), epochs=1, steps_per_epoch=1, verbose=0)


def test_microbatches_over_chunk_elements_keep_the_2c_bound():
    # M = 2 microbatches over 2 chunks of 4 (ids drawn per chunk): each microbatch mean
    # is clipped to C = 0.1 after summing over the chunks, so the noiseless update
    # (SGD lr 1, divided by M) has norm <= 2 C / M = 0.1.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(10)(inputs))
    mechanism = accounting.DPMechanism(num_examples=100, batch_size=8, num_steps=10,
                                       noise_multiplier=1.0, l2_clip_norm=0.1, delta=1e-5,
                                       num_microbatches=2)
    dp = _Noiseless(model, mechanism, accumulation_steps=A, noise_seed=3)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    x, y, mask = _batches()
    chunks = tf.data.Dataset.from_tensor_slices(
        (100 * x[0].reshape(A, N, 8), y[0].reshape(A, N), mask[0].reshape(A, N)))
    before = [w.numpy() for w in model.trainable_variables]
    dp.fit(distribute.ChunkedInput(chunks, A), epochs=1, steps_per_epoch=1, verbose=0)
    norm = np.sqrt(sum(((w.numpy() - b) ** 2).sum()
                       for w, b in zip(model.trainable_variables, before)))
    assert 0.05 < norm <= 0.1 + 1e-6  # both microbatches clipped: 2 C / M at most
