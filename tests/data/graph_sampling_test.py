"""Tests for tfdp.data.graph_sampling: the Poisson sampler in TensorFlow ops.

It must be the mechanism the accountant assumes, as `poisson_indices` is:
every example in every step independently with probability q' <= q (q' within
2**-64 of q). Checked with the statistics of tests/data/sampling_test.py, each
with a negative control the test must reject: each example's inclusion
frequency, the Binomial(N, q) law of the batch size (also at imagenet.gin's
N), independence across examples and across steps, and resume.
"""

import fractions

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

from tfdp.data import graph_sampling
from tfdp.data import sampling
from tfdp import graph_checks


def _poisson(num_examples, q, num_steps, seed=0, first_step=0):
    # One traced function per (N, q); the steps are a loop over a tensor argument.
    fn = tf.function(lambda s, t: graph_sampling.poisson_indices_in_graph(
        s, t, num_examples=num_examples, sampling_prob=q))
    seed = tf.constant(seed, tf.int64)
    return [fn(seed, tf.constant(t, tf.int64)).numpy()
            for t in range(first_step, first_step + num_steps)]


def _inclusion_matrix(batches, num_examples):
    x = np.zeros([len(batches), num_examples], bool)
    for t, batch in enumerate(batches):
        x[t, batch] = True
    return x


def _pairwise_chi2_pvalue(x):
    """p-value of 'all pairs of columns of X [T, N] are uncorrelated' (T sum r_ij^2 ~ chi2)."""
    num_rows, num_columns = x.shape
    r = np.corrcoef(x.T.astype(np.float64))
    upper = r[np.triu_indices(num_columns, k=1)]
    return scipy.stats.chi2.sf(num_rows * np.sum(upper**2), df=upper.size)


# --- The inclusion probability: exact arithmetic ------------------------------


@pytest.mark.parametrize("batch_size, num_examples", [
    (16384, 1271167), (2048, 60000), (1, 3), (2, 3), (999_999, 1_000_000), (1, 10**15)])
def test_the_inclusion_probability_is_q_rounded_down_to_2_pow_minus_64(batch_size, num_examples):
    q = batch_size / num_examples
    exact = fractions.Fraction(q)  # the float the accountant reads, exactly
    q_prime = graph_sampling.inclusion_probability(q)
    # Never above q (a larger q would need a larger epsilon), and within 2**-64 below it.
    assert exact - fractions.Fraction(1, 2**64) < q_prime <= exact
    assert q_prime.denominator <= 2**64


def test_the_threshold_refuses_q_outside_0_1():
    for q in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"sampling_prob must be in \(0, 1\)"):
            graph_sampling.inclusion_threshold(q)
    assert graph_sampling.inclusion_probability(1.0) == 1


# --- The law ------------------------------------------------------------------


def test_indices_are_sorted_distinct_int64_in_range():
    for batch in _poisson(1000, 0.3, 20, seed=3):
        assert batch.dtype == np.int64
        assert np.all(np.diff(batch) > 0)
        assert batch.min() >= 0 and batch.max() < 1000


def test_every_example_is_included_with_probability_q():
    # N = 1000, q = 0.05, T = 1000: c_i ~ Binomial(1000, 0.05), mean 50, variance 47.5;
    # sum (c_i - 50)^2 / 47.5 ~ chi2(1000) under the right q.
    num_examples, q, num_steps = 1000, 0.05, 1000
    counts = _inclusion_matrix(_poisson(num_examples, q, num_steps, seed=7),
                               num_examples).sum(axis=0)

    def pvalue(p):
        mean, var = num_steps * p, num_steps * p * (1 - p)
        return scipy.stats.chi2.sf(np.sum((counts - mean) ** 2 / var), df=num_examples)

    assert pvalue(q) > 1e-3
    assert pvalue(q * 1.1) < 1e-6 and pvalue(q / 1.1) < 1e-6  # the test has power
    assert counts.min() > 0
    assert scipy.stats.chisquare(counts).pvalue > 1e-3  # no position favoured


