"""Which examples each training step uses: samplers over indices 0 .. N - 1.

`poisson_indices` is the default and the sampler the privacy accountant
assumes: at every step each example is included independently with probability
sampling_prob, so batch sizes vary (How to DP-fy ML, Ponomareva et al. 2023,
Sec. 4.3 and 5.3.1; De et al. 2022, Sec. 2 "Privacy accounting" and App. A.1).
It costs O(expected batch size) per step, never O(N), so it runs over
ImageNet's 1.27M examples as cheaply as over Fashion-MNIST's 60k.
`shuffled_indices` (fixed-size batches from per-epoch shuffles) is an explicit,
non-default option whose epsilon is NOT what the accountant computes.

Both are pure functions of (seed, step, N, and q or B): no state, so two runs
with the same seed see identical batches, and a run resumed at step k (after a
crash or a preemption) continues the very same stream from step k. The seed is
mixed with a per-sampler salt (`np.random.SeedSequence`), so data sampling never
shares a random stream with another use of the same integer seed. Random
numbers come from numpy's Philox generator, which is the same on every
platform.

The seed is secret by default (the trainer draws it from OS entropy and keeps it
only in the checkpoint): nothing here logs, prints or stores it, and
`index_batches` keeps it in a Python closure, so it is not a constant in the
tf.data graph either.

`index_batches` turns a sampler into a `tf.data.Dataset` of index vectors, one
per step; `tfdp.data.train_batches` reads the examples of each vector from a
source (a TFDS ArrayRecord split, or arrays in memory).
"""

import functools
import math
import threading

import numpy as np
import tensorflow as tf

SAMPLING_SCHEMES = ("poisson", "shuffle")

# Salts mixed into the user's seed, one per sampler (arbitrary distinct ints).
_POISSON_SALT = 0x5EED_0001
_SHUFFLE_SALT = 0x5EED_0002
_MAX_SEED = 2**63  # the trainer draws seeds in [0, 2**63)
# Geometric gaps drawn per round: the expected count plus this many standard
# deviations (and a small constant), so one round almost always suffices.
_ROUND_STDS = 4.0


def poisson_indices(seed, step, *, num_examples, sampling_prob):
    """The Poisson sample of one step: every example independently with prob. q.

    Returns the sorted indices i in [0, N) of the examples in batch B_t, where
    each example is in B_t independently with probability q = sampling_prob,
    so |B_t| ~ Binomial(N, q) (it can be 0; the DP update divides by the
    expected batch size q * N, never by |B_t|). This is the sampling the
    accountant's epsilon assumes (Ponomareva et al. 2023, Sec. 5.3.1; De et
    al. 2022, Sec. 2).

    How: per-example geometric skips. With G_1, G_2, ... i.i.d. Geometric(q) on
    {1, 2, ...} (P(G = g) = (1 - q)^(g - 1) q), the batch is
    {S_k - 1 : S_k <= N} with S_k = G_1 + ... + G_k. The gaps are drawn
    vectorized in rounds from one Philox stream keyed by (seed, salt, step).

    Why this is exactly independent Bernoulli(q) inclusion: fix any subset
    {i_1 < ... < i_m} of [0, N). It is the output iff G_1 = i_1 + 1,
    G_j = i_j - i_(j-1) for 2 <= j <= m, and G_(m+1) > N - 1 - i_m. These
    events are independent, so the probability is
        prod_j q (1 - q)^(G_j - 1) * (1 - q)^(N - 1 - i_m)
        = q^m (1 - q)^((i_m + 1 - m) + (N - 1 - i_m)) = q^m (1 - q)^(N - m),
    which is the probability that N independent Bernoulli(q) coins come up
    heads exactly on {i_1, ..., i_m}. Two laws that agree on every subset are
    equal. (Drawing the gaps in rounds from one stream is the same as drawing
    one i.i.d. sequence; only as many are used as reach N.) numpy's
    `Generator.geometric` is exact up to float64 rounding (inversion of a
    uniform for q < 1/3, sequential search otherwise).

    Cost per step: O(q * N) time and memory (about 2 ms for q * N = 16384 on
    one core), never O(N). tests/data/sampling_test.py checks every example's
    inclusion frequency, pairwise independence and the Binomial(N, q) law of
    |B_t|.

    Args:
      seed: int in [0, 2**63), the secret sampling seed.
      step: int >= 0, the optimizer update (0-based).
      num_examples: N >= 1, examples in the training split.
      sampling_prob: q in (0, 1].

    Returns:
      int64 [|B_t|], strictly increasing, values in [0, N).

    Raises:
      ValueError: seed not an int in [0, 2**63); step < 0; N < 1; q not in
        (0, 1].
    """
    _check_seed_and_step(seed, step)
    num_examples = _check_num_examples(num_examples)
    if not 0.0 < sampling_prob <= 1.0:
        raise ValueError(
            f"sampling_prob must be in (0, 1], got {sampling_prob}; it is the expected "
            "batch size divided by the number of training examples."
        )
    if sampling_prob == 1.0:
        return np.arange(num_examples, dtype=np.int64)
    rng = _generator(seed, _POISSON_SALT, step)
    expected = sampling_prob * num_examples
    per_round = int(expected + _ROUND_STDS * math.sqrt(expected) + 16)
    rounds, last = [], -1  # `last`: the index of the last included example so far
    while True:
        gaps = rng.geometric(sampling_prob, size=per_round)
        # A gap past the end ends the batch; clipping keeps the cumsum from overflowing.
        np.minimum(gaps, num_examples + 1, out=gaps)
        positions = last + np.cumsum(gaps)
        if positions[-1] >= num_examples:
            rounds.append(positions[positions < num_examples])
            return np.concatenate(rounds).astype(np.int64, copy=False)
        rounds.append(positions)
        last = int(positions[-1])


