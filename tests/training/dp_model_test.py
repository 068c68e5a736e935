"""Tests for DPModel.train_step: noise std, expected-batch division, accumulation, augmult."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfdp import accounting
from tfdp.dp import precision
from tfdp.training.dp_model import DPModel


class _Noiseless(DPModel):
    """A test double without noise: the arithmetic of clipping and division alone."""

    def add_noise(self, summed):
        return summed


_MECHANISM_KEYS = ("l2_clip_norm", "noise_multiplier", "batch_size", "normalize_update",
                   "num_microbatches")


def _mechanism(*, l2_clip_norm, noise_multiplier, batch_size, **kwargs):
    return accounting.DPMechanism(
        num_examples=1000, batch_size=int(batch_size), num_steps=10,
        noise_multiplier=noise_multiplier, l2_clip_norm=l2_clip_norm, delta=1e-5, **kwargs)


def _mlp(seed=0, hidden=400, dim=8, classes=10):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((dim,))
    x = keras.layers.Dense(hidden, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))


def _dp_model(model, *, lr=1.0, **kwargs):
    """A compiled DPModel; noise_multiplier=0 gives the noiseless test double."""
    privacy = {k: kwargs.pop(k) for k in _MECHANISM_KEYS if k in kwargs}
    sigma = privacy.pop("noise_multiplier")
    cls = _Noiseless if sigma == 0 else DPModel
    dp = cls(model, _mechanism(noise_multiplier=sigma or 1.0, **privacy), **kwargs)
    dp.compile(optimizer=keras.optimizers.SGD(learning_rate=lr))
    return dp


def _weights(model):
    return [w.numpy().copy() for w in model.trainable_variables]


def _batch(n=6, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return (
        tf.constant(rng.normal(size=(n, dim)), tf.float32),
        tf.constant(rng.integers(0, 10, size=n), tf.int32),
    )


@pytest.mark.parametrize("accumulation_steps", [1, 4])
def test_noise_std_is_sigma_c_over_b_once_per_logical_batch(accumulation_steps):
    # All examples masked out -> the clipped sum is exactly zero, so with SGD at
    # lr = 1 the update is -noise / B with noise ~ N(0, (sigma * C)^2).
    sigma, c, b = 2.0, 0.5, 50.0  # expected std 2 * 0.5 / 50 = 0.02
    model = _mlp()
    dp = _dp_model(model, l2_clip_norm=c, noise_multiplier=sigma, batch_size=b,
                   accumulation_steps=accumulation_steps, noise_seed=3)
    x, y = _batch(n=8)
    before = _weights(model)
    dp.train_step((x, y, tf.zeros([8])))  # one logical batch, in `accumulation_steps` chunks
    assert int(dp.optimizer.iterations.numpy()) == 1
    deltas = np.concatenate([(w1 - w0).ravel() for w0, w1 in zip(before, _weights(model))])
    assert deltas.size == 8 * 400 + 400 + 400 * 10 + 10
    expected = sigma * c / b
    assert stats.kstest(deltas, "norm", args=(0, expected)).pvalue > 1e-3
    for wrong in (expected * 2 / 3, expected * 3 / 2):
        assert stats.kstest(deltas, "norm", args=(0, wrong)).pvalue < 1e-6


@pytest.mark.slow
def test_accumulated_chunks_give_the_same_update_as_one_pass():
    x, y = _batch(n=7)  # 7 examples in 3 chunks of 3, 3, 1
    updates = []
    for steps in (1, 3):
        model = _mlp(hidden=16)
        dp = _dp_model(model, l2_clip_norm=0.05, noise_multiplier=0.0, batch_size=10.0,
                       accumulation_steps=steps)
        before = _weights(model)
        logs = dp.train_step((x, y))
        updates.append([w1 - w0 for w0, w1 in zip(before, _weights(model))])
        assert float(logs["clipped_fraction"]) > 0
    for a, b in zip(*updates):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8)


def test_update_divides_by_the_expected_batch_size_not_the_realized_one():
    # noise_multiplier = 0: update = -lr * sum_i clip(g_i) / B with B = 10 (expected),
    # while only 6 examples are in the batch.
    c, b, lr = 0.05, 10.0, 0.5
    model = _mlp(hidden=16)
    reference = _mlp(hidden=16)  # same seed -> same initial weights
    dp = _dp_model(model, lr=lr, l2_clip_norm=c, noise_multiplier=0.0, batch_size=b)
    x, y = _batch()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = [np.zeros_like(w) for w in _weights(reference)]
    for i in range(6):  # explicit per-example loop
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i:i + 1], reference(x[i:i + 1]))
        g = [t.numpy() for t in tape.gradient(loss, reference.trainable_variables)]
        norm = np.sqrt(sum(np.sum(t**2) for t in g))
        for e, t in zip(expected, g):
            e += t * min(1.0, c / norm)
    before = _weights(model)
    dp.train_step((x, y))
    for w0, w1, e in zip(before, _weights(model), expected):
        np.testing.assert_allclose(w1, w0 - lr * e / b, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_identity_views_give_the_same_update_as_one_view():
    # De et al. eq. (4): K identical views average to the single-view gradient.
    x, y = _batch()
    updates = []
    for views in (None, 4):
        model = _mlp(hidden=16)
        dp = _dp_model(model, l2_clip_norm=0.1, noise_multiplier=0.0, batch_size=6.0)
        inputs = x if views is None else tf.repeat(x[:, None], views, axis=1)
        before = _weights(model)
        dp.train_step((inputs, y))
        updates.append([w1 - w0 for w0, w1 in zip(before, _weights(model))])
    for a, b in zip(*updates):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8)


def test_metrics_report_pre_clip_norm_and_clipped_fraction():
    model = _mlp(hidden=16)
    dp = _dp_model(model, l2_clip_norm=1e-6, noise_multiplier=0.0, batch_size=6.0)
    logs = dp.train_step(_batch())
    assert set(logs) >= {"loss", "accuracy", "grad_norm", "clipped_fraction"}
    assert float(logs["clipped_fraction"]) == 1.0  # every norm exceeds 1e-6
    assert float(logs["grad_norm"]) > 0


@pytest.mark.parametrize("num_microbatches", [None, 2])
def test_a_nan_padding_row_reaches_no_statistic_and_adds_nothing(num_microbatches):
    # Found by the DP-model fuzzer: the statistics were sum(x * mask), and a masked
    # row's NaN made the logged norm, loss and accuracy NaN (0 * NaN = NaN); in the
    # microbatch path the row's NaN gradient would also have dropped its microbatch.
    model = _mlp(hidden=16)
    extra = {} if num_microbatches is None else {"num_microbatches": num_microbatches}
    dp = DPModel(model, _mechanism(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=4.0,
                                   **extra))
    dp.compile(optimizer=keras.optimizers.SGD(0.0))
    images, labels = _batch(n=4)
    mask = tf.constant([1.0, 1.0, 1.0, 0.0])
    poisoned = tf.tensor_scatter_nd_update(images, [[3]], tf.fill([1, 8], np.nan))
    summed, stats = dp.clip_and_accumulate(poisoned, labels, mask)
    clean, clean_stats = dp.clip_and_accumulate(images, labels, mask)
    assert all(np.isfinite(a.numpy()).all() for a in summed)
    assert all(np.isfinite(a.numpy()).all() for a in stats), stats
    # Microbatch ids are drawn afresh by every call: the clipped sum and the microbatch
    # norm statistics then depend on the draw; the loss and accuracy sums do not.
    same = (slice(None) if num_microbatches is None else slice(0, 2))
    if num_microbatches is None:
        for a, b in zip(summed, clean):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    for a, b in zip(stats[same], clean_stats[same]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(accumulation_steps=0), "accumulation_steps must be >= 1"),
        (dict(ema_decay=1.0), "ema_decay must be in"),
    ],
)
def test_invalid_arguments_raise_clear_errors(kwargs, message):
    mechanism = _mechanism(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=4)
    with pytest.raises(ValueError, match=message):
        DPModel(_mlp(hidden=4), mechanism, **kwargs)


def test_the_mechanism_is_required():
    with pytest.raises(ValueError, match="must be a tfdp.accounting.DPMechanism"):
        DPModel(_mlp(hidden=4), {"l2_clip_norm": 1.0})


def test_compile_rejects_a_loss():
    dp = DPModel(_mlp(hidden=4), _mechanism(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=4))
    with pytest.raises(ValueError, match="does not take 'loss'"):
        dp.compile(optimizer="sgd", loss="mse")


def test_secret_seed_is_not_in_the_config():
    dp = DPModel(_mlp(hidden=4), _mechanism(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=4),
                 noise_seed=1234)
    assert "noise_seed" not in dp.get_config()
    assert "1234" not in str(dp.get_config())


def test_microbatched_noise_follows_the_2c_sensitivity():
    # Microbatch clipping (How to DP-fy ML Sec. 5.6): noise std sigma * 2C, and the
    # sum is divided by the number of microbatches M. All examples masked -> the
    # update is -noise / M, std 2 * 0.5 * 2 / 4 = 0.5.
    sigma, c, m = 2.0, 0.5, 4
    model = _mlp()
    dp = _dp_model(model, l2_clip_norm=c, noise_multiplier=sigma, batch_size=50.0,
                   num_microbatches=m, noise_seed=5)
    x, y = _batch()
    before = _weights(model)
    dp.train_step((x, y, tf.zeros([6])))
    deltas = np.concatenate([(w1 - w0).ravel() for w0, w1 in zip(before, _weights(model))])
    expected = sigma * 2 * c / m
    assert stats.kstest(deltas, "norm", args=(0, expected)).pvalue > 1e-3
    for wrong in (expected * 2 / 3, expected * 3 / 2):
        assert stats.kstest(deltas, "norm", args=(0, wrong)).pvalue < 1e-6


def test_microbatches_clip_the_mean_gradient():
    # With one microbatch and no noise the update is -lr * clip(mean_i g_i) / 1.
    c = 0.01
    model, reference = _mlp(hidden=16), _mlp(hidden=16)
    dp = _dp_model(model, l2_clip_norm=c, noise_multiplier=0.0, batch_size=6.0,
                   num_microbatches=1)
    x, y = _batch()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, reference(x))  # mean over the batch
    g = [t.numpy() for t in tape.gradient(loss, reference.trainable_variables)]
    norm = np.sqrt(sum(np.sum(t**2) for t in g))
    before = _weights(model)
    dp.train_step((x, y))
    for w0, w1, t in zip(before, _weights(model), g):
        np.testing.assert_allclose(w1, w0 - t * min(1.0, c / norm), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("augmult", [1, 4])
@pytest.mark.parametrize("normalize", [False, True])
def test_each_clipped_contribution_is_bounded_for_any_augmult(augmult, normalize):
    from tfdp.dp import clipping  # pylint: disable=g-import-not-at-top

    c = 0.05
    dp = _dp_model(_mlp(hidden=16), l2_clip_norm=c, noise_multiplier=0.0, batch_size=6.0,
                   normalize_update=normalize)
    x, y = _batch()
    views = tf.random.stateless_normal([6, augmult, 8], seed=[1, 2])  # distinct views
    grads, _ = clipping.per_example_gradients(dp._example_loss, dp.trainable_variables,
                                              (views, y))
    factors = clipping.clip_factors(clipping.global_l2_norms(grads), c, normalize=normalize)
    contributions = clipping.global_l2_norms([g * tf.reshape(factors, [-1] + [1] * (g.shape.rank - 1))
                                              for g in grads])
    assert np.all(contributions.numpy() <= (1.0 if normalize else c) * (1 + 1e-5))


@pytest.mark.slow
def test_ema_follows_the_warmup_schedule():
    # noise 0, two updates; e_1 = 0.1 e_0 + 0.9 w_1, e_2 = (2/11) e_1 + (9/11) w_2.
    model = _mlp(hidden=16)
    dp = _dp_model(model, l2_clip_norm=1.0, noise_multiplier=0.0, batch_size=6.0,
                   ema_decay=0.9999)
    w0 = _weights(model)
    x, y = _batch()
    dp.train_step((x, y))
    w1 = _weights(model)
    dp.train_step((x, y))
    w2 = _weights(model)
    for i in range(len(w0)):
        e1 = 0.1 * w0[i] + 0.9 * w1[i]
        e2 = (2 / 11) * e1 + (9 / 11) * w2[i]
        np.testing.assert_allclose(dp.ema_variables[i].numpy(), e2, rtol=1e-5, atol=1e-7)
    with dp.use_ema_parameters():
        np.testing.assert_allclose(model.trainable_variables[0].numpy(),
                                   dp.ema_variables[0].numpy())
    np.testing.assert_array_equal(model.trainable_variables[0].numpy(), w2[0])


@pytest.mark.parametrize("accumulation_steps", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_an_empty_poisson_batch_still_takes_a_noisy_step(accumulation_steps):
    # Poisson sampling can draw no example at all; the step is then pure noise.
    model = _mlp(hidden=16)
    dp = _dp_model(model, l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=4.0,
                   accumulation_steps=accumulation_steps, noise_seed=0)
    before = _weights(model)
    dp.train_step((tf.zeros([0, 8]), tf.zeros([0], tf.int32)))
    assert int(dp.optimizer.iterations.numpy()) == 1
    assert all(np.all(np.isfinite(w)) for w in _weights(model))
    assert any(np.any(w0 != w1) for w0, w1 in zip(before, _weights(model)))


@pytest.mark.parametrize("size, multiple, min_rows, padded", [
    (0, 1, 1, 1), (1, 1, 1, 1), (0, 3, 1, 3), (4, 3, 1, 6),
    (0, 1, 2, 2), (1, 1, 2, 2), (2, 1, 2, 2), (5, 1, 2, 5), (1, 3, 2, 6), (7, 3, 2, 9)])
def test_a_batch_of_unknown_size_is_padded_to_whole_chunks_of_min_rows(size, multiple, min_rows,
                                                                       padded):
    # DPModel gives every chunk of unknown size two rows (`_chunk_contribution`):
    # tf.vectorized_map over an unknown loop length that turns out to be 1 reshapes wrongly
    # in attention models (oneDNN off; found by the DP-model fuzzer).
    from tfdp.training import chunked  # pylint: disable=g-import-not-at-top
    pad = tf.function(lambda x, m: chunked.pad_rows((x, m), multiple, min_rows),
                      input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None])])
    x, m = pad(tf.ones([size, 3]), tf.ones([size]))
    assert x.shape == (padded, 3) and m.shape == (padded,)
    np.testing.assert_array_equal(m, [1.0] * size + [0.0] * (padded - size))
    np.testing.assert_array_equal(x[size:], 0.0)


def test_a_static_batch_that_splits_evenly_is_not_padded():
    from tfdp.training import chunked  # pylint: disable=g-import-not-at-top
    x = tf.ones([1, 3])  # static 1: vectorized_map over a known length of 1 runs
    assert chunked.pad_rows((x,), 1)[0] is x
    assert chunked.pad_rows((x,), 1, min_rows=2)[0].shape == (2, 3)


class _FixedIds(_Noiseless):
    """Noiseless, and the microbatch ids come from a table: adjacent batches by hand."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.id_table = tf.Variable(tf.zeros([8], tf.int32), trainable=False)

    def draw_microbatch_ids(self, mask):
        return self.id_table[:tf.shape(mask)[0]]


