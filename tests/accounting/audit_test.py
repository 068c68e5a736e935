"""Tests of the one-run audit's bound, guesses and simulated mechanism (numpy only).

Soundness, power, planted bugs and the theory gap are checked here on the
exact law of Dirac canary scores (`simulate_gradient_canary_scores`); the
larger tables are in benchmarks/audit_simulations.py and docs/design/empirical_audit.md.
"""

import doctest

import numpy as np
import pytest
from scipy import optimize, special, stats

from tfdp.accounting import audit

DELTA = 1e-5
BETA = 0.05


def _plan(target_epsilon, sampling_prob, num_steps):
    return audit.simulated_mechanism(sampling_prob=sampling_prob, num_steps=num_steps,
                                     delta=DELTA, target_epsilon=target_epsilon)


def _audits(mechanism, num_canaries, repeats, seed, fractions, **bug):
    results = audit.simulate_audits(
        mechanism, num_canaries=num_canaries, repeats=repeats, rng=np.random.default_rng(seed),
        beta=BETA, guesses=audit.symmetric_guesses(num_canaries, fractions), **bug)
    return np.array([r.epsilon_lower_bound for r in results])


# -- The bound ----------------------------------------------------------------


def test_doctests_pass():
    # The module's doctests hold the paper's golden values (App. D, Sec. 7).
    failed, attempted = doctest.testmod(audit, verbose=False)
    assert attempted >= 5 and failed == 0


@pytest.mark.parametrize("m, r, v, delta, expected", [
    (100, 100, 75, 0.0, 0.702),      # App. D: all 100 canaries guessed, 75 right
    (100, 100, 75, 1e-4, 0.699),     # ... with delta = 1e-4
    (1000, 100, 75, 1e-4, 0.673),    # ... 900 abstentions: the delta term grows with m
    (100000, 1510, 1439, 1e-5, 2.675),  # Sec. 7 (Fig. 11), the paper's value truncated
])
def test_golden_values_of_the_paper(m, r, v, delta, expected):
    # The paper prints 3 decimals (0.67298 as 0.673, 2.67585 as 2.675).
    bound = audit.epsilon_lower_bound(m, r, v, delta=delta, beta=0.05)
    assert bound == pytest.approx(expected, abs=1e-3)


def _p_value_as_stated(m, r, v, eps, delta):
    """Corollary 5.4 literally: max over i = 1..m of (f(v - i) - f(v)) / i, f from tails."""
    q = special.expit(eps)

    def f(u):
        return 1.0 if u <= 0 else stats.binom.sf(u - 1, r, q)

    alpha = max((f(v - i) - f(v)) / i for i in range(1, m + 1))
    return min(1.0, f(v) + 2 * m * delta * alpha)


@pytest.mark.parametrize("m, r, v", [(30, 30, 22), (50, 20, 17), (40, 40, 40), (12, 6, 0)])
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.7])
@pytest.mark.parametrize("delta", [0.0, 1e-3, 0.05])
def test_p_value_equals_the_statement_computed_another_way(m, r, v, eps, delta):
    assert audit.p_value(m, r, v, eps, delta) == pytest.approx(
        _p_value_as_stated(m, r, v, eps, delta), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("r, v", [(100, 75), (1000, 620), (50, 50)])
def test_without_delta_the_bound_solves_the_binomial_tail_equation(r, v):
    # delta = 0: P[Binomial(r, e^eps / (1 + e^eps)) >= v] = beta, solved by a root finder.
    def excess(eps):
        return stats.binom.sf(v - 1, r, special.expit(eps)) - BETA

    root = optimize.brentq(excess, 0.0, 30.0, xtol=1e-12)
    bound = audit.epsilon_lower_bound(r, r, v, delta=0.0, beta=BETA)
    assert root - 2e-9 <= bound <= root


@pytest.mark.parametrize("m, r, v, delta", [(1000, 100, 75, 1e-4), (20000, 400, 390, 1e-5),
                                            (100000, 1510, 1439, 1e-5), (100, 100, 52, 1e-3)])
def test_p_value_grows_with_epsilon_so_bisection_finds_the_supremum(m, r, v, delta):
    values = [audit.p_value(m, r, v, eps, delta) for eps in np.linspace(0, 12, 400)]
    assert np.all(np.diff(values) >= -1e-12)


def test_bound_is_zero_without_evidence_and_grows_with_it():
    assert audit.epsilon_lower_bound(100, 0, 0, delta=DELTA, beta=BETA) == 0.0
    assert audit.epsilon_lower_bound(100, 100, 50, delta=DELTA, beta=BETA) == 0.0
    bounds = [audit.epsilon_lower_bound(1000, 200, v, delta=DELTA, beta=BETA)
              for v in (120, 150, 180, 200)]
    assert 0 < bounds[0] < bounds[1] < bounds[2] < bounds[3]
    # Less confidence, or a smaller delta, or fewer abstaining canaries: a larger bound.
    assert (audit.epsilon_lower_bound(1000, 200, 180, delta=DELTA, beta=0.01) < bounds[2]
            < audit.epsilon_lower_bound(1000, 200, 180, delta=DELTA, beta=0.2))
    assert (audit.epsilon_lower_bound(100000, 200, 180, delta=DELTA, beta=BETA) < bounds[2]
            < audit.epsilon_lower_bound(1000, 200, 180, delta=0.0, beta=BETA))


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_canaries=10, num_guesses=20, num_correct=5), "num_correct <= num_guesses"),
    (dict(num_canaries=10, num_guesses=5, num_correct=6), "num_correct <= num_guesses"),
    (dict(num_canaries=0, num_guesses=0, num_correct=0), "num_canaries must be an integer >= 1"),
    (dict(num_canaries=10, num_guesses=5.0, num_correct=2), "num_guesses must be an integer"),
    (dict(num_canaries=10, num_guesses=5, num_correct=2, delta=1.0), r"delta must be in \[0, 1\)"),
    (dict(num_canaries=10, num_guesses=5, num_correct=2, beta=0.0), r"beta must be in \(0, 1\)"),
    (dict(num_canaries=10, num_guesses=5, num_correct=2, beta=1.5), r"beta must be in \(0, 1\)"),
])
def test_bad_counts_and_levels_raise_clear_errors(kwargs, message):
    kwargs = {"delta": DELTA, "beta": BETA} | kwargs
    with pytest.raises(ValueError, match=message):
        audit.epsilon_lower_bound(kwargs.pop("num_canaries"), kwargs.pop("num_guesses"),
                                  kwargs.pop("num_correct"), **kwargs)


