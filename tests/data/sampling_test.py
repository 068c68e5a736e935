"""Tests for tfdp.data.sampling: the Poisson and shuffle samplers over indices.

The Poisson sampler must be what the accountant assumes: at every step, every
example is included independently with probability q. Checked statistically:
each example's inclusion frequency, independence between pairs of examples
(with a fixed-size sampler as the negative control the test must reject), the
Binomial(N, q) law of the batch size, and its cost (never O(N)).
"""

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

from tfdp.data import sampling


def _poisson(num_examples, q, num_steps, seed=0, first_step=0):
    return [sampling.poisson_indices(seed, t, num_examples=num_examples, sampling_prob=q)
            for t in range(first_step, first_step + num_steps)]


def _inclusion_matrix(batches, num_examples):
    """bool [T, N]: X[t, i] = example i is in the batch of step t."""
    x = np.zeros([len(batches), num_examples], bool)
    for t, batch in enumerate(batches):
        x[t, batch] = True
    return x


def _pairwise_chi2_pvalue(x):
    """p-value of 'all pairs of columns of X are uncorrelated'.

    Under independence each sample correlation r_ij of two columns is about
    N(0, 1/T), so T * sum_{i<j} r_ij^2 is about chi2 with N(N-1)/2 degrees of
    freedom.
    """
    num_steps, num_examples = x.shape
    r = np.corrcoef(x.T.astype(np.float64))
    upper = r[np.triu_indices(num_examples, k=1)]
    return scipy.stats.chi2.sf(num_steps * np.sum(upper**2), df=upper.size)


# --- Poisson: the law ---------------------------------------------------------


def test_poisson_indices_are_sorted_distinct_int64_in_range():
    for batch in _poisson(1000, 0.3, 20, seed=3):
        assert batch.dtype == np.int64
        assert np.all(np.diff(batch) > 0)
        assert batch.min() >= 0 and batch.max() < 1000


def test_poisson_every_example_is_included_with_probability_q():
    # N = 1000, q = 0.05, T = 1000: each example's count c_i ~ Binomial(1000, 0.05),
    # mean 50, variance 47.5. Under the right q, sum (c_i - 50)^2 / 47.5 ~ chi2(1000).
    num_examples, q, num_steps = 1000, 0.05, 1000
    counts = _inclusion_matrix(_poisson(num_examples, q, num_steps, seed=7),
                               num_examples).sum(axis=0)

    def pvalue(p):
        mean, var = num_steps * p, num_steps * p * (1 - p)
        return scipy.stats.chi2.sf(np.sum((counts - mean) ** 2 / var), df=num_examples)

    assert pvalue(q) > 1e-3
    # The test has power: it rejects an inclusion probability 10% off.
    assert pvalue(q * 1.1) < 1e-6 and pvalue(q / 1.1) < 1e-6
    # No example is left out: P(c_i = 0) = 0.95**1000 = 5e-23.
    assert counts.min() > 0
    # Nor favoured by its position: first, middle and last examples alike.
    assert scipy.stats.chisquare(counts).pvalue > 1e-3


def test_poisson_inclusions_are_pairwise_independent():
    # N = 40, q = 0.3, T = 3000 steps: every pair (i, j) of the 780, adjacent
    # ones included (where a skip-based sampler would go wrong), is uncorrelated.
    num_examples, q, num_steps = 40, 0.3, 3000
    x = _inclusion_matrix(_poisson(num_examples, q, num_steps, seed=11), num_examples)
    assert _pairwise_chi2_pvalue(x) > 1e-3
    # Joint inclusion of neighbours: P(i and i + 1) = q^2 = 0.09, over 39 * 3000 trials.
    both = np.sum(x[:, :-1] & x[:, 1:])
    trials = (num_examples - 1) * num_steps
    assert abs(both - trials * q * q) < 5 * np.sqrt(trials * q * q * (1 - q * q))