def _linear_clipped_sums(accumulation_steps, num_microbatches):
    """Clipped sums of D = [-3, 2, -1] and D' = [4, -3, 2, -1] (times 10 e_1), C = 1.

    A linear model with a zero kernel and label 0 has per-example gradient
    x (softmax - e_0), so these examples' gradients lie along one direction
    with norms 10 |c| * 0.95 >> C: every clipped unit has norm exactly C.
    Yields (ids of D, id of the added example, ||sum(D') - sum(D)||) for every
    microbatch assignment, the shared examples keeping their ids (coupling).
    """
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(10, use_bias=False,
                                                   kernel_initializer="zeros")(inputs))
    mechanism = _mechanism(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=4,
                           num_microbatches=num_microbatches)
    dp = _FixedIds(model, mechanism, accumulation_steps=accumulation_steps)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    clipped_sum = tf.function(lambda x, y, m: dp.clip_and_accumulate(x, y, m)[0])

    def batch(cs):
        x = tf.constant([[10.0 * c, 0.0] for c in cs])
        return x, tf.zeros([len(cs)], tf.int32), tf.ones([len(cs)])

    d, d_plus = batch([-3, 2, -1]), batch([4, -3, 2, -1])
    m = num_microbatches or 1
    for ids in np.ndindex(*([m] * 3)):
        for added in range(m):
            dp.id_table.assign(list(ids) + [0] * 5)
            before = clipped_sum(*d)
            dp.id_table.assign([added, *ids] + [0] * 4)
            after = clipped_sum(*d_plus)
            delta = np.sqrt(sum(np.sum((a - b).numpy() ** 2) for a, b in zip(after, before)))
            yield ids, added, delta


