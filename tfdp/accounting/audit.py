"""Empirical privacy auditing in one training run: an epsilon LOWER bound.

Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run"
(NeurIPS 2023; sections as numbered in arXiv:2305.08846v1). The auditor

1. draws m canaries, each included in the training run independently with
   probability 1/2 (`draw_inclusion`);
2. after training, gives every canary a score, higher meaning "more likely
   included" (e.g. the sum over steps of the noisy gradient at a Dirac
   canary's coordinate, or minus the loss of a mislabelled image);
3. guesses "in" for the k+ highest scores and "out" for the k- lowest, and
   abstains on the rest (`count_correct_guesses`): r = k+ + k- guesses, of
   which v are correct;
4. rejects, at confidence 1 - beta, every (epsilon, delta) under which v or
   more correct guesses had probability < beta (`p_value`); the largest such
   epsilon is the lower bound (`epsilon_lower_bound`).

The bound is the paper's exact one, for (epsilon, delta)-DP with delta > 0
(Sec. 5, the p-value of Corollary 5.4; reference code in App. D): if the
training run is (epsilon, delta)-DP with respect to each canary, then for
every v

    P[W >= v] <= f(v) + 2 m delta max_{i = 1..m} (f(v - i) - f(v)) / i,
    f(u) = P[Binomial(r, e^eps / (1 + e^eps)) >= u],

where W is the number of correct guesses. The right-hand side is the
p-value; epsilon_lower_bound finds the largest epsilon whose p-value is
< beta by bracketing and bisection (App. D, `get_eps_audit`), to 1e-9, and
returns the low end of the final bracket, so it never overstates the bound.
Golden values, from App. D and Sec. 7 (Fig. 11) of the paper:

>>> round(epsilon_lower_bound(100, 100, 75, delta=0.0, beta=0.05), 3)
0.702
>>> round(epsilon_lower_bound(1000, 100, 75, delta=1e-4, beta=0.05), 3)
0.673
>>> round(epsilon_lower_bound(100000, 1510, 1439, delta=1e-5, beta=0.05), 3)
2.676

(The paper prints 2.675 for the last, its own code's value truncated.)

A lower bound above the claimed epsilon means, at confidence 1 - beta, that
the implementation is NOT as private as claimed (a bug); a lower bound below
it says nothing more than that this audit did not find one. With one run the
bound cannot exceed about log(r / log(1 / beta)) however leaky the run is.

Choosing k+ and k- after seeing the scores would void the confidence level;
`audit` therefore takes the candidate (k+, k-) pairs up front and tests each
at beta / (number of candidates) (Bonferroni), so the reported maximum over
them holds at confidence 1 - beta.

Also here: `simulate_gradient_canary_scores`, the exact law of the Dirac
canary scores of DP-SGD with Poisson sampling (for tests and benchmarks of
the audit itself, and for planted bugs), and `gaussian_audit_at_expected_counts`,
the bound an auditor of the plain Gaussian mechanism gets at the expected
counts (the "against theory" check).

Pure Python over numpy and scipy: no TensorFlow import.
"""

import dataclasses
import math
import numbers
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy import special
from scipy import stats

from tfdp.accounting import mechanism as mechanism_lib

# Peak bytes per canary of an audit's arrays: the coin (8 B drawn, 1 B kept), the
# participations (8), the noise (8), the score (8, and a temporary), and the ranking of
# `audit` (argsort's 8 and a sorted copy's 8), rounded up.
BYTES_PER_CANARY = 64


def check_canary_memory(num_canaries: int, *, bytes_per_canary: int = BYTES_PER_CANARY,
                        available_bytes: Optional[int] = None) -> None:
    """Refuses, before allocating, a number of canaries whose arrays cannot fit in memory.

    Args:
      num_canaries: m.
      bytes_per_canary: peak bytes per canary (`BYTES_PER_CANARY` for an audit).
      available_bytes: the memory available (None: MemAvailable of /proc/meminfo, else
        the free physical pages; if neither is known, nothing is checked).

    Raises:
      ValueError: m * bytes_per_canary exceeds the available memory; the message says
        how much it would need, how much there is, and the largest m that fits.
    """
    m = _count("num_canaries", num_canaries, minimum=1)
    available = _available_memory() if available_bytes is None else int(available_bytes)
    need = m * int(bytes_per_canary)
    if available is None or need <= available:
        return
    fits = available // int(bytes_per_canary)
    raise ValueError(
        f"{m:,} canaries would need about {_bytes(need)} of memory ({bytes_per_canary} bytes "
        f"per canary: its coin, score and rank), and {_bytes(available)} is available. Use at "
        f"most about {fits:,} canaries, or run on a machine with more memory.")