def shuffled_indices(seed, step, *, num_examples, batch_size):
    """Fixed-size batches from a fresh random permutation every epoch.

    NOT the default. No amplification by sampling is claimed for it (the
    amplified epsilon of shuffling is an open question; Ponomareva et al.
    2023, Sec. 4.3 and 5.3.1; De et al. 2022, App. A.1): `DPMechanism`
    accounts for it as replace-one adjacency with sensitivity 2C, an example
    being in at most one batch per epoch, over the epochs a run touches.

    Epoch e (steps e * S ... e * S + S - 1, with S = N // batch_size steps per
    epoch) takes consecutive batch_size slices of permutation P_e, keyed by
    (seed, salt, e); the last N % batch_size examples of P_e are dropped (a
    different random set each epoch). So within an epoch no example repeats.
    Cost: one O(N) permutation per epoch, cached (the last two epochs' are
    kept, 8 N bytes each), so O(batch_size) per step on average.

    Args:
      seed: int in [0, 2**63), the secret sampling seed.
      step: int >= 0, the optimizer update (0-based).
      num_examples: N >= 1.
      batch_size: examples per batch, 1 <= batch_size <= N.

    Returns:
      int64 [batch_size], values in [0, N), distinct.

    Raises:
      ValueError: bad seed or step; batch_size not in [1, N].
    """
    _check_seed_and_step(seed, step)
    num_examples = _check_num_examples(num_examples)
    _check_batch_size(batch_size, num_examples)
    steps_per_epoch = num_examples // batch_size
    epoch, position = divmod(int(step), steps_per_epoch)
    permutation = _epoch_permutation(int(seed), epoch, num_examples)
    return permutation[position * batch_size:(position + 1) * batch_size]


_PERMUTATION_LOCK = threading.Lock()  # tf.data may call from several threads


@functools.lru_cache(maxsize=2)
def _cached_permutation(seed, epoch, num_examples):
    permutation = _generator(seed, _SHUFFLE_SALT, epoch).permutation(num_examples)
    permutation.flags.writeable = False
    return permutation


def _epoch_permutation(seed, epoch, num_examples):
    with _PERMUTATION_LOCK:
        return _cached_permutation(seed, epoch, num_examples)


