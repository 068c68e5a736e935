"""One DP step path: the CLI, `tfdp.make_private` and `DPModel.train_step` make the same update.

The trainer (`python -m tfdp.main`) plans (`tfdp.planning`), reads each logical
batch's accumulation chunks (`tfdp.inputs.train_dataset`,
`tfdp.training.distribute.distribute_chunks`) and builds its model
(`tfdp.modes.PrivateMode.build_model`); `make_private` feeds the same chunked
input to the same step, and `train_step` on a whole logical batch runs the same
accumulation (`tfdp.training.chunked`). With the same batch, sampling seed,
noise seed and initial weights, the updates are equal bit for bit.

These tests fail when the paths differ: with `DPModel.scale_update` dividing by
`update_divisor + 1` on the make_private side only (patched after the CLI's
step), or `train_step` adding noise of twice the std, `assert_array_equal`
raises; another noise seed gives another update
(`test_another_noise_seed_gives_another_update`).
"""

import dataclasses
import functools
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import configs
from tfdp import data
from tfdp import inputs
from tfdp import modes
from tfdp import planning
from tfdp.training import distribute
from tfdp.training.dp_model import DPModel

N, B, STEPS = 32, 12, 1  # one step: make_private's fit trains them all
SAMPLING_SEED, NOISE_SEED = 1234, 77


def _images_and_labels():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(N, 4, 4, 1)).astype(np.uint8)
    labels = rng.integers(0, 3, size=N).astype(np.int32)
    return images, labels


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Rescaling(1 / 255),
                             keras.layers.Flatten(), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3)])


def _settings(accumulation_steps, noise_seed=NOISE_SEED):
    """The privacy and optimization groups both sides read (the CLI's from gin)."""
    privacy = configs.PrivacyConfig(l2_clip_norm=0.5, target_delta=1e-5, noise_multiplier=1.3,
                                    target_epsilon=50.0, sampling_seed=SAMPLING_SEED,
                                    noise_seed=noise_seed)
    optimization = configs.OptimizationConfig(
        optimizer_fn=lambda: keras.optimizers.SGD(0.5), batch_size=B, num_steps=STEPS,
        accumulation_steps=accumulation_steps)
    return privacy, optimization


@functools.lru_cache(maxsize=None)  # pure: the same arguments give the same update
def _cli_step(accumulation_steps):
    """One step of the trainer's own stages: plan, chunked input, mode's model, fit."""
    images, labels = _images_and_labels()
    strategy = tf.distribute.get_strategy()
    privacy, optimization = _settings(accumulation_steps)
    config = configs.RunConfig(
        data=configs.DataConfig(dataset="arrays", num_examples=N),
        augmentation=configs.AugmentationConfig(), privacy=privacy, optimization=optimization,
        evaluation=configs.EvaluationConfig(), runtime=configs.RuntimeConfig())
    mode = modes.make_mode(config.privacy)
    plan = planning.plan_private(config, strategy)  # what `mode.plan` returns
    model = _model()
    dp = mode.build_model(model, plan, config.optimization)
    dp.compile(optimizer=config.optimization.optimizer_fn(),
               jit_compile=config.runtime.jit_compile)
    train = data.ArraySource(images, labels, 3)
    chunks = distribute.distribute_chunks(strategy, inputs.train_dataset(
        train, plan, seed=privacy.sampling_seed, start_step=0, augment_fn=None,
        augment_seed=[config.runtime.seed, 1], augmult=config.augmentation.augmult,
        static_batch_size=plan.truncation and plan.truncation.static_batch_size,
        num_replicas=strategy.num_replicas_in_sync, accumulation_steps=accumulation_steps),
        accumulation_steps=accumulation_steps)
    dp.fit(chunks, epochs=1, steps_per_epoch=1, verbose=0)
    return plan, [v.numpy() for v in model.trainable_variables]


def _make_private_step(accumulation_steps, noise_seed=NOISE_SEED):
    """One step of `make_private`'s `fit`, its seeds fixed in its config as the CLI's are."""
    images, labels = _images_and_labels()
    privacy, optimization = _settings(accumulation_steps, noise_seed)
    private = tfdp.make_private(_model(), (images, labels), configs.PrivateTrainingConfig(
        privacy=privacy, optimization=optimization))
    private.fit(verbose=False)
    assert private.steps == STEPS
    return private.mechanism, [v.numpy() for v in private.model.model.trainable_variables]


