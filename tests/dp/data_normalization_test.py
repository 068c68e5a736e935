"""Tests for private data normalization (Tramer & Boneh 2021, App. B, Algorithm 2)."""

import dp_accounting
import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

from tfdp.accounting import data_normalization_dp_event
from tfdp.dp import precision
from tfdp.dp.data_normalization import (
    clipped_channel_sums,
    private_channel_mean_and_var,
)


def _hand_built_features():
    """[N=2, h=1, w=2, K=2] features with the per-example statistics spelled out.

    example 0: positions (3, 4) and (3, 4) -> channel means (3, 4), norm 5;
               mean squares (9, 16), norm sqrt(337) = 18.36.
    example 1: positions (0, 2) and (0, 0) -> channel means (0, 1), norm 1;
               mean squares (0, 2), norm 2.
    """
    return np.array(
        [[[[3.0, 4.0], [3.0, 4.0]]], [[[0.0, 2.0], [0.0, 0.0]]]], np.float32
    )


def test_sigma_zero_gives_the_exact_clipped_statistics():
    features = _hand_built_features()
    mean, var = private_channel_mean_and_var(
        features,
        l2_clip_norm_mean=1.0,
        l2_clip_norm_square=4.0,
        noise_multiplier=0.0,
        threshold=0.0,
        seed=0,
    )
    # Means: (3, 4) clipped to norm 1 -> (0.6, 0.8); (0, 1) unchanged.
    #   mean = ((0.6, 0.8) + (0, 1)) / 2 = (0.3, 0.9).
    # Mean squares: (9, 16) clipped to norm 4 -> 4/sqrt(337) * (9, 16); (0, 2) unchanged.
    #   mean_square = (36/sqrt(337), 64/sqrt(337) + 2) / 2.
    #   var = mean_square - mean^2.
    # Clipped as the DP-SGD step clips: to C / (1 + kappa), so (0, 1), of norm
    # exactly C = 1, is scaled down too.
    shrink = 1.0 / (1 + precision.clip_margin())
    expected_mean = np.array([0.3, 0.9]) * shrink
    root = np.sqrt(337.0)
    expected_square = np.array([36.0 / root * shrink, 64.0 / root * shrink + 2.0]) / 2.0
    np.testing.assert_allclose(mean.numpy(), expected_mean, rtol=1e-6)
    np.testing.assert_allclose(var.numpy(), expected_square - expected_mean**2, rtol=1e-5)


def test_large_clip_norms_give_the_plain_statistics_and_threshold_bounds_var():
    features = _hand_built_features()
    mean, var = private_channel_mean_and_var(
        features,
        l2_clip_norm_mean=100.0,
        l2_clip_norm_square=100.0,
        noise_multiplier=0.0,
        threshold=0.0,
        seed=0,
    )
    per_example_means = features.mean(axis=(1, 2))  # (3, 4), (0, 1)
    per_example_squares = (features**2).mean(axis=(1, 2))  # (9, 16), (0, 2)
    np.testing.assert_allclose(mean.numpy(), per_example_means.mean(0))  # (1.5, 2.5)
    # var = (4.5, 9) - (2.25, 6.25) = (2.25, 2.75).
    np.testing.assert_allclose(var.numpy(), [2.25, 2.75], rtol=1e-6)
    _, var = private_channel_mean_and_var(
        features,
        l2_clip_norm_mean=100.0,
        l2_clip_norm_square=100.0,
        noise_multiplier=0.0,
        threshold=2.5,
        seed=0,
    )
    np.testing.assert_allclose(var.numpy(), [2.5, 2.75])  # max(var, tau)


def test_each_example_contributes_at_most_the_clip_norm():
    rng = np.random.default_rng(0)
    features = rng.normal(0.0, 50.0, size=(64, 3, 3, 8)).astype(np.float32)
    features[7] *= 1000.0  # one outlier example
    sum_mean, sum_square = clipped_channel_sums(
        features, l2_clip_norm_mean=0.5, l2_clip_norm_square=2.0
    )
    assert np.linalg.norm(sum_mean) <= 64 * 0.5 + 1e-4
    assert np.linalg.norm(sum_square) <= 64 * 2.0 + 1e-3
    # Removing any one example moves each sum by at most its clip norm: the
    # sensitivity that the Gaussian mechanism's noise is calibrated to.
    without = np.delete(features, 7, axis=0)
    sum_mean_7, sum_square_7 = clipped_channel_sums(
        without, l2_clip_norm_mean=0.5, l2_clip_norm_square=2.0
    )
    assert np.linalg.norm(sum_mean - sum_mean_7) <= 0.5 + 1e-5
    assert np.linalg.norm(sum_square - sum_square_7) <= 2.0 + 1e-4


def test_an_overflowing_feature_drops_its_statistic_instead_of_poisoning_the_sums():
    # With tf.clip_by_norm, one feature of 3e38 (its square is inf) would make
    # the released sums NaN, which shows that the example is in the data.
    rng = np.random.default_rng(0)
    features = rng.normal(0.0, 1.0, size=(8, 2, 2, 3)).astype(np.float32)
    clean_mean, clean_square = clipped_channel_sums(
        np.delete(features, 3, axis=0), l2_clip_norm_mean=0.5, l2_clip_norm_square=2.0)
    features[3, 0, 0, 1] = 3e38
    sum_mean, sum_square = clipped_channel_sums(features, l2_clip_norm_mean=0.5,
                                                l2_clip_norm_square=2.0)
    assert np.all(np.isfinite(sum_mean)) and np.all(np.isfinite(sum_square))
    np.testing.assert_allclose(sum_square, clean_square, rtol=1e-6)  # dropped: inf statistic
    assert np.linalg.norm(sum_mean - clean_mean) <= 0.5  # its finite mean is clipped, kept


