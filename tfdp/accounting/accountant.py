"""Privacy accounting for DP-SGD with Poisson sampling, over `dp_accounting`.

One DP-SGD run is `num_steps` self-compositions of the Poisson-subsampled
Gaussian mechanism (Abadi et al. 2016; De et al. 2022, Sec. 2 and App. A.1,
Algorithm 1): each step samples every example independently with probability
`sampling_prob = batch_size / num_examples`, clips per-example gradients to
`l2_clip_norm` and adds Gaussian noise of std `noise_multiplier * l2_clip_norm`
to their sum. The neighbouring relation is add-or-remove one example
(`dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE`, the library default),
which is the relation that Poisson sampling amplifies (How to DP-fy ML,
Ponomareva et al. 2023, Sec. 5.3.1).

Two accountants are offered (`ACCOUNTANTS`):

* ``"rdp"``: `dp_accounting.rdp.RdpAccountant` with its default orders
  (1.1 to 10.9 in steps of 0.1, 11 to 63, then 128, 256, 512, 1024). The
  De et al. 2022 tables (App. C.5, Tables 12-14) were computed with RDP and
  this grid reproduces them: a 10x denser grid changes epsilon by < 1e-3 on
  all of them.
* ``"pld"``: `dp_accounting.pld.PLDAccountant` (privacy loss distributions;
  tighter than RDP, TAN Sec. 2 cites it as Balle et al. 2020 / Gopi et al.
  2021) with `PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3`. The PLD is built with
  pessimistic rounding, so a coarser interval only makes epsilon a looser
  *upper* bound: at 1e-3 it is within 0.4% of the 1e-4 value on the De et al.
  tables (ImageNet, T = 71589 steps: 7.534 vs 7.509) while being up to 10x
  faster (< 0.1 s per call instead of up to several seconds), which keeps
  calibration (tens of calls) and the CLI fast.

Nothing here imports TensorFlow, so epsilon can be computed without it.
"""

import logging
import math
import numbers
import warnings
from typing import Callable, Optional

import attr
import dp_accounting
import numpy as np
from dp_accounting import pld
from dp_accounting import rdp

class _ExcludedOrdersFilter(logging.Filter):
    """Replaces dp_accounting's per-order convergence warnings by one explanation.

    For large sampling probabilities the RDP accountant's series for some
    fractional orders does not converge; it warns ("_compute_log_a_frac
    failed to converge ... Excluding this order") once per order and per
    composition, hundreds of lines in a short run. Excluding an order can
    only make epsilon larger (epsilon is a minimum over the remaining
    orders), so the result stays a valid upper bound. This filter drops those
    lines and logs that explanation once per process.
    """

    _MESSAGE = "_compute_log_a_frac failed to converge"

    def __init__(self):
        super().__init__()
        self.explained = False

    def filter(self, record):
        if self._MESSAGE not in record.getMessage():
            return True
        if not self.explained:
            self.explained = True
            logging.getLogger(__name__).info(
                "RDP accountant: some fractional orders did not converge at this sampling "
                "probability and were left out; that can only make epsilon larger, so it "
                "stays a valid upper bound.")
        return False


logging.getLogger("absl").addFilter(_ExcludedOrdersFilter())

ACCOUNTANTS = ("rdp", "pld")

# Interval of the discretised privacy loss for the PLD accountant (see the
# module docstring for the accuracy / runtime trade-off).
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3

# The PLD accountant's memory and time grow with the number of composed
# mechanisms (2026-11-23, 2-core CPU, q = 0.034, sigma = 1.93: 10^7 steps take
# 3.4 s and 0.3 GB, 10^8 take 23 s and 1.9 GB, 10^9 ran out of time). No DP
# training run comes near 10^7 steps; beyond, use RDP.
PLD_MAX_COMPOSITIONS = 10**7

# The PLD of a Gaussian mechanism has about (1 / noise_multiplier^2) /
# PLD_VALUE_DISCRETIZATION_INTERVAL privacy-loss points, each computed in Python
# (2026-11-27, 2-core CPU: at 0.05 one step takes 2 s and 10^5 steps at q = 0.004
# take 45 s and 4.9 GB; at 0.01, 25 times the points, nothing came in 120 s). Below
# this floor the PLD accountant refuses; RDP costs the same at any noise. Epsilon is in
# the hundreds or more there (0.05, one step, q = 1: 284), no privacy guarantee.
PLD_MIN_NOISE_MULTIPLIER = 0.05