# Accumulation 3 (three chunks per update) by default; 1 (one chunk: the same calls, once)
# under -m slow.
@pytest.mark.parametrize("accumulation_steps", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_the_cli_and_make_private_make_the_same_update_bit_for_bit(accumulation_steps):
    plan, cli = _cli_step(accumulation_steps)
    mechanism, private = _make_private_step(accumulation_steps)
    assert plan == mechanism  # the same DP facts: noise std, divisor, clip norm
    initial = [v.numpy() for v in _model().trainable_variables]
    assert any(np.any(w != w0) for w, w0 in zip(cli, initial))  # a step was taken
    for got, want in zip(private, cli):
        np.testing.assert_array_equal(got, want)


def test_another_noise_seed_gives_another_update():
    _, cli = _cli_step(3)
    _, private = _make_private_step(3, noise_seed=NOISE_SEED + 1)
    assert all(np.any(got != want) for got, want in zip(private, cli))


def _dp_model(accumulation_steps, num_microbatches):
    keras.utils.set_random_seed(0)
    inputs_ = keras.Input((6,))
    model = keras.Model(inputs_, keras.layers.Dense(3)(keras.layers.Dense(4)(inputs_)))
    mechanism = tfdp.accounting.DPMechanism(
        num_examples=100, batch_size=B, num_steps=10, noise_multiplier=1.0, l2_clip_norm=0.1,
        delta=1e-5, num_microbatches=num_microbatches)
    dp = DPModel(model, mechanism, accumulation_steps=accumulation_steps, noise_seed=NOISE_SEED)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    return model, dp


# (3, None) under -m slow too: by default the accumulation test below compares train_on_batch
# (train_step on a logical batch of 3 chunks) with a fit on chunked input, bit for bit.
@pytest.mark.parametrize("accumulation_steps, num_microbatches", [
    pytest.param(1, None, marks=pytest.mark.slow),
    pytest.param(3, None, marks=pytest.mark.slow), (3, 2)])
def test_train_step_on_a_logical_batch_equals_the_chunked_path_bit_for_bit(
        accumulation_steps, num_microbatches):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, 6)).astype(np.float32)
    y = rng.integers(0, 3, B).astype(np.int32)
    mask = np.ones(B, np.float32)
    mask[-2:] = 0.0
    model, dp = _dp_model(accumulation_steps, num_microbatches)
    dp.fit(tf.data.Dataset.from_tensors((x, y, mask)), epochs=1, steps_per_epoch=1, verbose=0)
    whole = [v.numpy() for v in model.trainable_variables]

    model, dp = _dp_model(accumulation_steps, num_microbatches)
    n = B // accumulation_steps
    chunks = tf.data.Dataset.from_tensor_slices(
        tuple(t.reshape(accumulation_steps, n, *t.shape[1:]) for t in (x, y, mask)))
    dp.fit(distribute.ChunkedInput(chunks, accumulation_steps), epochs=1, steps_per_epoch=1,
           verbose=0)
    assert int(dp.optimizer.iterations.numpy()) == 1
    for got, want in zip(model.trainable_variables, whole):
        np.testing.assert_array_equal(got.numpy(), want)


def test_steps_per_execution_train_on_batch_and_chunked_input_run_the_same_accumulation():
    # Two updates, each a logical batch of B in 3 accumulation chunks, reached three ways:
    # `train_on_batch` twice; one `fit` call of Keras' loop of 2 steps (steps_per_execution
    # = 2: the accumulators are zeroed per step); a `fit` on chunked input, then a
    # `train_on_batch`, which takes a whole batch (the chunked train function would take an
    # iterator of chunks). Every route gives the same weights bit for bit.
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, B, 6)).astype(np.float32)
    y = rng.integers(0, 3, (2, B)).astype(np.int32)
    model, dp = _dp_model(3, None)
    for step in range(2):
        dp.train_on_batch(x[step], y[step])
    want = [v.numpy() for v in model.trainable_variables]
    initial = [v.numpy() for v in _dp_model(3, None)[0].trainable_variables]
    assert all(np.any(w != w0) for w, w0 in zip(want, initial))  # both updates moved them

    model, dp = _dp_model(3, None)
    dp.compile(optimizer=keras.optimizers.SGD(1.0), steps_per_execution=2)
    dp.fit(tf.data.Dataset.from_tensor_slices((x, y)), epochs=1, steps_per_epoch=2, verbose=0)
    assert int(dp.optimizer.iterations.numpy()) == 2
    for got, expected in zip(model.trainable_variables, want):
        np.testing.assert_array_equal(got.numpy(), expected)

    model, dp = _dp_model(3, None)
    chunks = tf.data.Dataset.from_tensor_slices((x[0].reshape(3, B // 3, 6),
                                                 y[0].reshape(3, -1)))
    dp.fit(distribute.ChunkedInput(chunks, 3), epochs=1, steps_per_epoch=1, verbose=0)
    dp.train_on_batch(x[1], y[1])
    assert int(dp.optimizer.iterations.numpy()) == 2
    for got, expected in zip(model.trainable_variables, want):
        np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("where", ["DPModel.compile", "make_private",
                                   "tfdp.OptimizationConfig.optimizer_fn"])
def test_an_optimizer_that_counts_several_releases_as_one_iteration_is_refused(
        where, tmp_path):
    # Keras' gradient_accumulation_steps=2 counts one iteration per 2 updates, while each
    # update is one noisy release: epsilon, the plan's end and the sampler's resume step
    # all read optimizer.iterations.
    def optimizer_fn():
        return keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)

    message = rf"{where}: the optimizer has gradient_accumulation_steps=2"
    if where == "DPModel.compile":
        model, dp = _dp_model(1, None)
        with pytest.raises(ValueError, match=message):
            dp.compile(optimizer=optimizer_fn())
    elif where == "make_private":
        privacy, optimization = _settings(1)
        with pytest.raises(ValueError, match=message):
            tfdp.make_private(_model(), _images_and_labels(), configs.PrivateTrainingConfig(
                privacy=privacy, optimization=dataclasses.replace(
                    optimization, optimizer_fn=optimizer_fn)))
    else:
        from tfdp import experiment  # pylint: disable=g-import-not-at-top

        privacy, optimization = _settings(1)
        with mock.patch.object(configs.RunConfig, "from_gin", return_value=configs.RunConfig(
                data=configs.DataConfig(dataset="arrays", num_examples=N),
                augmentation=configs.AugmentationConfig(), privacy=privacy,
                optimization=dataclasses.replace(optimization, optimizer_fn=optimizer_fn),
                evaluation=configs.EvaluationConfig(), runtime=configs.RuntimeConfig())):
            with pytest.raises(ValueError, match=message):
                experiment.train_and_evaluate(str(tmp_path / "workdir"), model_fn=None)
        assert not (tmp_path / "workdir").exists()  # refused before the workdir