def test_noise_has_std_sigma_times_clip_norm_over_n():
    # K = 4000 channels, one example with all-zero features: the released
    # mean is pure noise N(0, (sigma * C1 / N)^2) per channel.
    features = np.zeros((1, 1, 1, 4000), np.float32)
    sigma, c1, c2 = 3.0, 0.5, 2.0
    mean, var = private_channel_mean_and_var(
        features,
        l2_clip_norm_mean=c1,
        l2_clip_norm_square=c2,
        noise_multiplier=sigma,
        threshold=0.0,
        seed=1,
    )
    standardized = mean.numpy() / (sigma * c1)
    assert scipy.stats.kstest(standardized, "norm").pvalue > 1e-3
    # The test can tell the intended std from 2/3 and 3/2 of it.
    assert scipy.stats.kstest(standardized / 1.5, "norm").pvalue < 1e-6
    assert scipy.stats.kstest(standardized / (2 / 3), "norm").pvalue < 1e-6
    # The two mechanisms use independent noise.
    assert abs(np.corrcoef(mean.numpy(), var.numpy())[0, 1]) < 0.1


def test_seed_makes_noise_reproducible_and_none_does_not():
    features = np.random.default_rng(2).normal(size=(10, 2, 2, 5)).astype(np.float32)
    kwargs = dict(
        l2_clip_norm_mean=1.0, l2_clip_norm_square=1.0, noise_multiplier=1.0, threshold=1e-3
    )
    first = private_channel_mean_and_var(features, seed=5, **kwargs)
    second = private_channel_mean_and_var(features, seed=5, **kwargs)
    np.testing.assert_array_equal(first[0].numpy(), second[0].numpy())
    unseeded = [private_channel_mean_and_var(features, **kwargs)[0].numpy() for _ in range(2)]
    assert not np.array_equal(unseeded[0], unseeded[1])
    from_generator = [
        private_channel_mean_and_var(
            features, generator=tf.random.Generator.from_seed(7), **kwargs
        )[0].numpy()
        for _ in range(2)
    ]
    np.testing.assert_array_equal(from_generator[0], from_generator[1])
    with pytest.raises(ValueError, match="seed or generator, not both"):
        private_channel_mean_and_var(
            features, seed=1, generator=tf.random.Generator.from_seed(7), **kwargs
        )


def test_chunking_does_not_change_the_result():
    features = np.random.default_rng(3).normal(size=(10, 2, 2, 5)).astype(np.float32)
    kwargs = dict(
        l2_clip_norm_mean=0.3, l2_clip_norm_square=0.7, noise_multiplier=0.0, threshold=0.0
    )
    whole = private_channel_mean_and_var(features, chunk_size=1024, **kwargs)
    chunked = private_channel_mean_and_var(features, chunk_size=3, **kwargs)
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(l2_clip_norm_mean=0.0), "l2_clip_norm_mean=0.0 must be > 0"),
        (dict(l2_clip_norm_square=-1.0), "l2_clip_norm_square=-1.0 must be > 0"),
        (dict(noise_multiplier=-1.0), "noise_multiplier=-1.0 must be >= 0"),
        (dict(threshold=-0.5), "threshold=-0.5 must be >= 0"),
        (dict(chunk_size=0), "chunk_size=0"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    arguments = dict(
        l2_clip_norm_mean=1.0, l2_clip_norm_square=1.0, noise_multiplier=1.0, threshold=0.0
    )
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        private_channel_mean_and_var(np.zeros((2, 1, 1, 3), np.float32), **arguments)


def test_rejects_empty_and_rank_one_features():
    kwargs = dict(
        l2_clip_norm_mean=1.0, l2_clip_norm_square=1.0, noise_multiplier=1.0, threshold=0.0
    )
    with pytest.raises(ValueError, match="no examples"):
        private_channel_mean_and_var(np.zeros((0, 1, 1, 3), np.float32), **kwargs)
    with pytest.raises(ValueError, match="rank >= 2"):
        private_channel_mean_and_var(np.zeros((4,), np.float32), **kwargs)


def test_dp_event_is_two_gaussians_as_in_claim_b5():
    # Claim B.5: (alpha, alpha / sigma^2)-RDP. Two Gaussian mechanisms with noise
    # multiplier sigma compose to exactly the RDP curve of one with sigma / sqrt(2)
    # (alpha / (2 sigma^2) each).
    sigma, delta = 8.0, 1e-5
    event = data_normalization_dp_event(sigma)
    assert event == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), 2)
    orders = [1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    composed = dp_accounting.rdp.RdpAccountant(orders).compose(event)
    single = dp_accounting.rdp.RdpAccountant(orders).compose(
        dp_accounting.GaussianDpEvent(sigma / np.sqrt(2.0))
    )
    assert composed.get_epsilon(delta) == pytest.approx(single.get_epsilon(delta), rel=1e-9)
    with pytest.raises(ValueError, match="not private"):
        data_normalization_dp_event(0.0)