@pytest.mark.parametrize("accumulation_steps", [1, 2, 4])
def test_microbatched_sensitivity_is_2c_for_any_chunking(accumulation_steps):
    # The review's reproduction (How to DP-fy ML Sec. 5.6): with 2 accumulation chunks and
    # per-chunk microbatches, adding 4 at index 0 moved the later examples across the chunk
    # boundary and changed both microbatches: ||delta|| = 4C. Microbatches that span the
    # chunks change only the added example's one: <= 2C, whatever the ids.
    # Each unit is clipped to C / (1 + kappa), so 2C becomes 2C / (1 + kappa).
    deltas = [delta for _, _, delta in _linear_clipped_sums(accumulation_steps, 2)]
    assert len(deltas) == 16
    clipped_to = 1.0 / (1 + precision.clip_margin())
    assert max(deltas) <= 2.0 * clipped_to + 3e-6
    assert max(deltas) >= 2.0 * clipped_to - 3e-6  # all in one microbatch: -1 -> +1 (tight)


@pytest.mark.parametrize("accumulation_steps", [1, 2, 4])
def test_per_example_sensitivity_is_c_for_any_chunking(accumulation_steps):
    deltas = [delta for _, _, delta in _linear_clipped_sums(accumulation_steps, None)]
    # exactly the added clipped vector, of norm C / (1 + kappa)
    assert deltas == pytest.approx([1.0 / (1 + precision.clip_margin())], abs=3e-6)


