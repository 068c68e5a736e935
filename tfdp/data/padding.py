"""Static batch shapes for Poisson batches: pad (and truncate) with a mask.

Poisson sampling gives batches of random size |B_t| ~ Binomial(N, q), but XLA
and TPUs compile one program per input shape. `pad_batches` pads every batch to
a fixed `static_batch_size` with masked slots (mask 0: the DP update gives them
a zero weight, so they contribute exactly nothing and are not counted), and
truncates the rare batch that is larger. Without a static size, batches are
only padded up to a multiple of the replica count, so that every replica gets
an equal slice (CPU and GPU runs keep their variable shapes).

Privacy of truncation. Keeping at most `static_batch_size` examples changes
the mechanism only on the event that some step's Poisson batch is larger. Over
`num_steps` steps, on a dataset of N or N + 1 examples (add-or-remove
adjacency), that event has probability at most

    eta = num_steps * P(Binomial(N + 1, q) > static_batch_size)

(union bound; the tail grows with N). DP-SGD with Poisson sampling and the
truncated run can be coupled to agree outside that event, so if the former is
(epsilon, delta)-DP the latter is (epsilon, delta + (1 + e^epsilon) * eta)-DP:
for neighbours D, D' and any output set S,
P[M'(D) in S] <= P[M(D) in S] + eta <= e^eps P[M(D') in S] + delta + eta
<= e^eps P[M'(D') in S] + delta + (1 + e^eps) eta. (Chua et al. 2024,
"Scalable DP-SGD: Shuffling vs. Poisson Subsampling", arXiv:2411.04205,
introduce this truncated Poisson sampling and, as quoted by Ganesh 2025,
arXiv:2508.15089, state the slightly tighter delta + e^eps * eta; Ganesh 2025
and `dp_accounting.TruncatedSubsampledGaussianDpEvent` give tighter analyses.)
`choose_static_batch_size` picks the smallest cap for which the extra delta is
below a stated bound; the trainer asks for delta / 10 and states the cap and
the bound in the privacy report.

The probability functions are pure Python over `scipy.stats.binom` (scipy
comes with dp-accounting) and do not touch TensorFlow.
"""

import math

import tensorflow as tf


def truncation_probability(num_examples, sampling_prob, static_batch_size, num_steps):
    """Upper bound on the probability that any step's Poisson batch is truncated.

    `num_steps * P(Binomial(num_examples + 1, sampling_prob) > static_batch_size)`,
    capped at 1: a union bound over the steps, on the larger of two neighbouring
    datasets (the tail grows with the number of examples, so it bounds both).

    >>> truncation_probability(60000, 2048 / 60000, 2048, 1) > 0.4
    True
    >>> truncation_probability(60000, 2048 / 60000, 2400, 1172) < 1e-10
    True

    Args:
      num_examples: N >= 1, examples in the training set.
      sampling_prob: q in (0, 1], each example's inclusion probability.
      static_batch_size: the cap, examples kept per step (>= 0).
      num_steps: T >= 0, optimizer updates of the run.

    Returns:
      eta in [0, 1], a Python float.

    Raises:
      ValueError: on num_examples < 1, sampling_prob outside (0, 1], a negative
        static_batch_size or a negative num_steps.
    """
    _check(num_examples, sampling_prob, num_steps)
    if static_batch_size < 0:
        raise ValueError(f"static_batch_size must be >= 0, got {static_batch_size}.")
    from scipy import stats  # pylint: disable=g-import-not-at-top

    tail = float(stats.binom.sf(int(static_batch_size), int(num_examples) + 1, sampling_prob))
    return min(1.0, int(num_steps) * tail)


def delta_with_truncation(delta, epsilon, truncation_prob):
    """delta + (1 + e^epsilon) * eta: the delta of the truncated run (see module doc).

    >>> delta_with_truncation(1e-5, 0.0, 1e-7)
    1.02e-05

    Args:
      delta: the accountant's delta for untruncated Poisson DP-SGD.
      epsilon: the accountant's epsilon at that delta.
      truncation_prob: eta, from `truncation_probability`.

    Returns:
      The delta of the truncated mechanism, a Python float (may exceed 1 when
      eta is large: then the guarantee is void).
    """
    return float(delta) + (1.0 + math.exp(float(epsilon))) * float(truncation_prob)


