"""Calibration: the one DP-SGD parameter that meets an epsilon budget, the others fixed.

Each search inverts the accountant of `tfdp.accounting.accountant` (RDP or PLD) over
one parameter, epsilon being monotone in it: the smallest noise_multiplier
(`calibrate_noise_multiplier`, `solve_noise_multiplier`), the largest num_steps
(`calibrate_num_steps`, `solve_num_steps`) or the largest expected batch size
(`calibrate_batch_size`) whose epsilon is <= target_epsilon. The searches start from
TAN's closed-form estimate (Sander et al. 2023, Def. 3.1 and eq. 4), bracket the answer
by doubling or halving, then run `dp_accounting.calibrate_dp_mechanism`. This is how
De et al. 2022 (App. C.4) pick sigma for each (learning rate, steps) pair.

Nothing here imports TensorFlow.
"""

import math
import numbers
from typing import Callable

import dp_accounting

from tfdp.accounting import accountant as accountant_lib

# The searches build their events with the accountant's unchecked `_dp_sgd_event` (the
# parameters are validated once, up front) and its `_accountant_factory`.
# pylint: disable=protected-access

# Search ranges of the calibration functions.
_MAX_NOISE_MULTIPLIER = 1e4
_MIN_NOISE_MULTIPLIER = 0.05
_CALIBRATION_RELATIVE_TOL = 1e-3


def _validate_target_epsilon(target_epsilon):
    if not (
        isinstance(target_epsilon, numbers.Real)
        and math.isfinite(target_epsilon)
        and target_epsilon > 0
    ):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    sampling_prob: float,
    num_steps: int,
    delta: float,
    accountant: str = "rdp",
    extra_events=(),
) -> float:
    """Returns the smallest noise_multiplier whose epsilon is <= target_epsilon.

    The event is Poisson-subsampled DP-SGD (`dp_sgd_event`) composed with
    `extra_events`; `solve_noise_multiplier` does the search for any event.
    This is how De et al. 2022 (App. C.4) pick sigma for each (learning rate,
    steps) pair.

    Args:
      target_epsilon: the epsilon budget, > 0.
      sampling_prob: q = batch_size / num_examples, in (0, 1].
      num_steps: optimizer updates (not epochs), integer >= 1.
      delta: the delta of (epsilon, delta)-DP, in (0, 1).
      accountant: "rdp" or "pld".
      extra_events: DpEvents composed with the run (see `compute_epsilon`).

    Returns:
      noise_multiplier: noise std divided by l2_clip_norm (float, > 0).

    Raises:
      ValueError: if a parameter is out of range, or the target cannot be met
        with noise_multiplier in [0.05, 1e4] (the message says what to change).
    """
    _validate_target_epsilon(target_epsilon)
    accountant_lib.validate_privacy_params(
        sampling_prob=sampling_prob, num_steps=num_steps, delta=delta)
    # TAN estimate (TAN Def. 3.1, eq. 4): sigma ~ q sqrt(T / 2) / eta.
    guess = sampling_prob * math.sqrt(num_steps / 2) / _tan_eta_for(target_epsilon, delta)
    return solve_noise_multiplier(
        lambda sigma: accountant_lib._dp_sgd_event(sigma, sampling_prob, num_steps, extra_events),
        target_epsilon=target_epsilon,
        delta=delta,
        accountant=accountant,
        guess=guess,
        context=f"sampling_prob={sampling_prob:.4g}, num_steps={num_steps}, delta={delta:g}",
    )


def solve_noise_multiplier(
    make_event: Callable[[float], dp_accounting.DpEvent],
    *,
    target_epsilon: float,
    delta: float,
    accountant: str = "rdp",
    guess: float = 1.0,
    context: str = "",
) -> float:
    """Smallest noise multiplier whose event `make_event(sigma)` meets the budget.

    Uses `dp_accounting.calibrate_dp_mechanism` (Brent's method) on a bracket
    [lo, hi] found by doubling / halving from `guess`, with a tolerance of
    1e-3 * lo (so within 0.1% of the optimum). The returned value always
    satisfies epsilon(make_event(sigma)) <= target_epsilon.

    Args:
      make_event: sigma -> the run's DpEvent; epsilon must decrease in sigma.
      target_epsilon: the epsilon budget, > 0.
      delta: the delta of (epsilon, delta)-DP, in (0, 1).
      accountant: "rdp" or "pld".
      guess: where the bracket search starts (e.g. TAN's estimate).
      context: the other parameters, for error messages.

    Returns:
      noise_multiplier (float, > 0): noise std divided by the sensitivity.

    Raises:
      ValueError: if the target cannot be met with noise_multiplier in
        [0.05, 1e4] (the message says what to change).
    """
    _validate_target_epsilon(target_epsilon)
    accountant_lib.validate_privacy_params(delta=delta)
    make_accountant = accountant_lib._accountant_factory(accountant)

    def epsilon(sigma):
        return make_accountant().compose(make_event(sigma)).get_epsilon(delta)

    hi = min(max(guess, 2 * _MIN_NOISE_MULTIPLIER), _MAX_NOISE_MULTIPLIER)
    while epsilon(hi) > target_epsilon:
        hi *= 2
        if hi > _MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"target_epsilon={target_epsilon} needs noise_multiplier > "
                f"{_MAX_NOISE_MULTIPLIER:g} ({context}): raise target_epsilon or "
                f"lower num_steps or the batch size."
            )
    lo = hi / 2
    while epsilon(lo) <= target_epsilon:
        hi = lo
        lo /= 2
        if lo < _MIN_NOISE_MULTIPLIER:
            raise ValueError(
                f"target_epsilon={target_epsilon} is met even with noise_multiplier"
                f" = {hi:g} ({context}): the budget is so loose that the "
                f"calibration is meaningless; lower target_epsilon or delta."
            )
    sigma = dp_accounting.calibrate_dp_mechanism(
        make_accountant,
        make_event,
        target_epsilon,
        delta,
        dp_accounting.ExplicitBracketInterval(lo, hi),
        tol=_CALIBRATION_RELATIVE_TOL * lo,
    )
    if epsilon(sigma) > target_epsilon:  # Not expected; keep the contract.
        sigma = hi
    return float(sigma)