def test_p_value_rejects_a_negative_epsilon():
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0"):
        audit.p_value(10, 5, 3, -0.1, DELTA)


# -- Guesses ------------------------------------------------------------------


def test_guesses_take_the_highest_and_lowest_scores():
    scores = [5.0, -1.0, 3.0, 0.0, 9.0, 2.0]
    included = [True, False, False, True, True, False]
    # In: canaries 4 (9.0, in: right) and 0 (5.0, in: right); out: 1 (-1.0, out: right).
    assert audit.count_correct_guesses(scores, included, 2, 1) == (3, 3)
    # Out also on 3 (0.0, in: wrong); in also on 2 (3.0, out: wrong).
    assert audit.count_correct_guesses(scores, included, 3, 2) == (5, 3)
    assert audit.count_correct_guesses(scores, included, 0, 0) == (0, 0)
    # Ties are broken by index, not by the coins: [1, 1, 1] -> "in" on the last one.
    assert audit.count_correct_guesses([1.0, 1.0, 1.0], [False, False, True], 1, 0) == (1, 1)


@pytest.mark.parametrize("scores, included, k_in, k_out, message", [
    ([1.0, 2.0], [True], 1, 0, "one entry per canary"),
    ([1.0, np.nan], [True, False], 1, 0, "not finite"),
    ([1.0, 2.0], [True, False], 2, 1, "exceeds the 2 canaries"),
])
def test_bad_scores_raise_clear_errors(scores, included, k_in, k_out, message):
    with pytest.raises(ValueError, match=message):
        audit.count_correct_guesses(scores, included, k_in, k_out)


def test_audit_tests_each_candidate_at_beta_over_their_number():
    rng = np.random.default_rng(0)
    included = audit.draw_inclusion(400, rng)
    scores = included + rng.normal(0, 0.5, 400)
    pairs = [(10, 10), (50, 50), (100, 100)]
    result = audit.audit(scores, included, delta=DELTA, beta=BETA, guesses=pairs)
    best = max(audit.epsilon_lower_bound(400, *audit.count_correct_guesses(
        scores, included, k, k), delta=DELTA, beta=BETA / 3) for k, _ in pairs)
    assert result.epsilon_lower_bound == best > 0
    assert result.num_candidates == 3 and result.num_guesses_in == result.num_guesses_out
    assert audit.symmetric_guesses(1000, (0.02, 0.5, 1.0)) == ((10, 10), (250, 250), (500, 500))


# -- Soundness: the bound stays below epsilon except at rate beta ----------------


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
@pytest.mark.parametrize("delta", [0.0, 1e-3])
def test_soundness_is_exact_and_tight_on_randomized_response(epsilon, delta):
    # The worst (epsilon, delta)-DP mechanism for this audit: each guess is right with
    # probability delta + (1 - delta) e^eps / (1 + e^eps). The probability that the bound
    # exceeds epsilon is summed exactly over the Binomial count: at most beta; and with
    # delta = 0, where the bound is the exact Binomial tail, more than beta / 2 (a bound
    # that is not needlessly loose). The delta term 2 m delta alpha is conservative.
    r = 100
    accuracy = delta + (1 - delta) * special.expit(epsilon)
    counts = np.arange(r + 1)
    exceeds = np.array([audit.epsilon_lower_bound(r, r, int(v), delta=delta, beta=BETA) > epsilon
                        for v in counts])
    rate = stats.binom.pmf(counts, r, accuracy)[exceeds].sum()
    assert rate <= BETA
    assert delta > 0 or rate > BETA / 2


