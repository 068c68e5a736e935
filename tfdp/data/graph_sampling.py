"""Which examples each step uses, in TensorFlow ops: the samplers of a pure-TF input.

`tfdp.data.sampling` draws the batches in numpy, through `tf.numpy_function`,
which a TPU pod's per-host input graphs cannot run (TensorFlow drives a pod
from one client process; tensorflow/tensorflow#38762). The samplers here give
the same mechanism with TensorFlow ops only, so an input whose reads are
TensorFlow ops too (`ArraySource`, `JPEGFolderSource`: `source.pure_tf`) has
no Python callback at all (`tests/data/graph_sampling_test.py` reads its
graph).

`poisson_indices_in_graph` is the default: at every step each example is
included independently with probability q' <= q = sampling_prob (the
docstring derives why this is the mechanism the accountant assumes). It costs
O(N) per step (one 64-bit random word per example): 13 ms of one core at
N = 1.28M (docs/design/sampling_and_distribution.md), on every host, each of which computes
the same vector. `shuffled_indices_in_graph` is the non-default shuffle.

The seed is secret (the trainer draws it from OS entropy and keeps it only in
the checkpoint; `tfdp.dp.seeds`). `index_batches_in_graph` holds it in a
tf.Variable on the host's CPU, created where the host's pipeline is built, so
it is not a constant of the tf.data graph (a serialized graph holds the
variable's handle, not its value: tested), and nothing here logs it.

Every batch is a pure function of (seed, step, N, q): a run resumed at step k
continues the very same stream from step k.
"""

# The argument checks are tfdp.data.sampling's own (the same messages on both paths).
# pylint: disable=protected-access
import fractions

import numpy as np
import tensorflow as tf

from tfdp.data import sampling as sampling_lib

# Salts mixed into the seed, one per sampler (arbitrary distinct ints, distinct from
# tfdp.data.sampling's, so the two samplers never share a random stream).
_POISSON_SALT = 0x5EED_0003
_SHUFFLE_SALT = 0x5EED_0004
# Counter-based generator: the same bits on every platform. ("auto_select" may
# pick ThreeFry on a TPU; the input runs on host CPUs, but every host must agree.)
_ALG = "philox"
_TWO_POW_64 = 2**64



def inclusion_threshold(sampling_prob):
    """The integer T = floor(q * 2**64): an example is in the batch iff its word W < T.

    Computed exactly from the float q (`fractions.Fraction` of a float is
    exact), so T / 2**64 <= q always, and q - T / 2**64 < 2**-64.

    >>> inclusion_threshold(0.5) == 2**63
    True
    >>> inclusion_threshold(16384 / 1271167) / 2**64 <= 16384 / 1271167
    True

    Args:
      sampling_prob: q in (0, 1), a Python float.

    Returns:
      A Python int in [0, 2**64).

    Raises:
      ValueError: q not in (0, 1) (q = 1 takes every example; the caller
        handles it without a threshold).
    """
    if not 0.0 < sampling_prob < 1.0:
        raise ValueError(f"sampling_prob must be in (0, 1) here, got {sampling_prob}.")
    return int(fractions.Fraction(sampling_prob) * _TWO_POW_64)  # int() floors a positive


def inclusion_probability(sampling_prob):
    """q' = T / 2**64, the exact inclusion probability of `poisson_indices_in_graph`.

    Args:
      sampling_prob: q in (0, 1].

    Returns:
      `fractions.Fraction` q', with q - 2**-64 < q' <= q (q' = 1 for q = 1).
    """
    if sampling_prob == 1.0:
        return fractions.Fraction(1)
    return fractions.Fraction(inclusion_threshold(sampling_prob), _TWO_POW_64)