def _tan_eta_for(target_epsilon: float, delta: float) -> float:
    """Inverts eps_TAN(eta) = eta^2 + 2 eta sqrt(log(1/delta)) (TAN eq. 4).

    Only used as the starting guess of the calibration searches: for
    noise_multiplier >= 2 the accountants' epsilon is close to eps_TAN (TAN
    Sec. 3.2), so the bracket is found in a few evaluations.
    """
    root_log = math.sqrt(math.log(1 / delta))
    return math.sqrt(root_log**2 + target_epsilon) - root_log


def _largest_int_within_budget(
    epsilon: Callable[[int], float],
    target_epsilon: float,
    delta: float,
    make_accountant,
    make_event,
    guess: float,
    upper: int,
) -> int:
    """Largest x in [1, upper] with epsilon(x) <= target, epsilon increasing.

    Requires epsilon(1) <= target_epsilon. Brackets the answer by doubling or
    halving from `guess`, runs `dp_accounting.calibrate_dp_mechanism(
    discrete=True)` and fixes the result up by +-1 so that
    epsilon(x) <= target < epsilon(x + 1) exactly.
    """
    x = min(max(int(guess), 1), upper)
    if epsilon(x) <= target_epsilon:
        lo, hi = x, min(2 * x, upper)
        while hi < upper and epsilon(hi) <= target_epsilon:
            lo, hi = hi, min(2 * hi, upper)
        if epsilon(hi) <= target_epsilon:
            return hi
    else:
        lo, hi = max(x // 2, 1), x
        while epsilon(lo) > target_epsilon:
            lo, hi = max(lo // 2, 1), lo
    if hi - lo > 1:
        x = int(
            dp_accounting.calibrate_dp_mechanism(
                make_accountant,
                make_event,
                target_epsilon,
                delta,
                dp_accounting.ExplicitBracketInterval(lo, hi),
                discrete=True,
            )
        )
    else:
        x = lo
    while x > 1 and epsilon(x) > target_epsilon:
        x -= 1
    while x < upper and epsilon(x + 1) <= target_epsilon:
        x += 1
    return x


def calibrate_num_steps(
    *,
    target_epsilon: float,
    noise_multiplier: float,
    sampling_prob: float,
    delta: float,
    accountant: str = "rdp",
    max_num_steps: int = 10**7,
    extra_events=(),
) -> int:
    """Returns the largest num_steps T with epsilon(T) <= target_epsilon.

    The trainer uses this so that training never goes past the target epsilon:
    epsilon(T) <= target_epsilon < epsilon(T + 1) (unless T = max_num_steps).

    Args:
      target_epsilon: the epsilon budget, > 0.
      noise_multiplier: noise std divided by l2_clip_norm (dimensionless), > 0.
      sampling_prob: q = batch_size / num_examples, in (0, 1].
      delta: the delta of (epsilon, delta)-DP, in (0, 1).
      accountant: "rdp" or "pld".
      max_num_steps: upper end of the search; returned as is when even that many
        steps stay within the budget.
      extra_events: DpEvents composed with the run (see `compute_epsilon`).

    Returns:
      num_steps (int, >= 1): optimizer updates, not epochs.

    Raises:
      ValueError: if a parameter is out of range, or if a single step already
        exceeds target_epsilon (the message says what to change).
    """
    _validate_target_epsilon(target_epsilon)
    accountant_lib.validate_privacy_params(
        noise_multiplier=noise_multiplier, sampling_prob=sampling_prob, delta=delta
    )
    # TAN guess: S = 2 sigma^2 eta^2 / q^2 (TAN Def. 3.1).
    eta = _tan_eta_for(target_epsilon, delta)
    return solve_num_steps(
        lambda steps: accountant_lib._dp_sgd_event(
            noise_multiplier, sampling_prob, steps, extra_events),
        target_epsilon=target_epsilon,
        delta=delta,
        accountant=accountant,
        max_num_steps=max_num_steps,
        guess=2 * (noise_multiplier * eta / sampling_prob) ** 2,
        context=(f"noise_multiplier={noise_multiplier}, sampling_prob={sampling_prob:.4g}, "
                 f"delta={delta:g}"),
    )


def solve_num_steps(
    make_event: Callable[[int], dp_accounting.DpEvent],
    *,
    target_epsilon: float,
    delta: float,
    accountant: str = "rdp",
    max_num_steps: int = 10**7,
    guess: float = 1.0,
    context: str = "",
) -> int:
    """Largest step count T in [1, max_num_steps] whose `make_event(T)` meets the budget.

    Args:
      make_event: num_steps -> the run's DpEvent; epsilon must increase in T.
      target_epsilon: the epsilon budget, > 0.
      delta: the delta of (epsilon, delta)-DP, in (0, 1).
      accountant: "rdp" or "pld".
      max_num_steps: upper end of the search, returned as is when within budget.
      guess: where the bracket search starts.
      context: the other parameters, for error messages.

    Returns:
      num_steps (int, >= 1): epsilon(T) <= target_epsilon < epsilon(T + 1),
      unless T = max_num_steps.

    Raises:
      ValueError: if max_num_steps < 1 or a single step already exceeds
        target_epsilon (the message says what to change).
    """
    _validate_target_epsilon(target_epsilon)
    accountant_lib.validate_privacy_params(delta=delta)
    if not (accountant_lib._is_integer(max_num_steps) and max_num_steps >= 1):
        raise ValueError(f"max_num_steps must be an integer >= 1, got {max_num_steps!r}.")
    make_accountant = accountant_lib._accountant_factory(accountant)

    def epsilon(steps):
        return make_accountant().compose(make_event(steps)).get_epsilon(delta)

    first = epsilon(1)
    if first > target_epsilon:
        raise ValueError(
            f"A single step already costs epsilon={first:.4g} > target_epsilon="
            f"{target_epsilon} ({context}): raise target_epsilon or noise_multiplier, "
            f"or lower the batch size."
        )
    return _largest_int_within_budget(
        epsilon, target_epsilon, delta, make_accountant, make_event,
        min(guess, max_num_steps), max_num_steps,
    )


def calibrate_batch_size(
    *,
    target_epsilon: float,
    noise_multiplier: float,
    num_steps: int,
    num_examples: int,
    delta: float,
    accountant: str = "rdp",
) -> int:
    """Returns the largest expected batch size B with epsilon <= target_epsilon.

    The sampling probability is q = B / num_examples, so
    epsilon(B) <= target_epsilon < epsilon(B + 1) (unless B = num_examples).

    Args:
      target_epsilon: the epsilon budget, > 0.
      noise_multiplier: noise std divided by l2_clip_norm (dimensionless), > 0.
      num_steps: optimizer updates (not epochs), integer >= 1.
      num_examples: number of training examples N, integer >= 1.
      delta: the delta of (epsilon, delta)-DP, in (0, 1).
      accountant: "rdp" or "pld".

    Returns:
      batch_size (int, in [1, num_examples]): expected logical batch size.

    Raises:
      ValueError: if a parameter is out of range, or if even batch_size = 1
        exceeds target_epsilon (the message says what to change).

    Warns:
      UserWarning: if delta >= 1 / num_examples (see `validate_privacy_params`).
    """
    _validate_target_epsilon(target_epsilon)
    accountant_lib.validate_privacy_params(
        noise_multiplier=noise_multiplier,
        num_steps=num_steps,
        num_examples=num_examples,
        delta=delta,
    )
    make_accountant = accountant_lib._accountant_factory(accountant)

    def make_event(batch_size):
        return accountant_lib._dp_sgd_event(noise_multiplier, batch_size / num_examples, num_steps)

    def epsilon(batch_size):
        return make_accountant().compose(make_event(batch_size)).get_epsilon(delta)

    first = epsilon(1)
    if first > target_epsilon:
        raise ValueError(
            f"Even batch_size=1 costs epsilon={first:.4g} > target_epsilon="
            f"{target_epsilon} (noise_multiplier={noise_multiplier}, num_steps="
            f"{num_steps}, num_examples={num_examples}, delta={delta:g}): raise "
            f"target_epsilon or noise_multiplier, or lower num_steps."
        )
    # TAN guess: q = sigma eta sqrt(2 / S) (TAN Def. 3.1).
    eta = _tan_eta_for(target_epsilon, delta)
    guess = min(num_examples * noise_multiplier * eta * math.sqrt(2 / num_steps), num_examples)
    return _largest_int_within_budget(
        epsilon, target_epsilon, delta, make_accountant, make_event, guess, num_examples
    )