def test_pairwise_test_rejects_fixed_size_sampling_without_replacement():
    # Negative control: a uniform sample of exactly q * N examples (no Poisson
    # variation) makes inclusions negatively correlated (-1 / (N - 1) per pair).
    num_examples, q, num_steps = 40, 0.3, 3000
    rng = np.random.default_rng(0)
    fixed = [rng.choice(num_examples, size=int(q * num_examples), replace=False)
             for _ in range(num_steps)]
    assert _pairwise_chi2_pvalue(_inclusion_matrix(fixed, num_examples)) < 1e-6


@pytest.mark.parametrize("num_examples, batch_size, num_steps", [
    (200, 30, 3000),           # small N, q = 0.15
    (1271167, 16384, 300),     # imagenet.gin: q = 0.0129
])
def test_poisson_batch_size_is_binomial(num_examples, batch_size, num_steps):
    q = batch_size / num_examples
    sizes = np.array([len(b) for b in _poisson(num_examples, q, num_steps, seed=5)])
    binomial = scipy.stats.binom(num_examples, q)
    # Chi-square goodness of fit; bins (e_(k-1), e_k] at quantiles of the
    # binomial, about 10 expected counts each.
    edges = np.unique(binomial.ppf(np.linspace(0, 1, num_steps // 10 + 1)[1:-1]))
    observed = np.bincount(np.searchsorted(edges, sizes, side="left"), minlength=len(edges) + 1)
    expected = np.diff(binomial.cdf(np.concatenate([[-1], edges, [num_examples]]))) * num_steps
    assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3
    # Variance N q (1 - q), not 0 (a fixed-size sampler), within 2/3 .. 3/2.
    assert 2 / 3 < sizes.var() / binomial.var() < 3 / 2


def test_poisson_cost_does_not_grow_with_num_examples():
    # N = 10**15 examples, q = 10**-12: about 1000 indices. An O(N) sampler
    # (one coin per example) could not run at all.
    batch = sampling.poisson_indices(1, 0, num_examples=10**15, sampling_prob=1e-12)
    assert 800 < len(batch) < 1200
    assert np.all(np.diff(batch) > 0) and batch[-1] < 10**15


def test_poisson_sampling_prob_one_takes_every_example():
    for batch in _poisson(7, 1.0, 3):
        np.testing.assert_array_equal(batch, np.arange(7))


def test_poisson_small_q_gives_empty_batches():
    sizes = [len(b) for b in _poisson(10, 0.01, 200)]
    assert 0 in sizes and max(sizes) <= 10


# --- Poisson: a pure function of (seed, step) ---------------------------------


def test_poisson_is_a_pure_function_of_seed_and_step():
    a = _poisson(500, 0.1, 10, seed=2**63 - 1)
    b = _poisson(500, 0.1, 10, seed=2**63 - 1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    other_seed = _poisson(500, 0.1, 10, seed=2**63 - 2)
    assert any(len(x) != len(y) or np.any(x != y) for x, y in zip(a, other_seed))
    assert any(len(x) != len(y) or np.any(x != y) for x, y in zip(a[:-1], a[1:]))


@pytest.mark.parametrize("seed", [-1, 2**63, 1.0, True, "1"])
def test_bad_seed_is_rejected_without_showing_it(seed):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)") as error:
        sampling.poisson_indices(seed, 0, num_examples=10, sampling_prob=0.5)
    assert str(seed) not in str(error.value).replace("2**63", "")


@pytest.mark.parametrize("sampling_prob", [0.0, -0.1, 1.5])
def test_poisson_rejects_bad_sampling_prob(sampling_prob):
    with pytest.raises(ValueError, match=r"sampling_prob must be in \(0, 1\]"):
        sampling.poisson_indices(0, 0, num_examples=10, sampling_prob=sampling_prob)


# --- Shuffle ------------------------------------------------------------------


def _shuffled(num_examples, batch_size, num_steps, seed):
    return [sampling.shuffled_indices(seed, t, num_examples=num_examples, batch_size=batch_size)
            for t in range(num_steps)]


def test_shuffle_epochs_cover_every_example_exactly_once():
    # N = 12, B = 4: 3 steps per epoch; 9 steps = 3 epochs.
    batches = _shuffled(12, 4, 9, seed=1)
    assert [len(b) for b in batches] == [4] * 9
    epochs = [np.concatenate(batches[e * 3:(e + 1) * 3]) for e in range(3)]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(12))
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh permutation each epoch


def test_shuffle_drops_a_different_remainder_each_epoch():
    # N = 10, B = 4: 2 steps per epoch use 8 distinct examples; 2 are dropped.
    batches = _shuffled(10, 4, 40, seed=2)
    dropped = []
    for e in range(20):
        epoch = np.concatenate(batches[2 * e:2 * e + 2])
        assert len(np.unique(epoch)) == 8
        dropped.extend(np.setdiff1d(np.arange(10), epoch))
    assert len(set(dropped)) > 2  # not always the same 2 examples


def test_shuffle_rejects_batch_size_above_num_examples():
    with pytest.raises(ValueError, match=r"batch_size must be an int in \[1, num_examples=10\]"):
        sampling.shuffled_indices(0, 0, num_examples=10, batch_size=11)


# --- The index stream in tf.data ----------------------------------------------


def _stream(**kwargs):
    args = dict(sampling="poisson", num_examples=200, batch_size=20, num_steps=20, seed=5)
    return list(sampling.index_batches(**{**args, **kwargs}).as_numpy_iterator())


def test_index_batches_are_the_sampler_in_step_order():
    ds = sampling.index_batches(sampling="poisson", num_examples=200, batch_size=20,
                                num_steps=20, seed=5)
    assert ds.element_spec == tf.TensorSpec([None], tf.int64)
    for t, batch in enumerate(ds.as_numpy_iterator()):
        np.testing.assert_array_equal(
            batch, sampling.poisson_indices(5, t, num_examples=200, sampling_prob=0.1))
    shuffled = _stream(sampling="shuffle", num_steps=6, start_step=2)
    for t, batch in enumerate(shuffled, start=2):
        np.testing.assert_array_equal(
            batch, sampling.shuffled_indices(5, t, num_examples=200, batch_size=20))


def test_index_batches_resumed_run_sees_the_suffix_of_the_uninterrupted_run():
    full, resumed = _stream(), _stream(start_step=13)
    assert len(resumed) == 7
    for x, y in zip(resumed, full[13:]):
        np.testing.assert_array_equal(x, y)
    assert _stream(start_step=20) == []


def test_the_seed_is_not_in_the_tf_data_graph():
    seed = 7_355_608_123_456_789_011
    ds = sampling.index_batches(sampling="poisson", num_examples=100, batch_size=10,
                                num_steps=3, seed=seed)
    graph = ds._as_serialized_graph().numpy()  # pylint: disable=protected-access
    for encoding in (str(seed).encode(), seed.to_bytes(8, "little"), seed.to_bytes(8, "big")):
        assert encoding not in graph


@pytest.mark.parametrize("num_steps, start_step, match", [
    (-1, 0, "num_steps must be a non-negative int"),
    (5, 6, r"start_step must be an int in \[0, num_steps=5\]"),
    (5, -1, r"start_step must be an int in \[0, num_steps=5\]"),
])
def test_index_batches_reject_bad_steps(num_steps, start_step, match):
    with pytest.raises(ValueError, match=match):
        _stream(num_steps=num_steps, start_step=start_step)


def test_index_batches_errors():
    with pytest.raises(ValueError, match=r"Unknown sampling scheme 'uniform'; use one of "
                                         r"\('poisson', 'shuffle'\)"):
        _stream(sampling="uniform")
    with pytest.raises(ValueError, match=r"batch_size must be an int in \[1, num_examples=200\]"):
        _stream(batch_size=201)