def _available_memory():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os  # pylint: disable=g-import-not-at-top

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _bytes(count):
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


# The p-value sums v = num_correct binomial terms, with this many bytes per term at
# once (the indices, the pmf, its running sum, the divisors and the ratios), at each
# of about 40 bisection steps: v = 10^7 took 52 s and 0.5 GB for one bound
# (2026-11-27, 2-core CPU), so larger counts are refused rather than left to run
# for hours or to fail allocating (10^12 asked numpy for 7.28 TiB).
BYTES_PER_CORRECT = 40
MAX_NUM_CORRECT = 10**7

# Bisection stops when the bracket is this narrow (in epsilon).
_EPSILON_TOLERANCE = 1e-9
# No run can be audited above this: the p-value's Binomial success
# probability e^eps / (1 + e^eps) is then 1 in double precision.
_MAX_EPSILON = 40.0


def _count(name, value, *, minimum=0):
    if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
            or value < minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _probability(name, value, *, open_low, open_high=True):
    low_ok = value > 0 if open_low else value >= 0
    high_ok = value < 1 if open_high else value <= 1
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
            or not math.isfinite(value) or not (low_ok and high_ok)):
        interval = ("(" if open_low else "[") + "0, 1" + (")" if open_high else "]")
        raise ValueError(f"{name} must be in {interval}, got {value!r}.")
    return float(value)


def _validate_counts(num_canaries, num_guesses, num_correct):
    m = _count("num_canaries", num_canaries, minimum=1)
    r = _count("num_guesses", num_guesses)
    v = _count("num_correct", num_correct)
    if not v <= r <= m:
        raise ValueError(
            f"Need num_correct <= num_guesses <= num_canaries, got num_correct={v}, "
            f"num_guesses={r}, num_canaries={m}: every guess is about one canary, and "
            "a correct guess is a guess.")
    if v > MAX_NUM_CORRECT:
        raise ValueError(
            f"num_correct = {v:,} is more than {MAX_NUM_CORRECT:,}, the most the bound handles: "
            f"its p-value sums num_correct binomial terms ({BYTES_PER_CORRECT} bytes each) at "
            f"each of about 40 bisection steps, and {MAX_NUM_CORRECT:,} take about a minute; "
            f"{v:,} would need {_bytes(v * BYTES_PER_CORRECT)} of memory. Guess on fewer "
            "canaries (fewer or smaller --guess_fractions, or a random subset of the canaries "
            "chosen before the scores are seen).")
    return m, r, v


def p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float,
            delta: float) -> float:
    """P-value of `num_correct` correct guesses under (epsilon, delta)-DP.

    An upper bound on the probability of at least v = `num_correct` correct
    guesses out of r = `num_guesses` (the others abstain) among m =
    `num_canaries` canaries, each included with probability 1/2, if the run
    is (epsilon, delta)-DP (Steinke, Nasr & Jagielski 2023, Corollary 5.4;
    App. D, `p_value_DP_audit`):

        min(1, f(v) + 2 m delta max_{i >= 1} (f(v - i) - f(v)) / i),
        f(u) = P[Binomial(r, e^eps / (1 + e^eps)) >= u].

    f(v - i) - f(v) = P[v - i <= Binomial < v] is summed from the pmf (not a
    difference of two tails), and the maximum runs over i = 1..v: for i > v
    the numerator stops growing.

    >>> round(p_value(100, 100, 75, math.log(3), 0.0), 3)   # P[Bin(100, 3/4) >= 75]
    0.553

    Args:
      num_canaries: m >= 1.
      num_guesses: r, 0 <= r <= m.
      num_correct: v, 0 <= v <= r.
      epsilon: >= 0.
      delta: in [0, 1).

    Returns:
      The p-value, a float in [0, 1].

    Raises:
      ValueError: on counts that are not integers with 0 <= v <= r <= m, a v
        above MAX_NUM_CORRECT (its time and memory), a negative or non-finite
        epsilon, or a delta outside [0, 1).
    """
    m, r, v = _validate_counts(num_canaries, num_guesses, num_correct)
    if (not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon)
            or epsilon < 0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}.")
    delta = _probability("delta", delta, open_low=False)
    return _p_value(m, r, v, float(epsilon), delta)