def poisson_indices_in_graph(seed, step, *, num_examples, sampling_prob):
    """The Poisson sample of one step, in TensorFlow ops (graph or eager).

    Returns the sorted indices i in [0, N) with W_i < T, where
    W_0, ..., W_(N-1) are the 64-bit words of a counter-based Philox stream
    keyed by (secret seed, salt, step) (`tf.random.stateless_uniform`,
    full-range int64, read as unsigned) and T = floor(q 2^64)
    (`inclusion_threshold`).

    Why this is the mechanism the accountant assumes (Poisson subsampling
    with rate q; Ponomareva et al. 2023, Sec. 5.3.1; De et al. 2022, Sec. 2):

    1. Inclusion law. Philox with a secret key is a pseudorandom function:
       its words are indistinguishable from i.i.d. uniform on {0, ..., 2^64 - 1}
       (the same assumption as `tfdp.data.poisson_indices`, which draws from
       numpy's Philox). Example i is in the batch iff W_i < T, so with
       probability exactly q' = T / 2^64, independently of every other
       example (distinct i read distinct words), and |B_t| ~ Binomial(N, q').
       The words of step t are keyed by `stateless_fold_in((seed, salt), t)`
       = (H(seed, salt), t), which the op maps through a Philox bijection to
       a (key, counter) pair: two steps never share a word, so the batches of
       different steps are independent too.
    2. q' versus q. q - 2^-64 < q' <= q (`inclusion_threshold` floors the
       exact binary value of q, the very float the accountant reads). For
       Poisson subsampling, every privacy-loss quantity the accountant
       computes (hockey-stick divergences, hence (epsilon, delta), and RDP)
       is a divergence between the subsampled pair ((1 - q) Q + q P, Q) or
       (Q, (1 - q) Q + q P) of the base mechanism's pair (P, Q). Each is
       jointly convex, so as a function f of q it is convex with f(0) = 0
       and f >= 0, hence non-decreasing on [0, 1]: f(q') <= (q'/q) f(q) +
       (1 - q'/q) f(0) <= f(q). So the accountant's epsilon at q bounds the
       epsilon of the sampler at q'. (q = 1 takes every example: no words.)
    3. Truncation and padding are unchanged: the index vector is sorted, as
       `poisson_indices`' is, and `tfdp.data.train_chunks` truncates it to
       its first S indices and pads it exactly as before
       (`tfdp.data.padding`: eta = T P(Binomial(N + 1, q) > S) bounds the
       truncation event, and q' <= q only lowers it).

    It is a different random stream from `poisson_indices` (another
    generator), not a different mechanism. tests/data/graph_sampling_test.py
    checks each example's inclusion frequency (chi^2), the Binomial(N, q)
    law of |B_t|, independence across indices and across steps, and resume.

    Cost: N words (8N bytes, transient) per call: O(N), about 13 ms of one
    core at N = 1.28M; every host computes the same vector.

    Args:
      seed: the secret sampling seed, an int64 scalar tensor (or Python int)
        in [0, 2**63).
      step: the optimizer update (0-based), an int64 scalar tensor or int.
      num_examples: N >= 1, a Python int.
      sampling_prob: q in (0, 1], a Python float.

    Returns:
      int64 [|B_t|], strictly increasing, values in [0, N).

    Raises:
      ValueError: N < 1, or q not in (0, 1].
    """
    num_examples = sampling_lib._check_num_examples(num_examples)
    if not 0.0 < sampling_prob <= 1.0:
        raise ValueError(
            f"sampling_prob must be in (0, 1], got {sampling_prob}; it is the expected "
            "batch size divided by the number of training examples.")
    if sampling_prob == 1.0:
        return tf.range(num_examples, dtype=tf.int64)
    # Signed words: W_i - 2^63 < T - 2^63 <=> W_i < T, for W_i read as unsigned.
    threshold = tf.constant(inclusion_threshold(sampling_prob) - 2**63, tf.int64)
    words = tf.random.stateless_uniform(
        [num_examples], seed=_step_key(seed, _POISSON_SALT, step), dtype=tf.int64,
        minval=None, maxval=None, alg=_ALG)
    return tf.where(words < threshold)[:, 0]