def test_soundness_over_repeated_audits_of_simulated_dp_sgd():
    # 200 audits of a correct Poisson-subsampled Gaussian (q = 0.1, T = 100, eps = 2):
    # the number of bounds above the claim is what beta allows (here: none).
    mechanism = _plan(2.0, 0.1, 100)
    bounds = _audits(mechanism, 2000, 200, seed=1, fractions=(0.05, 0.2))
    claimed = mechanism.epsilon()
    assert (bounds > claimed).sum() <= stats.binom.ppf(0.999, len(bounds), BETA)
    print(f"soundness: max bound / claimed = {bounds.max() / claimed:.3f}")


# -- Power, planted bugs, theory -------------------------------------------------


@pytest.mark.parametrize("sampling_prob, num_steps, target, min_ratio", [
    (1.0, 1, 4.0, 0.45),             # the Gaussian mechanism
    (2048 / 60000, 1172, 4.0, 0.4),  # fashion_mnist.gin's q and T
])
def test_power_the_bound_reaches_about_half_the_claim_at_large_epsilon(
        sampling_prob, num_steps, target, min_ratio):
    mechanism = _plan(target, sampling_prob, num_steps)
    bounds = _audits(mechanism, 20000, 3, seed=2, fractions=(0.005, 0.01, 0.02, 0.05))
    ratio = np.median(bounds) / mechanism.epsilon()
    print(f"power: q={sampling_prob:.4g}, T={num_steps}, median bound / claimed = {ratio:.3f}")
    assert min_ratio < ratio <= 1.0


@pytest.mark.parametrize("bug", [{"noise_scale": 0.5}, {"canary_norm": 2.0}],
                         ids=["noise_std_halved", "sensitivity_2c_treated_as_c"])
def test_a_planted_bug_pushes_the_bound_above_the_claim(bug):
    # Full batch (q = 1): the Gaussian mechanism at a claimed epsilon of 3. The correct
    # mechanism stays near half the claim; either bug takes every audit above it. One
    # guess count, fixed in advance: 3% of the canaries, about what maximises the bound
    # of a Gaussian mechanism at twice the claimed epsilon. (In this simulation the two
    # bugs scale the scores alike, so their bounds are equal; the TensorFlow test plants
    # each in its own code path.)
    mechanism = _plan(3.0, 1.0, 1)
    claimed = mechanism.epsilon()
    fractions = (0.03,)
    correct = _audits(mechanism, 20000, 3, seed=3, fractions=fractions)
    buggy = _audits(mechanism, 20000, 3, seed=3, fractions=fractions, **bug)
    print(f"bug {bug}: claimed {claimed:.3f}, correct {correct}, buggy {buggy}")
    assert np.all(correct < claimed) and np.all(buggy > claimed)


def test_against_theory_the_gaussian_bound_approaches_its_epsilon_as_m_grows():
    # One Gaussian mechanism with analytic epsilon 2 (PLD) at delta = 1e-5, audited at the
    # expected counts: the bound grows with m and stops at about 0.65 of epsilon by
    # m = 1e5 (the delta term 2 m delta then stops it; design/empirical_audit.md goes to 1e6).
    mechanism = _plan(2.0, 1.0, 1)
    claimed = mechanism.epsilon()
    bounds = [audit.gaussian_audit_at_expected_counts(
        mechanism.noise_multiplier, m, delta=DELTA, beta=BETA,
        num_thresholds=30)["epsilon_lower_bound"] for m in (10**2, 10**3, 10**4, 10**5)]
    print(f"theory: claimed {claimed:.3f}, bounds {np.round(bounds, 3)}")
    assert np.all(np.diff(bounds) > 0)
    assert 0.6 * claimed < bounds[-1] <= claimed


def test_simulated_scores_follow_the_stated_law():
    rng = np.random.default_rng(4)
    included = np.arange(20000) % 2 == 0
    scores = audit.simulate_gradient_canary_scores(
        included, noise_multiplier=2.0, sampling_prob=0.25, num_steps=16, rng=rng)
    out = scores[~included]  # N(0, T sigma^2) = N(0, 8^2)
    assert stats.kstest(out, "norm", args=(0, 8.0)).pvalue > 1e-3
    assert stats.kstest(out, "norm", args=(0, 8.0 * 2 / 3)).pvalue < 1e-6
    assert np.mean(scores[included]) == pytest.approx(16 * 0.25, abs=0.25)  # + T q
    assert np.var(scores[included]) == pytest.approx(64 + 16 * 0.25 * 0.75, rel=0.05)
