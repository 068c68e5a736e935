"""Private per-channel feature normalization (Tramer & Boneh 2021, App. B).

Tramer & Boneh normalize ScatterNet features by their per-channel mean and
variance over the training set. Those statistics are released with two
Gaussian mechanisms (Algorithm 2, PrivChannelMean / PrivDataNorm):

  1. mu_i = mean over the spatial positions of example i's features, a
     vector of K channel means; clip it to L2 norm C1; sum over examples;
     add N(0, (sigma_norm * C1)^2 I); divide by N.
  2. The same on the squared features with clip norm C2 gives the mean
     square m2.
  3. var = max(m2 - mu^2, tau).

Privacy (Claim B.5): adding or removing one example changes each clipped sum
by at most C1 (resp. C2) in L2 norm, so each release is a Gaussian mechanism
with noise multiplier sigma_norm, which is (alpha, alpha / (2 sigma_norm^2))-RDP;
the two together are (alpha, alpha / sigma_norm^2)-RDP. The trainer must add
them to the run's accounting by composing `data_normalization_dp_event`
(two `dp_accounting.GaussianDpEvent(sigma_norm)`, see
`tfdp.accounting.data_normalization_dp_event`) with the DP-SGD event
(Lemma B.3). The number of examples N is treated as public, as in the paper.
"""

import tensorflow as tf

from tfdp.dp import clipping
from tfdp.dp import seeds


def _check_positive(name, value):
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0 (an L2 clipping norm).")


def clipped_channel_sums(features, *, l2_clip_norm_mean, l2_clip_norm_square):
    """Returns the sums over examples of the clipped per-channel statistics.

    Steps 1-2 of Tramer & Boneh 2021, App. B, Algorithm 2, before the noise:
    for each example, the vector of its K per-channel means (over all axes
    between the first and the last) is clipped to L2 norm `l2_clip_norm_mean`,
    and the vector of its per-channel mean squares to `l2_clip_norm_square`;
    then both are summed over examples. The sums are additive, so they can be
    computed chunk by chunk.

    Args:
      features: float32 [num_examples, ..., K], e.g. ScatterNet features
        [num_examples, h, w, K]; rank >= 2.
      l2_clip_norm_mean: C1 > 0.
      l2_clip_norm_square: C2 > 0.

    Returns:
      (sum_mean, sum_square): float32 [K] each; each example contributes a
      vector of L2 norm at most C1 (resp. C2), clipped as the DP-SGD step
      clips (`tfdp.dp.clipping.clipped_sum`: to C / (1 + kappa)); an example
      with a non-finite statistic contributes nothing to that sum.

    Raises:
      ValueError: if a clipping norm is not positive or features has rank < 2.
    """
    _check_positive("l2_clip_norm_mean", l2_clip_norm_mean)
    _check_positive("l2_clip_norm_square", l2_clip_norm_square)
    features = tf.convert_to_tensor(features, tf.float32)
    if features.shape.rank is None or features.shape.rank < 2:
        raise ValueError(
            f"clipped_channel_sums: features of shape {features.shape} must be "
            "[num_examples, ..., channels] (rank >= 2)."
        )
    axes = list(range(1, features.shape.rank - 1))
    means = tf.reduce_mean(features, axis=axes) if axes else features
    squares = tf.reduce_mean(tf.square(features), axis=axes) if axes else tf.square(features)
    # The clip of the DP-SGD step (tfdp.dp.clipping): a norm that never under-counts, the clip
    # margin, and a non-finite row dropped (factor 0), so that one feature of 3e38 cannot make
    # the released sums NaN (tf.clip_by_norm did: the example's presence showed).
    (sum_mean,), _, _ = clipping.clipped_sum([means], l2_clip_norm_mean)
    (sum_square,), _, _ = clipping.clipped_sum([squares], l2_clip_norm_square)
    return sum_mean, sum_square