def shuffled_indices_in_graph(seed, step, *, num_examples, batch_size):
    """Fixed-size batches from a fresh pseudorandom permutation every epoch, in TF ops.

    NOT the default; no amplification by sampling is claimed for it
    (`tfdp.data.shuffled_indices` gives the accounting). Epoch e (steps
    e S ... e S + S - 1, S = N // batch_size) takes consecutive slices of
    the permutation P_e = `tf.random.experimental.index_shuffle` keyed by
    (seed, salt, e): position p of epoch e is example P_e(p). Within an
    epoch no example repeats; the last N % batch_size of P_e are dropped.
    O(batch_size) per step, no O(N) permutation held.

    Args:
      seed: secret seed, int64 scalar tensor or int in [0, 2**63).
      step: the optimizer update, int64 scalar tensor or int.
      num_examples: N >= 1.
      batch_size: 1 <= batch_size <= N.

    Returns:
      int64 [batch_size], distinct values in [0, N).

    Raises:
      ValueError: N < 1, batch_size not in [1, N].
    """
    num_examples = sampling_lib._check_num_examples(num_examples)
    sampling_lib._check_batch_size(batch_size, num_examples)
    steps_per_epoch = num_examples // batch_size
    step = tf.cast(step, tf.int64)
    epoch, position = step // steps_per_epoch, step % steps_per_epoch
    positions = position * batch_size + tf.range(batch_size, dtype=tf.int64)
    return tf.random.experimental.index_shuffle(
        positions, seed=_step_key(seed, _SHUFFLE_SALT, epoch),
        max_index=tf.constant(num_examples - 1, tf.int64))


def index_batches_in_graph(*, sampling, num_examples, batch_size, num_steps, seed,
                           start_step=0):
    """One index vector per training step, as a tf.data pipeline of TensorFlow ops only.

    The same contract as `tfdp.data.index_batches` (element k is the batch of
    step start_step + k; "poisson" takes sampling_prob = batch_size /
    num_examples), with the samplers of this module. The seed goes into a
    non-trainable int64 tf.Variable on the CPU of the device scope this is
    called in (each host's own, inside `distribute_datasets_from_function`),
    captured by reference: it is not a constant of the graph.

    Call it eagerly (not inside a tf.function): it creates the variable.

    Args:
      sampling: "poisson" or "shuffle".
      num_examples: N >= 1.
      batch_size: expected (Poisson) or fixed (shuffle) batch size, in [1, N].
      num_steps: total optimizer updates of the run.
      seed: int in [0, 2**63), the secret sampling seed.
      start_step: first step to produce, in [0, num_steps].

    Returns:
      tf.data.Dataset of num_steps - start_step elements, each int64 [None].

    Raises:
      ValueError: as `tfdp.data.index_batches`.
    """
    if sampling not in sampling_lib.SAMPLING_SCHEMES:
        raise ValueError(f"Unknown sampling scheme {sampling!r}; use one of "
                         f"{sampling_lib.SAMPLING_SCHEMES}.")
    sampling_lib._check_seed_and_step(seed, 0)
    num_examples = sampling_lib._check_num_examples(num_examples)
    sampling_lib._check_batch_size(batch_size, num_examples)
    sampling_lib._check_steps(num_steps, start_step)
    with tf.device("/CPU:0"):  # merged with the host's device scope
        secret = tf.Variable(int(seed), dtype=tf.int64, trainable=False,
                             name="sampling_seed")
    if sampling == "poisson":
        def indices_for_step(step):
            return poisson_indices_in_graph(secret.read_value(), step,
                                            num_examples=num_examples,
                                            sampling_prob=batch_size / num_examples)
    else:
        def indices_for_step(step):
            return shuffled_indices_in_graph(secret.read_value(), step,
                                             num_examples=num_examples, batch_size=batch_size)

    def ensure(step):
        return tf.ensure_shape(indices_for_step(step), [None])

    ds = tf.data.Dataset.range(start_step, num_steps)
    return ds.map(ensure, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _step_key(seed, salt, counter):
    """The stateless seed of (secret seed, salt, counter): an int64 [2] tensor."""
    base = tf.stack([tf.cast(seed, tf.int64), tf.constant(salt, tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, tf.cast(counter, tf.int64), alg=_ALG)


def numpy_reference(seed, step, *, num_examples, sampling_prob):
    """`poisson_indices_in_graph` run eagerly, as a numpy int64 array (tests, tools)."""
    return np.asarray(poisson_indices_in_graph(
        tf.constant(seed, tf.int64), tf.constant(step, tf.int64), num_examples=num_examples,
        sampling_prob=sampling_prob))