def _p_value(m, r, v, epsilon, delta):
    q = float(special.expit(epsilon))  # accuracy of epsilon-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[Binomial(r, q) >= v]
    if delta == 0.0 or v == 0:
        return min(1.0, tail)
    # pmf at v-1, v-2, ..., 0; the running sums are f(v - i) - f(v), i = 1..v.
    between = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
    alpha = float(np.max(between / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def epsilon_lower_bound(num_canaries: int, num_guesses: int, num_correct: int, *,
                        delta: float, beta: float) -> float:
    """The largest epsilon that `num_correct` correct guesses reject at level `beta`.

    Steinke, Nasr & Jagielski 2023, App. D (`get_eps_audit`): keeps
    p_value(eps_low) < beta <= p_value(eps_high), starting from
    [0, 1] and raising eps_high by 1 until it holds, then bisects until the
    bracket is narrower than 1e-9 and returns eps_low. With probability at
    least 1 - beta over the canaries' coins (and the run's), an
    (epsilon, delta)-DP run gives a bound <= epsilon.

    Args:
      num_canaries: m >= 1, canaries each included with probability 1/2.
      num_guesses: r, guesses made (abstentions excluded), 0 <= r <= m.
      num_correct: v, correct guesses, 0 <= v <= r.
      delta: the delta of the claim being audited, in [0, 1).
      beta: 1 - confidence, in (0, 1) (0.05 for 95%).

    Returns:
      epsilon >= 0 (0 when even epsilon = 0 is not rejected).

    Raises:
      ValueError: on invalid counts, delta or beta (see `p_value`).
    """
    m, r, v = _validate_counts(num_canaries, num_guesses, num_correct)
    delta = _probability("delta", delta, open_low=False)
    beta = _probability("beta", beta, open_low=True)
    low, high = 0.0, 1.0
    if _p_value(m, r, v, low, delta) >= beta:
        return 0.0
    while _p_value(m, r, v, high, delta) < beta:
        low, high = high, high + 1.0
        if high > _MAX_EPSILON:
            return low
    while high - low > _EPSILON_TOLERANCE:
        middle = 0.5 * (low + high)
        if _p_value(m, r, v, middle, delta) < beta:
            low = middle
        else:
            high = middle
    return low


# -- Canaries and guesses ----------------------------------------------------


def draw_inclusion(num_canaries: int, rng: np.random.Generator) -> np.ndarray:
    """Each canary is in the run independently with probability 1/2: bool [m].

    Raises:
      ValueError: if num_canaries < 1, or if an audit of m canaries would not fit in
        memory (`check_canary_memory`), before anything is allocated.
    """
    m = _count("num_canaries", num_canaries, minimum=1)
    check_canary_memory(m)
    return rng.random(m) < 0.5


def count_correct_guesses(scores, included, num_guesses_in: int,
                          num_guesses_out: int) -> Tuple[int, int]:
    """Guesses "in" for the k+ highest scores and "out" for the k- lowest.

    Ties are broken by canary index (a stable sort), which is independent of
    the inclusion coins.

    >>> count_correct_guesses([0.9, 0.1, 0.5, 0.7], [True, False, True, True], 1, 2)
    (3, 2)

    (Canary 0 is guessed in, rightly; canaries 1 and 2 out: 1 rightly, 2
    wrongly; canary 3 is not guessed.)

    Args:
      scores: float [m], higher meaning "more likely included".
      included: bool [m], the inclusion coins.
      num_guesses_in: k+ >= 0.
      num_guesses_out: k- >= 0, with k+ + k- <= m.

    Returns:
      `(num_guesses, num_correct)` = (r, v).

    Raises:
      ValueError: on mismatched or non-finite scores, or k+ + k- > m.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.ndim != 1 or scores.shape != included.shape:
        raise ValueError(f"scores {scores.shape} and included {included.shape} must be "
                         "two vectors of one length, one entry per canary.")
    if not np.all(np.isfinite(scores)):
        raise ValueError(f"{int(np.sum(~np.isfinite(scores)))} canary scores are not "
                         "finite; a score must be a real number.")
    k_in = _count("num_guesses_in", num_guesses_in)
    k_out = _count("num_guesses_out", num_guesses_out)
    if k_in + k_out > len(scores):
        raise ValueError(f"num_guesses_in + num_guesses_out = {k_in + k_out} exceeds the "
                         f"{len(scores)} canaries.")
    order = np.argsort(scores, kind="stable")
    correct = int(np.sum(included[order[len(order) - k_in:]])) if k_in else 0
    correct += int(np.sum(~included[order[:k_out]]))
    return k_in + k_out, correct


def symmetric_guesses(num_canaries: int,
                      fractions: Sequence[float] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
                      ) -> Tuple[Tuple[int, int], ...]:
    """Candidate (k+, k-) pairs with k+ = k- = fraction * m / 2 (at least 1 each).

    Fractions of the canaries guessed; the audit tests each at beta / len.
    """
    m = _count("num_canaries", num_canaries, minimum=2)
    pairs = {(max(1, int(f * m) // 2),) * 2 for f in fractions}
    return tuple(sorted(pairs))


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The outcome of one audit (`audit`).

    Attributes:
      epsilon_lower_bound: the bound, at confidence 1 - beta.
      num_canaries: m.
      num_guesses: r = k+ + k- of the candidate that gave the bound.
      num_correct: v of that candidate.
      num_guesses_in: k+ of that candidate.
      num_guesses_out: k- of that candidate.
      num_candidates: how many (k+, k-) pairs were tested (each at
        beta / num_candidates).
      delta: the delta of the audited claim.
      beta: 1 - confidence of the whole audit.
    """

    epsilon_lower_bound: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    num_guesses_in: int
    num_guesses_out: int
    num_candidates: int
    delta: float
    beta: float

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def audit(scores, included, *, delta: float, beta: float,
          guesses: Optional[Sequence[Tuple[int, int]]] = None) -> AuditResult:
    """The epsilon lower bound from canary scores (Steinke et al. 2023, Algorithm 1).

    Args:
      scores: float [m], higher meaning "more likely included".
      included: bool [m], the inclusion coins (each True w.p. 1/2).
      delta: the delta of the claim being audited, in [0, 1).
      beta: 1 - confidence of the whole audit, in (0, 1).
      guesses: the candidate (k+, k-) pairs, fixed BEFORE looking at the
        scores (None: `symmetric_guesses(m)`). Each is tested at
        beta / len(guesses); the best bound is returned.

    Returns:
      An `AuditResult`.

    Raises:
      ValueError: on invalid scores, coins, pairs, delta or beta.
    """
    included = np.asarray(included, dtype=bool)
    m = len(included)
    guesses = symmetric_guesses(m) if guesses is None else tuple(guesses)
    if not guesses:
        raise ValueError("guesses must hold at least one (k+, k-) pair.")
    beta = _probability("beta", beta, open_low=True)
    level = beta / len(guesses)
    best = None
    for k_in, k_out in guesses:
        r, v = count_correct_guesses(scores, included, k_in, k_out)
        bound = epsilon_lower_bound(m, r, v, delta=delta, beta=level)
        if best is None or bound > best[0]:
            best = (bound, r, v, k_in, k_out)
    bound, r, v, k_in, k_out = best
    return AuditResult(epsilon_lower_bound=bound, num_canaries=m, num_guesses=r,
                       num_correct=v, num_guesses_in=k_in, num_guesses_out=k_out,
                       num_candidates=len(guesses), delta=float(delta), beta=beta)


# -- The mechanism, simulated -------------------------------------------------


def simulate_gradient_canary_scores(included, *, noise_multiplier: float,
                                    sampling_prob: float, num_steps: int,
                                    rng: np.random.Generator,
                                    canary_norm: float = 1.0,
                                    noise_scale: float = 1.0) -> np.ndarray:
    """Scores of Dirac gradient canaries under DP-SGD with Poisson sampling.

    At each of T steps every included canary joins the batch with
    probability q and adds `canary_norm` (in units of the sensitivity) to its
    own coordinate of the clipped sum; Gaussian noise of std
    `noise_scale * noise_multiplier` is added to every coordinate; the score
    is the sum over the steps of the noisy coordinate. Coordinates do not
    collide, so the score's exact law is

        canary_norm * Binomial(T, q) * included + Normal(0, T (noise_scale sigma)^2),

    drawn here directly. This is what `tfdp.audit.GradientCanaryDPModel`
    observes with dedicated canary coordinates (in units of the sensitivity).
    A correct implementation has `canary_norm = noise_scale = 1`; planted
    bugs: noise std halved (`noise_scale=0.5`), or sensitivity 2C treated as C
    (`canary_norm=2`, what the microbatching bug did).

    Args:
      included: bool [m], the inclusion coins.
      noise_multiplier: sigma of the claim, > 0.
      sampling_prob: q in (0, 1].
      num_steps: T >= 1.
      rng: numpy Generator.
      canary_norm: a canary's contribution / the claimed sensitivity.
      noise_scale: the noise std used / the claimed one.

    Returns:
      float64 [m] scores.
    """
    included = np.asarray(included, dtype=bool)
    steps = _count("num_steps", num_steps, minimum=1)
    _probability("sampling_prob", sampling_prob, open_low=True, open_high=False)
    participations = rng.binomial(steps, sampling_prob, size=included.shape)
    noise = rng.normal(0.0, noise_scale * noise_multiplier * math.sqrt(steps), included.shape)
    return canary_norm * participations * included + noise


def simulated_mechanism(*, sampling_prob: float, num_steps: int, delta: float,
                        noise_multiplier: Optional[float] = None,
                        target_epsilon: Optional[float] = None,
                        accountant: str = "pld") -> mechanism_lib.DPMechanism:
    """A `DPMechanism` with sampling probability q, for simulated audits.

    The audit only needs q, T, sigma and delta; N is a fictitious 10^9 (so
    B = q N), and the usual warning on delta >= 1/N is not raised for it.
    Exactly one of `noise_multiplier` and `target_epsilon` (then sigma is
    calibrated to it, `tfdp.accounting.plan_mechanism`) is given.

    Raises:
      ValueError: a sampling_prob outside (0, 1] (named as such: the
        fictitious N and B are not the user's), or other invalid values (as
        `plan_mechanism`).
    """
    if isinstance(sampling_prob, bool) or not isinstance(sampling_prob, numbers.Real) or not (
            0.0 < sampling_prob <= 1.0):
        raise ValueError(f"sampling_prob must be in (0, 1] (the probability that an example "
                         f"joins a step's batch), got {sampling_prob!r}.")
    num_examples = 10**9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        mechanism = mechanism_lib.plan_mechanism(
            num_examples=num_examples, batch_size=max(1, round(sampling_prob * num_examples)),
            num_steps=num_steps, l2_clip_norm=1.0, target_delta=delta,
            noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            accountant=accountant)
        mechanism.epsilon()  # cached, so later calls do not warn either
    return mechanism


def simulate_audits(mechanism: mechanism_lib.DPMechanism, *, num_canaries: int, repeats: int,
                    rng: np.random.Generator, beta: float = 0.05,
                    guesses: Optional[Sequence[Tuple[int, int]]] = None,
                    canary_norm: float = 1.0, noise_scale: float = 1.0) -> List[AuditResult]:
    """`repeats` audits of `mechanism` with simulated Dirac gradient canaries.

    Each draws fresh seeds and scores (`simulate_gradient_canary_scores`,
    with the planted bugs `canary_norm` and `noise_scale`) and audits the
    claim at `mechanism.delta` (`audit`).
    """
    check_canary_memory(num_canaries)
    results = []
    for _ in range(_count("repeats", repeats, minimum=1)):
        included = draw_inclusion(num_canaries, rng)
        scores = simulate_gradient_canary_scores(
            included, noise_multiplier=mechanism.noise_multiplier,
            sampling_prob=mechanism.sampling_prob, num_steps=mechanism.num_steps, rng=rng,
            canary_norm=canary_norm, noise_scale=noise_scale)
        results.append(audit(scores, included, delta=mechanism.delta, beta=beta,
                             guesses=guesses))
    return results


def gaussian_audit_at_expected_counts(noise_multiplier: float, num_canaries: int, *,
                                      delta: float, beta: float,
                                      num_thresholds: int = 200) -> Dict[str, Any]:
    """The bound an auditor of ONE Gaussian mechanism gets at the expected counts.

    Each canary adds 1 (the sensitivity) to its own coordinate when
    included; noise N(0, sigma^2) is added once (no subsampling, one step),
    so an included canary scores N(1, sigma^2) and an excluded one
    N(0, sigma^2). Guessing "in" above 1/2 + t and "out" below 1/2 - t gives,
    in expectation, r = m (Q((t - 1/2) / sigma) + Q((t + 1/2) / sigma))
    guesses of which v = m Q((t - 1/2) / sigma) are correct (Q the normal
    tail). This returns the best bound over a grid of t (an oracle choice:
    it shows what the bound can reach, not a valid audit), to compare with
    the mechanism's analytic epsilon as m grows.

    Args:
      noise_multiplier: sigma > 0.
      num_canaries: m >= 2.
      delta, beta: as in `epsilon_lower_bound`.
      num_thresholds: grid size for t in [0, 1/2 + 6 sigma].

    Returns:
      {"epsilon_lower_bound", "num_guesses", "num_correct", "threshold"}.
    """
    m = _count("num_canaries", num_canaries, minimum=2)
    best = {"epsilon_lower_bound": 0.0, "num_guesses": 0, "num_correct": 0, "threshold": None}
    for t in np.linspace(0.0, 0.5 + 6.0 * noise_multiplier, num_thresholds):
        hit = stats.norm.sf((t - 0.5) / noise_multiplier)
        miss = stats.norm.sf((t + 0.5) / noise_multiplier)
        r = int(round(m * (hit + miss)))
        v = min(r, int(math.floor(m * hit)))
        if r == 0:
            continue
        bound = epsilon_lower_bound(m, r, v, delta=delta, beta=beta)
        if bound > best["epsilon_lower_bound"]:
            best = {"epsilon_lower_bound": bound, "num_guesses": r, "num_correct": v,
                    "threshold": float(t)}
    return best


def report_section(result: AuditResult, *, canaries: str, score: str, num_included: int,
                   claimed_epsilon: float, command: Optional[str] = None) -> Dict[str, Any]:
    """The privacy report's "audit" section (`tfdp.export.privacy_report`).

    Args:
      result: the `AuditResult`.
      canaries: what the canaries were, e.g. "gradient (Dirac, dedicated
        coordinates)".
      score: how a canary was scored.
      num_included: how many canaries the coins put into the run.
      claimed_epsilon: the run's epsilon at `result.delta`.
      command: the command that ran the audit, or None.

    Returns:
      A JSON-able dict: the result's fields, the claim, their ratio,
      whether the bound exceeds the claim, the method and the command.
    """
    bound = result.epsilon_lower_bound
    return {
        **result.to_dict(),
        "canaries": canaries,
        "score": score,
        "num_included": int(num_included),
        "confidence": 1.0 - result.beta,
        "claimed_epsilon": float(claimed_epsilon),
        "ratio": bound / claimed_epsilon if claimed_epsilon > 0 else math.inf,
        "exceeds_claim": bound > claimed_epsilon,
        "method": ("one training run (Steinke, Nasr & Jagielski 2023, Algorithm 1; "
                   "p-value of Corollary 5.4, bound as in App. D); guesses on the "
                   f"{result.num_guesses_in} highest and {result.num_guesses_out} lowest "
                   f"scores, best of {result.num_candidates} pairs fixed in advance, each at "
                   "beta / pairs"),
        "command": command,
    }