def private_channel_mean_and_var(
    features,
    *,
    l2_clip_norm_mean,
    l2_clip_norm_square,
    noise_multiplier,
    threshold,
    seed=None,
    generator=None,
    chunk_size=1024,
):
    """Releases per-channel mean and variance with DP (PrivDataNorm).

    Tramer & Boneh 2021, App. B, Algorithm 2: two Gaussian mechanisms on the
    clipped sums of `clipped_channel_sums`, each with noise std
    noise_multiplier * its clipping norm, divided by the (public) number of
    examples N; then var = max(mean_square - mean^2, threshold). Table 12 of
    the paper uses (C1, C2, noise_multiplier) = (0.2, 0.05, 6 or 8) for MNIST,
    (0.3, 0.15, ...) for Fashion-MNIST and (1.0, 1.5, ...) for CIFAR-10.

    Privacy cost: (alpha, alpha / noise_multiplier^2)-RDP for every alpha
    (Claim B.5), i.e. `data_normalization_dp_event(noise_multiplier)`, which
    the trainer must compose with the DP-SGD event. With noise_multiplier = 0
    the output is not private (only for tests and non-private baselines).

    Edge cases: noise_multiplier = 0 gives the exact clipped statistics;
    threshold = 0 allows a variance of 0 (then normalizing divides by zero
    unless the consumer guards it, as `keras.layers.Normalization` does).

    Args:
      features: float32 [num_examples, ..., K] (numpy or tensor), e.g.
        ScatterNet features [num_examples, h, w, K].
      l2_clip_norm_mean: C1 > 0, clipping norm of each example's channel means.
      l2_clip_norm_square: C2 > 0, clipping norm of each example's channel
        mean squares.
      noise_multiplier: sigma_norm >= 0, noise std divided by the clipping
        norm (dimensionless), the same for both mechanisms.
      threshold: tau >= 0, lower bound of the released variance.
      seed: None (default) draws the noise from a generator seeded from OS
        entropy (`tfdp.dp.seeds`).
        An int makes the noise reproducible: ONLY for tests, since anyone who
        knows the seed can subtract the noise.
      generator: optional `tf.random.Generator` to draw the noise from (as
        `tfdp.dp.noise.add_gaussian_noise` does); excludes `seed`.
      chunk_size: examples processed at once (bounds memory; the result does
        not depend on it apart from float rounding).

    Returns:
      (mean, var): float32 tensors [K]; var >= threshold.

    Raises:
      ValueError: if a clipping norm is not positive, noise_multiplier or
        threshold is negative, chunk_size < 1, both seed and generator are
        given, or features is empty or has rank < 2.

    >>> import numpy as np
    >>> x = np.array([[[3.0, 4.0]], [[0.0, 1.0]]], np.float32)  # [N=2, 1, K=2]
    >>> mean, var = private_channel_mean_and_var(
    ...     x, l2_clip_norm_mean=1.0, l2_clip_norm_square=100.0,
    ...     noise_multiplier=0.0, threshold=0.0)
    >>> # Means (3, 4) clip to (0.6, 0.8); (0, 1) stays: mean = (0.3, 0.9).
    >>> [round(float(v), 4) for v in mean]
    [0.3, 0.9]
    """
    _check_positive("l2_clip_norm_mean", l2_clip_norm_mean)
    _check_positive("l2_clip_norm_square", l2_clip_norm_square)
    if noise_multiplier < 0:
        raise ValueError(
            f"noise_multiplier={noise_multiplier!r} must be >= 0 (noise std / clip norm; "
            "Tramer & Boneh use 6 or 8)."
        )
    if threshold < 0:
        raise ValueError(f"threshold={threshold!r} must be >= 0 (lower bound of the variance).")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be >= 1.")
    if seed is not None and generator is not None:
        raise ValueError(
            "private_channel_mean_and_var: pass seed or generator, not both "
            "(or neither, to draw the noise from a non-deterministic source)."
        )
    num_examples = int(features.shape[0])
    if num_examples == 0:
        raise ValueError("private_channel_mean_and_var: features has no examples.")

    sum_mean, sum_square = None, None
    for start in range(0, num_examples, chunk_size):
        chunk_mean, chunk_square = clipped_channel_sums(
            features[start : start + chunk_size],
            l2_clip_norm_mean=l2_clip_norm_mean,
            l2_clip_norm_square=l2_clip_norm_square,
        )
        if sum_mean is None:
            sum_mean, sum_square = chunk_mean, chunk_square
        else:
            sum_mean, sum_square = sum_mean + chunk_mean, sum_square + chunk_square

    shape = tf.shape(sum_mean)
    if seed is None:
        if generator is None:
            generator = seeds.noise_generator()
        noise_mean = generator.normal(shape)
        noise_square = generator.normal(shape)
    else:
        pair = tf.random.experimental.stateless_split(
            tf.constant([int(seed), 0], tf.int64), num=2
        )
        noise_mean = tf.random.stateless_normal(shape, seed=pair[0])
        noise_square = tf.random.stateless_normal(shape, seed=pair[1])

    mean = (sum_mean + noise_multiplier * l2_clip_norm_mean * noise_mean) / num_examples
    mean_square = (
        sum_square + noise_multiplier * l2_clip_norm_square * noise_square
    ) / num_examples
    var = tf.maximum(mean_square - tf.square(mean), threshold)
    return mean, var


__all__ = [
    "clipped_channel_sums",
    "private_channel_mean_and_var",
]