def index_batches(*, sampling, num_examples, batch_size, num_steps, seed, start_step=0):
    """One index vector per training step, as a tf.data pipeline.

    For "poisson", sampling_prob = batch_size / num_examples, so batch_size is
    the expected batch size (the value the accountant and the DP update use);
    for "shuffle", every batch has exactly batch_size indices and the
    accountant's epsilon does not apply (see `shuffled_indices`).

    The indices are computed by `tf.numpy_function` (the seed stays in a Python
    closure, out of the graph) in parallel and in order: element k is the
    batch of step start_step + k, whatever was consumed before.

    Args:
      sampling: one of SAMPLING_SCHEMES, "poisson" or "shuffle".
      num_examples: N >= 1, examples in the training split.
      batch_size: expected (Poisson) or fixed (shuffle) logical batch size,
        1 <= batch_size <= N.
      num_steps: total optimizer updates of the run (not epochs).
      seed: int in [0, 2**63), the secret sampling seed.
      start_step: first step to produce, 0 <= start_step <= num_steps (a run
        resumed from a checkpoint after k updates passes k).

    Returns:
      tf.data.Dataset of num_steps - start_step elements, each int64 [None].

    Raises:
      ValueError: unknown sampling scheme (the message lists the valid ones);
        bad seed; N < 1; batch_size not in [1, N]; num_steps < 0; start_step
        not in [0, num_steps].
    """
    if sampling not in SAMPLING_SCHEMES:
        raise ValueError(f"Unknown sampling scheme {sampling!r}; use one of {SAMPLING_SCHEMES}.")
    _check_seed_and_step(seed, 0)
    num_examples = _check_num_examples(num_examples)
    _check_batch_size(batch_size, num_examples)
    _check_steps(num_steps, start_step)
    if sampling == "poisson":
        sampler = functools.partial(
            poisson_indices, num_examples=num_examples, sampling_prob=batch_size / num_examples)
    else:
        sampler = functools.partial(
            shuffled_indices, num_examples=num_examples, batch_size=batch_size)

    def indices_for_step(step):
        indices = tf.numpy_function(
            lambda t: sampler(seed, int(t)), [step], tf.int64, stateful=False)
        return tf.ensure_shape(indices, [None])

    ds = tf.data.Dataset.range(start_step, num_steps)
    return ds.map(indices_for_step, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _check_batch_size(batch_size, num_examples):
    """Raises ValueError unless batch_size is an int in [1, num_examples]."""
    if (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
            or not 1 <= batch_size <= num_examples):
        raise ValueError(
            f"batch_size must be an int in [1, num_examples={num_examples}], got "
            f"{batch_size!r}; lower batch_size or use a larger training split."
        )


def _check_steps(num_steps, start_step):
    """Raises ValueError unless num_steps >= 0 and 0 <= start_step <= num_steps (ints)."""
    if not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}.")
    if not isinstance(start_step, (int, np.integer)) or not 0 <= start_step <= num_steps:
        raise ValueError(
            f"start_step must be an int in [0, num_steps={num_steps}], got {start_step!r} "
            "(it is the number of updates already done by a resumed run)."
        )


def _check_seed_and_step(seed, step):
    # The message never shows the seed's value: it is secret.
    if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
            or not 0 <= seed < _MAX_SEED):
        raise ValueError(
            "The sampling seed must be an int in [0, 2**63); got a "
            f"{type(seed).__name__} that is not (its value is not shown: the seed is secret)."
        )
    if int(step) < 0:
        raise ValueError(f"step must be >= 0, got {step}.")


def _check_num_examples(num_examples):
    if int(num_examples) < 1:
        raise ValueError(
            f"num_examples must be >= 1, got {num_examples}; check the dataset split.")
    return int(num_examples)


def _generator(seed, salt, counter):
    """A Philox generator keyed by (seed, salt, counter): independent streams."""
    sequence = np.random.SeedSequence(int(seed), spawn_key=(salt, int(counter)))
    return np.random.Generator(np.random.Philox(sequence))