# The PLD's grid grows with both: compositions / noise_multiplier^2 at most this. 0.05 for
# 10^5 steps (4e7: 45 s, 4.9 GB) passes; 0.06 for 10^6 steps (2.8e8) tried to allocate
# 31.5 GiB and is refused.
PLD_MAX_COST = 5e7

# epsilon_of_event's results, keyed by (accountant, delta, `_exact_key(event)`): the
# accountants are deterministic, and a run's report, its checkpoint record and its checks ask
# for the same epsilon several times (about 0.2 s each for RDP).
_EPSILONS = {}
_MAX_CACHED = 4096


def _exact_key(value):
    """A hashable key equal only for equal events; None if a leaf is not a plain number.

    Walks attrs classes (dp_accounting's DpEvents) field by field, lists and tuples;
    leaves must be Python or NumPy scalars (bool, int, float: compared exactly) or
    strings. Not `repr`: a 0-d array prints to 8 digits (or fewer, under the user's
    print options), and a user's event class may leave fields out of its repr.
    """
    if value is None or isinstance(value, (bool, str)):
        return (type(value).__name__, value)
    if isinstance(value, (numbers.Integral, float, np.floating)) and np.ndim(value) == 0 \
            and not isinstance(value, np.ndarray):
        return ("number", float(value).hex() if isinstance(value, (float, np.floating))
                else int(value))
    if isinstance(value, (list, tuple)):
        keys = tuple(_exact_key(v) for v in value)
        return None if any(k is None for k in keys) else ("seq", keys)
    if attr.has(type(value)):
        fields = attr.fields(type(value))
        keys = tuple(_exact_key(getattr(value, f.name)) for f in fields)
        if any(k is None for k in keys):
            return None
        return (type(value).__module__, type(value).__qualname__,
                tuple(f.name for f in fields), keys)
    return None


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# Where dp_accounting's RDP and PLD arithmetic stays finite (1e-300 divides by zero, 1e300
# overflows); every useful sigma is well inside.
NOISE_MULTIPLIER_RANGE = (1e-100, 1e100)


def validate_privacy_params(
    *,
    noise_multiplier: Optional[float] = None,
    sampling_prob: Optional[float] = None,
    delta: Optional[float] = None,
    num_examples: Optional[int] = None,
    num_steps: Optional[int] = None,
) -> None:
    """Checks the DP-SGD privacy parameters that are given (None = unchecked).

    Args:
      noise_multiplier: noise std divided by l2_clip_norm (dimensionless);
        must be finite and > 0.
      sampling_prob: Poisson sampling probability q = batch_size / num_examples;
        must be in (0, 1].
      delta: the delta of (epsilon, delta)-DP; must be in (0, 1).
      num_examples: number of training examples N (the unit of privacy is one
        example); must be an integer >= 1. When given together with `delta`,
        delta >= 1/N triggers a warning.
      num_steps: optimizer updates, not epochs; must be an integer >= 1.

    Raises:
      ValueError: if a given value is out of range; the message names the value
        and says how to fix it.

    Warns:
      UserWarning: if delta >= 1 / num_examples: How to DP-fy ML (Ponomareva et
        al. 2023, Sec. 5.3.2, "Convention for setting delta") asks for
        delta << 1/N, e.g. delta = 1/N^1.1.
    """
    if noise_multiplier is not None:
        if not (
            isinstance(noise_multiplier, numbers.Real)
            and math.isfinite(noise_multiplier)
            and noise_multiplier > 0
        ):
            raise ValueError(
                f"noise_multiplier must be a finite number > 0, got "
                f"{noise_multiplier!r}. It is the noise std divided by l2_clip_norm "
                f"(dimensionless); 0 would mean no noise and no privacy."
            )
        low, high = NOISE_MULTIPLIER_RANGE
        if not low <= noise_multiplier <= high:
            raise ValueError(
                f"noise_multiplier={noise_multiplier!r} is outside [{low:g}, {high:g}], where "
                "the accountant's arithmetic (sigma^2 and 1/sigma^2) over- or underflows. "
                "Useful values are about 0.3 to 50; give one in the range."
            )
    if sampling_prob is not None:
        if not (isinstance(sampling_prob, numbers.Real) and 0 < sampling_prob <= 1):
            raise ValueError(
                f"sampling_prob must be in (0, 1], got {sampling_prob!r}. It is the "
                f"Poisson sampling probability q = batch_size / num_examples."
            )
    if delta is not None:
        if not (isinstance(delta, numbers.Real) and 0 < delta < 1):
            raise ValueError(
                f"delta must be in (0, 1), got {delta!r}. Use delta << 1/num_examples"
                f", e.g. 1e-5 for 50,000 examples."
            )
    if num_examples is not None:
        if not (_is_integer(num_examples) and num_examples >= 1):
            raise ValueError(f"num_examples must be an integer >= 1, got {num_examples!r}.")
    if num_steps is not None:
        if not (_is_integer(num_steps) and num_steps >= 1):
            raise ValueError(
                f"num_steps must be an integer >= 1 (optimizer updates, not epochs),"
                f" got {num_steps!r}."
            )
    if delta is not None and num_examples is not None:
        if delta >= 1 / num_examples:
            warnings.warn(
                f"delta={delta:g} >= 1/num_examples={1 / num_examples:.3g}: How to "
                f"DP-fy ML (Ponomareva et al. 2023, Sec. 5.3) asks for delta << 1/N,"
                f" e.g. 1/N^1.1 = {num_examples**-1.1:.3g}.",
                UserWarning,
                stacklevel=2,
            )