@pytest.mark.parametrize("batch, accumulation_steps", [
    (0, 1), *(pytest.param(*case, marks=pytest.mark.slow) for case in [(0, 2), (1, 2), (3, 4)])])
def test_empty_chunks_of_a_conv_model_are_padded_not_an_error(batch, accumulation_steps):
    # Poisson batches can be empty or smaller than the chunk count; vectorized conv kernel
    # gradients fail on an empty chunk ("Tried to stack elements of an empty list").
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 1))
    x = keras.layers.Conv2D(2, 3)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(x)))
    dp = _dp_model(model, l2_clip_norm=1.0, noise_multiplier=0.0, batch_size=4.0,
                   accumulation_steps=accumulation_steps)
    step = tf.function(dp.train_step, input_signature=[(
        tf.TensorSpec([None, 6, 6, 1], tf.float32), tf.TensorSpec([None], tf.int32))])
    before = _weights(model)
    step((tf.ones([batch, 6, 6, 1]), tf.zeros([batch], tf.int32)))
    changed = any(np.any(w0 != w1) for w0, w1 in zip(before, _weights(model)))
    assert changed == (batch > 0)  # noiseless: only real examples move the weights


def test_compile_refuses_a_batch_norm_unfrozen_after_the_model_was_wrapped():
    inputs = keras.Input((4,))
    bn = keras.layers.BatchNormalization()
    bn.trainable = False  # frozen: accepted by DPModel.__init__
    model = keras.Model(inputs, keras.layers.Dense(3)(bn(inputs)))
    dp = DPModel(model, _mechanism(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=4))
    bn.trainable = True  # now it would normalize with batch statistics
    with pytest.raises(ValueError, match="BatchNorm"):
        dp.compile(optimizer="sgd")