def test_inclusions_are_independent_across_examples():
    # N = 40, q = 0.3, T = 3000: all 780 pairs of examples uncorrelated, neighbours too.
    num_examples, q, num_steps = 40, 0.3, 3000
    x = _inclusion_matrix(_poisson(num_examples, q, num_steps, seed=11), num_examples)
    assert _pairwise_chi2_pvalue(x) > 1e-3
    both = np.sum(x[:, :-1] & x[:, 1:])
    trials = (num_examples - 1) * num_steps
    assert abs(both - trials * q * q) < 5 * np.sqrt(trials * q * q * (1 - q * q))
    # Negative control: a fixed-size uniform sample (no Poisson variation) is rejected.
    rng = np.random.default_rng(0)
    fixed = [rng.choice(num_examples, size=12, replace=False) for _ in range(num_steps)]
    assert _pairwise_chi2_pvalue(_inclusion_matrix(fixed, num_examples)) < 1e-6


def test_inclusions_are_independent_across_steps():
    # T = 40 steps, N = 3000 examples: every pair of steps (780) is uncorrelated over the
    # examples, consecutive ones included.
    num_examples, q, num_steps = 3000, 0.3, 40
    x = _inclusion_matrix(_poisson(num_examples, q, num_steps, seed=13), num_examples)
    assert _pairwise_chi2_pvalue(x.T) > 1e-3
    # Negative control: steps that share their coins in pairs (keyed by step // 2).
    paired = _poisson(num_examples, q, num_steps // 2, seed=13)
    shared = _inclusion_matrix([paired[t // 2] for t in range(num_steps)], num_examples)
    assert _pairwise_chi2_pvalue(shared.T) < 1e-6


@pytest.mark.parametrize("num_examples, batch_size, num_steps", [
    (200, 30, 3000),           # small N, q = 0.15
    pytest.param(1271167, 16384, 300, marks=pytest.mark.slow),  # imagenet.gin: q = 0.0129
])
def test_batch_size_is_binomial(num_examples, batch_size, num_steps):
    q = batch_size / num_examples
    sizes = np.array([len(b) for b in _poisson(num_examples, q, num_steps, seed=5)])
    binomial = scipy.stats.binom(num_examples, q)
    edges = np.unique(binomial.ppf(np.linspace(0, 1, num_steps // 10 + 1)[1:-1]))
    observed = np.bincount(np.searchsorted(edges, sizes, side="left"), minlength=len(edges) + 1)
    expected = np.diff(binomial.cdf(np.concatenate([[-1], edges, [num_examples]]))) * num_steps
    assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3
    assert 2 / 3 < sizes.var() / binomial.var() < 3 / 2
    # Power: the same sizes do not fit Binomial(N, 1.05 q).
    wrong = scipy.stats.binom(num_examples, 1.05 * q)
    wrong_expected = np.diff(wrong.cdf(np.concatenate([[-1], edges, [num_examples]]))) * num_steps
    assert scipy.stats.chisquare(observed, wrong_expected).pvalue < 1e-6


def test_sampling_prob_one_takes_every_example_and_small_q_empty_batches():
    for batch in _poisson(7, 1.0, 3):
        np.testing.assert_array_equal(batch, np.arange(7))
    sizes = [len(b) for b in _poisson(10, 0.01, 200)]
    assert 0 in sizes and max(sizes) <= 10


# --- A pure function of (seed, step); the stream in tf.data -------------------


def test_a_pure_function_of_seed_and_step_unlike_the_numpy_stream():
    a = _poisson(500, 0.1, 10, seed=2**63 - 1)
    b = _poisson(500, 0.1, 10, seed=2**63 - 1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    other_seed = _poisson(500, 0.1, 10, seed=2**63 - 2)
    assert any(len(x) != len(y) or np.any(x != y) for x, y in zip(a, other_seed))
    # Another generator than tfdp.data.poisson_indices: the same law, another stream.
    numpy_stream = [sampling.poisson_indices(2**63 - 1, t, num_examples=500, sampling_prob=0.1)
                    for t in range(10)]
    assert any(len(x) != len(y) or np.any(x != y) for x, y in zip(a, numpy_stream))


def _stream(**kwargs):
    args = dict(sampling="poisson", num_examples=200, batch_size=20, num_steps=20, seed=5)
    return list(graph_sampling.index_batches_in_graph(**{**args, **kwargs}).as_numpy_iterator())


def test_the_stream_is_the_sampler_in_step_order_and_resumes_with_its_suffix():
    full = _stream()
    assert len(full) == 20
    for t, batch in enumerate(full):
        np.testing.assert_array_equal(batch, graph_sampling.numpy_reference(
            5, t, num_examples=200, sampling_prob=0.1))
    resumed = _stream(start_step=13)
    assert len(resumed) == 7
    for x, y in zip(resumed, full[13:]):
        np.testing.assert_array_equal(x, y)
    assert _stream(start_step=20) == []


def test_shuffled_epochs_cover_every_example_exactly_once():
    # N = 12, B = 4: 3 steps per epoch; 9 steps = 3 epochs.
    batches = _stream(sampling="shuffle", num_examples=12, batch_size=4, num_steps=9, seed=1)
    assert [len(b) for b in batches] == [4] * 9
    epochs = [np.concatenate(batches[e * 3:(e + 1) * 3]) for e in range(3)]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(12))
    assert not np.array_equal(epochs[0], epochs[1])
    resumed = _stream(sampling="shuffle", num_examples=12, batch_size=4, num_steps=9, seed=1,
                      start_step=4)
    for x, y in zip(resumed, batches[4:]):
        np.testing.assert_array_equal(x, y)


def test_the_seed_is_not_in_the_graph_and_the_graph_calls_no_python():
    seed = 7_355_608_123_456_789_011
    ds = graph_sampling.index_batches_in_graph(sampling="poisson", num_examples=100,
                                               batch_size=10, num_steps=3, seed=seed)
    graph = ds._as_serialized_graph().numpy()  # pylint: disable=protected-access
    for encoding in (str(seed).encode(), seed.to_bytes(8, "little"), seed.to_bytes(8, "big")):
        assert encoding not in graph
    graph_def = tf.compat.v1.GraphDef.FromString(graph)
    nodes = graph_checks.graph_nodes(graph_def)
    assert any(n.op == "StatelessRandomUniformFullIntV2" for n in nodes)
    assert graph_checks.host_callbacks(nodes) == []
    # Negative control: the numpy stream's graph is seen to call Python.
    numpy_ds = sampling.index_batches(sampling="poisson", num_examples=100, batch_size=10,
                                      num_steps=3, seed=seed)
    numpy_graph = tf.compat.v1.GraphDef.FromString(
        numpy_ds._as_serialized_graph().numpy())  # pylint: disable=protected-access
    assert graph_checks.host_callbacks(graph_checks.graph_nodes(numpy_graph))


@pytest.mark.parametrize("seed", [-1, 2**63, 1.0, True, "1"])
def test_a_bad_seed_is_rejected_without_showing_it(seed):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)") as error:
        _stream(seed=seed)
    assert str(seed) not in str(error.value).replace("2**63", "")


def test_stream_errors():
    with pytest.raises(ValueError, match=r"Unknown sampling scheme 'uniform'"):
        _stream(sampling="uniform")
    with pytest.raises(ValueError, match=r"batch_size must be an int in \[1, num_examples=200\]"):
        _stream(batch_size=201)
    with pytest.raises(ValueError, match=r"start_step must be an int in \[0, num_steps=20\]"):
        _stream(start_step=21)
    with pytest.raises(ValueError, match=r"sampling_prob must be in \(0, 1\]"):
        graph_sampling.poisson_indices_in_graph(0, 0, num_examples=10, sampling_prob=1.5)


def test_doctests_pass():
    import doctest  # pylint: disable=g-import-not-at-top

    failed, attempted = doctest.testmod(graph_sampling, verbose=False)
    assert failed == 0 and attempted >= 2