def choose_static_batch_size(
    num_examples, sampling_prob, num_steps, max_truncation_probability, multiple=1
):
    """Smallest multiple of `multiple` whose truncation probability is <= the bound.

    >>> choose_static_batch_size(60000, 2048 / 60000, 1172, 1e-7 / 3000, multiple=8)
    2392

    Args:
      num_examples: N >= 1, examples in the training set.
      sampling_prob: q in (0, 1].
      num_steps: T >= 0, optimizer updates of the run.
      max_truncation_probability: the largest acceptable eta, in (0, 1).
      multiple: the cap is rounded up to a multiple of this (replicas times
        accumulation steps, so every replica and chunk has the same static size).

    Returns:
      The cap, a Python int in [multiple, round_up(N + 1, multiple)].

    Raises:
      ValueError: on a max_truncation_probability outside (0, 1), multiple < 1,
        or invalid N, q, T.
    """
    _check(num_examples, sampling_prob, num_steps)
    if not 0.0 < max_truncation_probability < 1.0:
        raise ValueError(
            f"max_truncation_probability must be in (0, 1), got {max_truncation_probability}."
        )
    if int(multiple) < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}.")
    from scipy import stats  # pylint: disable=g-import-not-at-top

    multiple = int(multiple)
    n = int(num_examples) + 1
    per_step = max_truncation_probability / max(int(num_steps), 1)
    guess = stats.binom.isf(per_step, n, sampling_prob)  # ~smallest k with sf(k) <= per_step
    guess = 0 if not math.isfinite(guess) else max(int(guess) - 2, 0)
    cap = max(multiple, _round_up(guess, multiple))
    while cap < n and truncation_probability(
        num_examples, sampling_prob, cap, num_steps) > max_truncation_probability:
        cap += multiple
    while cap - multiple >= multiple and truncation_probability(
        num_examples, sampling_prob, cap - multiple, num_steps) <= max_truncation_probability:
        cap -= multiple
    return cap


def pad_batch(images, labels, *, static_batch_size=None, multiple=1):
    """Pads one batch (truncating it first when a static size is given) and masks it.

    Args:
      images: `[batch, ...]` any dtype (uint8 images `[batch, H, W, C]`, or
        augmult views `[batch, K, H, W, C]`).
      labels: `[batch]` integers.
      static_batch_size: None, or the static size S: the first min(batch, S)
        examples are kept (in their order) and the rest padded with zeros.
      multiple: without `static_batch_size`, pad to
        `max(1, ceil(batch / multiple)) * multiple` slots (so that `multiple`
        replicas get equal, non-empty slices).

    Returns:
      `(images, labels, mask)`: images `[S or padded, ...]` (static first
      dimension when S is given), labels of the same length, mask float32 with
      1.0 on real examples and 0.0 on padding.

    Raises:
      ValueError: if static_batch_size < 1 or multiple < 1.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}.")
    size = tf.shape(labels)[0]
    if static_batch_size is not None:
        if static_batch_size < 1:
            raise ValueError(f"static_batch_size must be >= 1, got {static_batch_size}.")
        target = tf.constant(int(static_batch_size), tf.int32)
        kept = tf.minimum(size, target)
        images, labels = images[:kept], labels[:kept]
    else:
        target = tf.maximum(1, (size + multiple - 1) // multiple) * multiple
        kept = size
    pad = target - kept
    inner = images.shape[1:]
    mask = tf.concat([tf.ones([kept], tf.float32), tf.zeros([pad], tf.float32)], 0)
    no_padding = tf.zeros([tf.rank(images) - 1, 2], tf.int32)
    images = tf.pad(images, tf.concat([[[0, pad]], no_padding], 0))
    labels = tf.pad(labels, [[0, pad]])
    # tf.pad with a tensor `pad` forgets every static dimension; restore them.
    images = tf.ensure_shape(images, [static_batch_size, *inner])
    labels = tf.ensure_shape(labels, [static_batch_size])
    mask = tf.ensure_shape(mask, [static_batch_size])
    return images, labels, mask


def pad_batches(dataset, *, static_batch_size=None, multiple=1):
    """Maps `pad_batch` over a dataset of `(images, labels)` batches.

    Args:
      dataset: `tf.data.Dataset` of `(images [batch, ...], labels [batch])`,
        the batch size may vary (Poisson sampling).
      static_batch_size: None or the static size (see `pad_batch`).
      multiple: see `pad_batch`.

    Returns:
      `tf.data.Dataset` of `(images, labels, mask float32)` in the same order.

    Raises:
      ValueError: as `pad_batch`.
    """
    if static_batch_size is not None and static_batch_size < 1:
        raise ValueError(f"static_batch_size must be >= 1, got {static_batch_size}.")
    return dataset.map(
        lambda images, labels: pad_batch(
            images, labels, static_batch_size=static_batch_size, multiple=multiple),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )


def _round_up(value, multiple):
    return -(-int(value) // multiple) * multiple


def _check(num_examples, sampling_prob, num_steps):
    if int(num_examples) < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}.")
    if not 0.0 < sampling_prob <= 1.0:
        raise ValueError(f"sampling_prob must be in (0, 1], got {sampling_prob}.")
    if int(num_steps) < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}.")