def sampling_prob_from(batch_size: float, num_examples: int) -> float:
    """Returns the Poisson sampling probability q = batch_size / num_examples.

    Args:
      batch_size: expected logical batch size B (examples per optimizer update,
        before augmult); must be > 0 and <= num_examples.
      num_examples: number of training examples N; integer >= 1.

    Returns:
      q = B / N, a float in (0, 1].

    Raises:
      ValueError: if num_examples is not an integer >= 1, if batch_size <= 0 or
        if batch_size > num_examples.
    """
    validate_privacy_params(num_examples=num_examples)
    if not (
        isinstance(batch_size, numbers.Real) and not isinstance(batch_size, bool) and batch_size > 0
    ):
        raise ValueError(f"batch_size must be a number > 0, got {batch_size!r}.")
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size={batch_size} is larger than num_examples={num_examples}: "
            f"the sampling probability q = batch_size / num_examples would exceed "
            f"1. Lower batch_size or check num_examples."
        )
    return batch_size / num_examples


def _validate_accountant(accountant: str) -> str:
    name = accountant.lower() if isinstance(accountant, str) else accountant
    if name not in ACCOUNTANTS:
        raise ValueError(f"Unknown accountant {accountant!r}; use one of {ACCOUNTANTS}.")
    return name


def _accountant_factory(accountant: str) -> Callable[[], dp_accounting.PrivacyAccountant]:
    """Returns a callable that builds a fresh, empty accountant.

    The PLD accountant refuses events of more than PLD_MAX_COMPOSITIONS
    mechanisms (`_BoundedPLDAccountant`).
    """
    name = _validate_accountant(accountant)
    if name == "rdp":
        return rdp.RdpAccountant
    return _BoundedPLDAccountant