@pytest.mark.slow
def test_the_jit_compiled_step_compiles_once_for_every_batch():
    # The recompute of non-finite examples first indexed the batch with `images[i]`: XLA took
    # the slice's data-dependent start as a compile-time constant, baked each batch into the
    # program and compiled again for every batch (3.3 s a call here, 27 s for B = 64; found
    # by a helper exporting the step for the GPU). tf.gather keeps one program.
    import time  # pylint: disable=g-import-not-at-top

    from tfdp.models import build_tramer_cnn  # pylint: disable=g-import-not-at-top

    keras.utils.set_random_seed(0)
    dp = DPModel(build_tramer_cnn(10, input_shape=(28, 28, 1)),
                 _mechanism(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=8),
                 clipping="ghost")
    dp.compile(optimizer=keras.optimizers.SGD(0.0), jit_compile=True)
    step = tf.function(lambda x, y, m: dp.clip_and_accumulate(x, y, m), jit_compile=True)
    rng = np.random.default_rng(0)
    seconds = []
    for _ in range(3):
        x = rng.uniform(0, 255, (8, 28, 28, 1)).astype(np.float32)
        start = time.perf_counter()
        step(x, np.arange(8, dtype=np.int32) % 10, np.ones(8, np.float32))[0][0].numpy()
        seconds.append(time.perf_counter() - start)
    assert max(seconds[1:]) < 0.2 * seconds[0], seconds