def compositions(event: dp_accounting.DpEvent) -> int:
    """How many elementary mechanisms `event` composes (SelfComposed counts multiply)."""
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.count * compositions(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum(compositions(e) for e in event.events)
    return 1


class _BoundedPLDAccountant(pld.PLDAccountant):
    """`PLDAccountant` that refuses work it could not finish.

    Raises:
      ValueError: from `compose` when the event composes more than
        PLD_MAX_COMPOSITIONS mechanisms, or holds a Gaussian mechanism with a
        noise multiplier below PLD_MIN_NOISE_MULTIPLIER, or more compositions
        over the smallest noise multiplier squared than PLD_MAX_COST; the
        message suggests RDP.
    """

    def __init__(self):
        super().__init__(value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)

    def compose(self, event, count=1):
        total = compositions(event) * count
        if total > PLD_MAX_COMPOSITIONS:
            raise ValueError(
                f"The PLD accountant would compose {total:,} mechanisms, more than its limit "
                f"of {PLD_MAX_COMPOSITIONS:,} (its memory grows with the count: 10^8 steps "
                "took 1.9 GB, 10^9 did not finish). Use the RDP accountant (--accountant rdp, "
                "or accountant = 'rdp'), which costs the same for any step count.")
        # (A noise multiplier of 0 is no privacy, epsilon = inf, which PLD gives at once.)
        smallest = min((s for s in _noise_multipliers(event) if s > 0), default=math.inf)
        if smallest < PLD_MIN_NOISE_MULTIPLIER:
            raise ValueError(
                f"noise_multiplier {smallest:g} is below {PLD_MIN_NOISE_MULTIPLIER:g}, the "
                "smallest the PLD accountant takes: its grid of privacy losses grows as "
                "1 / noise_multiplier^2 (at 0.05 one step takes 2 s; at 0.01 nothing came in "
                "120 s), and epsilon at such noise is in the hundreds or more, no privacy "
                "guarantee. Use the RDP accountant (--accountant rdp, or accountant = 'rdp'), "
                "an upper bound that costs the same at any noise.")
        cost = total / smallest**2
        if cost > PLD_MAX_COST:
            raise ValueError(
                f"The PLD accountant would compose {total:,} mechanisms at noise_multiplier "
                f"{smallest:g}: steps / noise_multiplier^2 = {cost:.3g}, above its limit of "
                f"{PLD_MAX_COST:g} (its grid of privacy losses grows with both: 0.06 for "
                "10^6 steps tried to allocate 31.5 GiB). Use the RDP accountant "
                "(--accountant rdp, or accountant = 'rdp'), which costs the same for any.")
        return super().compose(event, count)


def _noise_multipliers(event):
    """The noise multipliers of the Gaussian mechanisms inside `event`."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        yield event.noise_multiplier
    elif isinstance(event, dp_accounting.ComposedDpEvent):
        for e in event.events:
            yield from _noise_multipliers(e)
    elif isinstance(getattr(event, "event", None), dp_accounting.DpEvent):  # self-composed,
        yield from _noise_multipliers(event.event)  # Poisson-sampled, sampled with(out) ...


def dp_sgd_event(
    *, noise_multiplier: float, sampling_prob: float, num_steps: int
) -> dp_accounting.DpEvent:
    """Returns the DpEvent of `num_steps` Poisson-sampled Gaussian DP-SGD steps.

    The event is `SelfComposedDpEvent(PoissonSampledDpEvent(q,
    GaussianDpEvent(noise_multiplier)), num_steps)`, to be accounted under the
    add-or-remove-one relation (De et al. 2022, App. A.1, Algorithm 1; How to
    DP-fy ML, Sec. 5.3.1).

    Args:
      noise_multiplier: noise std divided by l2_clip_norm (dimensionless), > 0.
      sampling_prob: Poisson sampling probability q = batch_size / num_examples,
        in (0, 1].
      num_steps: optimizer updates (not epochs), integer >= 1.

    Returns:
      A `dp_accounting.SelfComposedDpEvent`.

    Raises:
      ValueError: if a parameter is out of range (see
        `validate_privacy_params`).
    """
    validate_privacy_params(
        noise_multiplier=noise_multiplier, sampling_prob=sampling_prob, num_steps=num_steps
    )
    return _dp_sgd_event(noise_multiplier, sampling_prob, num_steps)


def _dp_sgd_event(noise_multiplier, sampling_prob, num_steps, extra_events=()):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            float(sampling_prob), dp_accounting.GaussianDpEvent(float(noise_multiplier))
        ),
        int(num_steps),
    )
    if extra_events:
        event = dp_accounting.ComposedDpEvent([event, *extra_events])
    return event


def gaussian_composition_event(
    *, noise_multiplier: float, count: int
) -> dp_accounting.DpEvent:
    """Returns the DpEvent of `count` Gaussian mechanisms without subsampling.

    Used for fixed-size shuffled batches, where no amplification by sampling
    is claimed: each example sits in at most one batch per epoch, so a run is
    at most `count` = epochs-touched Gaussian mechanisms on any one example
    (`tfdp.accounting.DPMechanism`). The noise multiplier is the noise std
    divided by the L2 sensitivity of the adjacency that is claimed.

    Args:
      noise_multiplier: noise std / sensitivity (dimensionless), > 0.
      count: how many times one example can be used, integer >= 1.

    Returns:
      `SelfComposedDpEvent(GaussianDpEvent(noise_multiplier), count)`.

    Raises:
      ValueError: if a parameter is out of range.
    """
    validate_privacy_params(noise_multiplier=noise_multiplier, num_steps=count)
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(float(noise_multiplier)), int(count))


def compose_events(events) -> dp_accounting.DpEvent:
    """One event for several on the same data (a single event is returned as is)."""
    events = list(events)
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)


def epsilon_of_event(
    event: dp_accounting.DpEvent, *, delta: float, accountant: str = "rdp"
) -> float:
    """Returns the epsilon of any `dp_accounting.DpEvent` at the given delta.

    Args:
      event: the DpEvent to account for (for example from `dp_sgd_event`, or a
        `ComposedDpEvent` of several runs, see `tfdp.accounting.ledger`).
      delta: the delta of (epsilon, delta)-DP, in (0, 1).
      accountant: "rdp" (RdpAccountant, default orders) or "pld"
        (PLDAccountant, value_discretization_interval =
        PLD_VALUE_DISCRETIZATION_INTERVAL); see the module docstring.

    Returns:
      epsilon as a Python float (math.inf for a non-private event).

    Raises:
      ValueError: if delta is out of range, the accountant is unknown, or the
        accountant does not support the event.
    """
    validate_privacy_params(delta=delta)
    event_key = _exact_key(event)
    key = None if event_key is None else (accountant, delta, event_key)
    if key in _EPSILONS:
        return _EPSILONS[key]
    acc = _accountant_factory(accountant)()
    if not acc.supports(event):
        raise ValueError(
            f"The {accountant!r} accountant does not support the event {event}; "
            f"use one of {ACCOUNTANTS} that supports it."
        )
    epsilon = float(acc.compose(event).get_epsilon(delta))
    if key is not None and len(_EPSILONS) < _MAX_CACHED:
        _EPSILONS[key] = epsilon
    return epsilon


def compute_epsilon(
    *,
    noise_multiplier: float,
    sampling_prob: float,
    num_steps: int,
    delta: float,
    accountant: str = "rdp",
    extra_events=(),
) -> float:
    """Returns epsilon of DP-SGD with Poisson sampling (add-or-remove-one).

    Golden value: De et al. 2022, App. C.5, Table 14 (NF-ResNet-50 on ImageNet,
    sigma = 2.5, B = 16384, N = 1,271,167, 71589 steps, delta = 8e-7,
    epsilon = 8):

    >>> round(compute_epsilon(noise_multiplier=2.5,
    ...                       sampling_prob=16384 / 1271167,
    ...                       num_steps=71589, delta=8e-7), 2)
    8.0

    Args:
      noise_multiplier: noise std divided by l2_clip_norm (dimensionless), > 0.
      sampling_prob: q = batch_size / num_examples, in (0, 1].
      num_steps: optimizer updates (not epochs), integer >= 1.
      delta: the delta of (epsilon, delta)-DP, in (0, 1).
      accountant: "rdp" or "pld" (see the module docstring).
      extra_events: other `dp_accounting.DpEvent`s on the same data composed
        with the training run, e.g. private data normalization (Tramer &
        Boneh 2021, App. B: two `GaussianDpEvent`s).

    Returns:
      epsilon (float).

    Raises:
      ValueError: if a parameter is out of range or the accountant is unknown.
    """
    validate_privacy_params(
        noise_multiplier=noise_multiplier,
        sampling_prob=sampling_prob,
        num_steps=num_steps,
        delta=delta,
    )
    return epsilon_of_event(
        _dp_sgd_event(noise_multiplier, sampling_prob, num_steps, extra_events),
        delta=delta,
        accountant=accountant,
    )


def data_normalization_dp_event(noise_multiplier):
    """Returns the `dp_accounting` event of `private_channel_mean_and_var`.

    Two Gaussian mechanisms with the same noise multiplier (Tramer & Boneh
    2021, App. B, Claim B.5), run once on the full data set (no sampling).
    Compose it with the DP-SGD event, e.g.
    `dp_accounting.ComposedDpEvent([data_normalization_dp_event(s), sgd_event])`.

    Args:
      noise_multiplier: sigma_norm > 0 (noise std / clipping norm).

    Returns:
      Two `GaussianDpEvent(noise_multiplier)` (`gaussian_composition_event`).

    Raises:
      ValueError: if noise_multiplier <= 0 (no finite privacy guarantee).
    """
    if not noise_multiplier > 0:
        raise ValueError(
            f"data_normalization_dp_event: noise_multiplier={noise_multiplier!r} must be "
            "> 0; with 0 the released statistics are not private."
        )
    return gaussian_composition_event(noise_multiplier=noise_multiplier, count=2)
