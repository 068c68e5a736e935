"""DPMechanism: every privacy fact of a run, in one frozen object.

A tfdp run releases the result of one mechanism: per-example (or
per-microbatch) clipping, a sum over a sampled logical batch, Gaussian noise
once per logical batch, `num_steps` times; possibly composed with a private
data normalization released once before training. `DPMechanism` holds what
defines it, validates it once in its constructor, and derives everything
else from it:

| consumer                          | reads                                   |
|-----------------------------------|-----------------------------------------|
| DPModel (noise, clip, division)   | `l2_clip_norm`, `noise_stddev()`,       |
|                                   | `update_divisor`, `num_microbatches`    |
| the accountant and calibration    | `dp_event()`, `epsilon()`, `guarantee()`|
| the checkpoint and resume check   | `to_dict()`, `differences()`            |
| the study ledger                  | `to_dict()` / `from_dict()`             |
| the privacy report                | all of the above                        |

None of them recomputes a sensitivity, a noise std or an event.

Sensitivity (the L2 distance between the clipped sums of two adjacent logical
batches, in the units the noise is added in):

| sampling | adjacency           | per-example   | microbatches     |
|----------|---------------------|---------------|------------------|
| poisson  | add-or-remove one   | C             | 2C               |
| shuffle  | replace one         | 2C            | 2C               |

With `normalize_update` (De et al. 2022, eq. (3)) every C above is 1.

* Per-example, add-or-remove: one clipped vector of norm <= C appears or
  disappears (Abadi et al. 2016).
* Microbatches (How to DP-fy ML, Ponomareva et al. 2023, Sec. 5.6): the
  clipped MEAN of each microbatch is summed. Each example's microbatch is an
  i.i.d. uniform draw, independent of the data and of its position in the
  batch, and the microbatch sums are accumulated over every chunk and
  replica before clipping (`tfdp.training.DPModel`), so the sum depends only
  on the multiset of (example, microbatch) pairs. Couple the draws of the
  shared examples of two adjacent batches: only the added example's
  microbatch changes, from a clipped mean v to v', |v - v'| <= 2C.
* Shuffled fixed-size batches: adding an example would shift every later
  batch, so the only adjacency they support is replacing one example by
  another. The batch that holds it changes by clip(x) - clip(x'), norm
  <= 2C; replacing an example inside a microbatch changes that microbatch's
  clipped mean by <= 2C too.

The noise std per logical batch is always `noise_multiplier * sensitivity`,
so the accountant's Gaussian has noise multiplier `noise_multiplier` in both
columns (De et al. 2022, App. A.1, Algorithm 1).

The DP event (`dp_event`):

* poisson: T self-compositions of the Poisson-subsampled Gaussian with
  q = B / N, under add-or-remove (the relation Poisson sampling amplifies;
  How to DP-fy ML, Sec. 5.3.1).
* shuffle: no amplification is claimed. Epoch e takes floor(N / B) batches
  of one permutation, so an example is in at most one batch per epoch, and a
  run of T steps touches E = ceil(T / floor(N / B)) epochs: the event is E
  Gaussian mechanisms (an upper bound under replace-one adjacency).
* private data normalization (Tramer & Boneh 2021, App. B): two Gaussian
  mechanisms with noise multiplier sigma_norm, composed once (sigma_norm / 2
  under replace-one, whose sensitivity is twice the clip norm).

Static batches truncate Poisson batches to a cap (`Truncation`); the run is
then (epsilon, delta + (1 + e^epsilon) eta)-DP with eta the probability that
any step was truncated (Chua et al. 2024, arXiv:2411.04205): `guarantee()`.

Pure Python over `dp_accounting`: no TensorFlow import.
"""

import dataclasses
import functools
import math
import numbers
import warnings
from typing import Any, Dict, List, Optional, Tuple

from tfdp.accounting import accountant as accountant_lib
from tfdp.accounting import calibration

SAMPLING_SCHEMES = ("poisson", "shuffle")
ADD_OR_REMOVE = "add-or-remove one example"
REPLACE_ONE = "replace one example"

# `calibrated`'s noise multipliers, keyed by (repr(mechanism), target_epsilon): the search
# (about 2 s for RDP) is deterministic, and a process that plans the same run again (a
# resume check, a study's runs, the tests' smoke runs) need not repeat it.
_CALIBRATED = {}

# The fields whose values define the mechanism, or what its guarantee
# assumes (which seeds are secret): a checkpoint written under other values
# cannot be resumed (`differences`). num_steps may grow on resume;
# target_epsilon and how sigma was found do not change the mechanism.
_MECHANISM_FIELDS = (
    "num_examples", "batch_size", "sampling", "noise_multiplier", "l2_clip_norm",
    "normalize_update", "num_microbatches", "delta", "accountant", "data_normalization",
    "truncation", "fixed_seeds",
)


# The clip norm, its noise std and every clipped sum stay normal float32 numbers.
L2_CLIP_NORM_RANGE = (1e-30, 1e30)


def _positive_number(name, value, *, integer=False):
    kind = numbers.Integral if integer else numbers.Real
    if (not isinstance(value, kind) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        what = "an integer >= 1" if integer else "a finite number > 0"
        raise ValueError(f"{name} must be {what}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class DataNormalization:
    """Tramer & Boneh 2021, App. B: private per-channel mean and variance.

    Attributes:
      noise_multiplier: sigma_norm, noise std / clip norm of both releases.
      l2_clip_norm_mean: C1, the clip norm of each example's channel means.
      l2_clip_norm_square: C2, the clip norm of its channel mean squares.
      threshold: tau >= 0, the lower bound of the released variance.

    Raises:
      ValueError: on a non-positive sigma_norm, C1 or C2, or a negative tau.
    """

    noise_multiplier: float
    l2_clip_norm_mean: float
    l2_clip_norm_square: float
    threshold: float

    def __post_init__(self):
        for name in ("noise_multiplier", "l2_clip_norm_mean", "l2_clip_norm_square"):
            _positive_number(f"data_normalization {name}", getattr(self, name))
        if not (isinstance(self.threshold, numbers.Real) and self.threshold >= 0):
            raise ValueError(
                f"data_normalization threshold must be >= 0, got {self.threshold!r}.")

    @classmethod
    def from_config(cls, config) -> Optional["DataNormalization"]:
        """From the gin dict `{'noise_multiplier': ..., 'l2_clip_norm_mean': ..., ...}`.

        Raises:
          ValueError: on a missing or unknown key (naming it).
        """
        if config is None or isinstance(config, cls):
            return config
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(config) - set(fields))
        missing = [f for f in fields if f not in config]
        if unknown or missing:
            raise ValueError(
                f"data_normalization={config!r}: unknown keys {unknown}, missing keys "
                f"{missing}; it needs exactly {fields}.")
        return cls(**{f: float(config[f]) for f in fields})


@dataclasses.dataclass(frozen=True)
class Truncation:
    """Static batch shapes: Poisson batches truncated to a cap (`tfdp.data.padding`).

    Attributes:
      static_batch_size: the cap S on a logical batch (masked slots pad it).
      per_replica_batch_size: S / R.
      num_replicas: R.
      truncation_probability: eta, an upper bound on the probability that any
        step's Poisson batch exceeded S.
      accumulation_steps: a, chunks per replica; each replica-chunk holds
        `per_chunk_batch_size` = S / (R a) slots. The cap S is on the logical
        batch (chunks are filled in order), so eta is the logical batch's.
    """

    static_batch_size: int
    per_replica_batch_size: int
    num_replicas: int
    truncation_probability: float
    accumulation_steps: int = 1

    @property
    def per_chunk_batch_size(self) -> int:
        """n = S / (R a): the static slots of one replica-chunk (one tf.data element)."""
        return self.per_replica_batch_size // self.accumulation_steps


@dataclasses.dataclass(frozen=True)
class DPMechanism:
    """The privacy facts of one DP-SGD run (see the module docstring).

    Attributes:
      num_examples: N, examples in the private training set (public).
      batch_size: B, the expected logical batch (Poisson: q = B / N), or the
        exact one (shuffle). Updates divide the noisy sum by it.
      num_steps: T, optimizer updates (logical batches, not epochs).
      noise_multiplier: sigma, the noise std divided by `sensitivity()`.
      l2_clip_norm: C, the per-example (or per-microbatch) L2 bound.
      delta: the accountant's delta; `guarantee()` adds truncation to it.
      accountant: "rdp" or "pld" (`tfdp.accounting.ACCOUNTANTS`).
      sampling: "poisson" or "shuffle" (`SAMPLING_SCHEMES`).
      normalize_update: De et al. 2022, eq. (3): clipped contributions are
        divided by C, so the sensitivity is in units of 1.
      num_microbatches: None, or M: the clipped means of M microbatches are
        summed and the noisy sum is divided by M.
      data_normalization: None, or the `DataNormalization` released once.
      truncation: None, or the `Truncation` of static batches.
      target_epsilon: the budget the run was planned for, or None.
      noise_calibrated: sigma was solved for from target_epsilon.
      steps_capped: num_steps was lowered to stay within target_epsilon.
      fixed_seeds: names of the secret seeds the user fixed ("sampling_seed",
        "noise_seed"); the report states that the guarantee then assumes
        those seeds stay secret.

    Raises:
      ValueError: on any invalid value, naming it (checked once, here).
    """

    num_examples: int
    batch_size: int
    num_steps: int
    noise_multiplier: float
    l2_clip_norm: float
    delta: float
    accountant: str = "rdp"
    sampling: str = "poisson"
    normalize_update: bool = False
    num_microbatches: Optional[int] = None
    data_normalization: Optional[DataNormalization] = None
    truncation: Optional[Truncation] = None
    target_epsilon: Optional[float] = None
    noise_calibrated: bool = False
    steps_capped: bool = False
    fixed_seeds: Tuple[str, ...] = ()

    def __post_init__(self):
        _positive_number("num_examples", self.num_examples, integer=True)
        _positive_number("batch_size", self.batch_size, integer=True)
        if self.batch_size > self.num_examples:
            raise ValueError(
                f"batch_size={self.batch_size} is larger than num_examples="
                f"{self.num_examples}: the sampling probability B / N would exceed 1. "
                "Lower BATCH_SIZE or check NUM_EXAMPLES.")
        _positive_number("num_steps", self.num_steps, integer=True)
        _positive_number("l2_clip_norm", self.l2_clip_norm)
        if not L2_CLIP_NORM_RANGE[0] <= self.l2_clip_norm <= L2_CLIP_NORM_RANGE[1]:
            raise ValueError(
                f"l2_clip_norm={self.l2_clip_norm!r} is outside [{L2_CLIP_NORM_RANGE[0]:g}, "
                f"{L2_CLIP_NORM_RANGE[1]:g}]: the clipped gradients and their noise are "
                "float32, which cannot hold such a norm. Useful values are about 0.01 to 10.")
        accountant_lib.validate_privacy_params(
            noise_multiplier=self.noise_multiplier, delta=self.delta,
            num_examples=self.num_examples)
        if self.noise_multiplier * self.l2_clip_norm > L2_CLIP_NORM_RANGE[1]:
            raise ValueError(
                f"noise_multiplier x l2_clip_norm = {self.noise_multiplier} x "
                f"{self.l2_clip_norm} is above {L2_CLIP_NORM_RANGE[1]:g}: the float32 noise "
                "would overflow. Lower noise_multiplier (useful values are about 0.3 to 50).")
        if self.accountant not in accountant_lib.ACCOUNTANTS:
            raise ValueError(f"Unknown accountant {self.accountant!r}; use one of "
                             f"{accountant_lib.ACCOUNTANTS}.")
        if self.sampling not in SAMPLING_SCHEMES:
            raise ValueError(f"Unknown sampling scheme {self.sampling!r}; use one of "
                             f"{SAMPLING_SCHEMES}.")
        if not isinstance(self.normalize_update, bool):
            raise ValueError(f"normalize_update must be True or False, got "
                             f"{self.normalize_update!r}.")
        if self.num_microbatches is not None:
            _positive_number("num_microbatches", self.num_microbatches, integer=True)
        if self.data_normalization is not None and not isinstance(
                self.data_normalization, DataNormalization):
            raise ValueError("data_normalization must be a DataNormalization "
                             "(DataNormalization.from_config(dict)) or None.")
        if self.target_epsilon is not None:
            _positive_number("target_epsilon", self.target_epsilon)
        unknown_seeds = set(self.fixed_seeds) - {"sampling_seed", "noise_seed"}
        if unknown_seeds:
            raise ValueError(f"fixed_seeds: unknown names {sorted(unknown_seeds)}.")

    # -- The noisy clipped sum ------------------------------------------------

    @property
    def sampling_prob(self) -> float:
        """q = B / N, each example's probability of joining a Poisson batch."""
        return self.batch_size / self.num_examples

    @property
    def adjacency(self) -> str:
        """The neighbouring relation the guarantee is stated for."""
        return ADD_OR_REMOVE if self.sampling == "poisson" else REPLACE_ONE

    def sensitivity(self) -> float:
        """L2 sensitivity of one logical batch's clipped sum (module docstring table).

        >>> DPMechanism(num_examples=100, batch_size=10, num_steps=1,
        ...             noise_multiplier=1.0, l2_clip_norm=0.1, delta=1e-3).sensitivity()
        0.1
        """
        base = 1.0 if self.normalize_update else float(self.l2_clip_norm)
        if self.num_microbatches or self.adjacency == REPLACE_ONE:
            return 2.0 * base
        return base

    def noise_stddev(self) -> float:
        """Std of the Gaussian noise added once to each logical batch's clipped sum.

        `noise_multiplier * sensitivity()`, in the units of the clipped sum
        (split across replicas by `tfdp.dp.noise.noise_stddev_per_replica`).
        """
        return self.noise_multiplier * self.sensitivity()

    @property
    def update_divisor(self) -> float:
        """What the noisy sum is divided by: B (public, expected), or M microbatches."""
        return float(self.num_microbatches or self.batch_size)

    @property
    def clipping_unit(self) -> str:
        return "microbatch mean" if self.num_microbatches else "example"

    # -- Accounting -----------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        """Shuffled batches: floor(N / B) batches of one permutation per epoch."""
        return self.num_examples // self.batch_size

    def participations(self, num_steps: Optional[int] = None) -> int:
        """Shuffle: the most steps one example can be in, ceil(T / floor(N / B)).

        An example is in at most one batch per epoch, and T steps touch that
        many epochs (not ceil(T B / N), which undercounts when B does not
        divide N).
        """
        steps = self.num_steps if num_steps is None else int(num_steps)
        return -(-steps // self.steps_per_epoch)

    def dp_event(self, num_steps: Optional[int] = None):
        """The `dp_accounting.DpEvent` of the run after `num_steps` (default: all).

        The one place a run's event is built (module docstring). 0 steps leave
        only the data normalization (or None when there is none).
        """
        steps = self.num_steps if num_steps is None else int(num_steps)
        events = []
        if steps > 0 and self.sampling == "poisson":
            events.append(accountant_lib.dp_sgd_event(
                noise_multiplier=self.noise_multiplier, sampling_prob=self.sampling_prob,
                num_steps=steps))
        elif steps > 0:
            events.append(accountant_lib.gaussian_composition_event(
                noise_multiplier=self.noise_multiplier, count=self.participations(steps)))
        if self.data_normalization is not None:
            # Replace-one doubles the normalization's sensitivity too.
            factor = 1.0 if self.adjacency == ADD_OR_REMOVE else 0.5
            events.append(accountant_lib.data_normalization_dp_event(
                factor * self.data_normalization.noise_multiplier))
        return accountant_lib.compose_events(events) if events else None

    @functools.lru_cache(maxsize=4096)
    def epsilon(self, num_steps: Optional[int] = None) -> float:
        """Epsilon at `delta` after `num_steps` optimizer updates (default: all)."""
        event = self.dp_event(num_steps)
        if event is None:
            return 0.0
        return accountant_lib.epsilon_of_event(event, delta=self.delta,
                                               accountant=self.accountant)

    def guarantee(self, num_steps: Optional[int] = None) -> Tuple[float, float]:
        """(epsilon, delta) the run is DP at after `num_steps`, truncation included."""
        epsilon = self.epsilon(num_steps)
        if self.truncation is None:
            return epsilon, self.delta
        eta = self.truncation.truncation_probability
        return epsilon, self.delta + (1.0 + math.exp(min(epsilon, 700.0))) * eta

    def epsilon_assuming_poisson(self, num_steps: Optional[int] = None) -> float:
        """Shuffle only: the Poisson epsilon papers often quote. NOT a guarantee."""
        poisson = dataclasses.replace(self, sampling="poisson", truncation=None)
        return poisson.epsilon(num_steps)

    # -- Planning -------------------------------------------------------------

    def calibrated(self, target_epsilon: float) -> "DPMechanism":
        """A copy whose noise_multiplier is the smallest with epsilon <= target."""
        eta = calibration._tan_eta_for(  # pylint: disable=protected-access
            target_epsilon, self.delta)
        guess = (self.sampling_prob * math.sqrt(self.num_steps / 2) / eta
                 if self.sampling == "poisson" else math.sqrt(self.participations() / 2) / eta)
        key = (repr(self), target_epsilon)  # every field, floats exactly
        sigma = _CALIBRATED.get(key)
        if sigma is None:
            sigma = calibration.solve_noise_multiplier(
                lambda s: dataclasses.replace(self, noise_multiplier=s).dp_event(),
                target_epsilon=target_epsilon, delta=self.delta, accountant=self.accountant,
                guess=guess, context=self._context())
            if len(_CALIBRATED) < 1024:
                _CALIBRATED[key] = sigma
        return dataclasses.replace(self, noise_multiplier=sigma, target_epsilon=target_epsilon,
                                   noise_calibrated=True)

    def capped(self, target_epsilon: float) -> "DPMechanism":
        """A copy whose num_steps is the largest (<= num_steps) within the target."""
        steps = calibration.solve_num_steps(
            lambda t: dataclasses.replace(self, num_steps=t).dp_event(),
            target_epsilon=target_epsilon, delta=self.delta, accountant=self.accountant,
            max_num_steps=self.num_steps, guess=self.num_steps, context=self._context())
        return dataclasses.replace(self, num_steps=steps, target_epsilon=target_epsilon,
                                   steps_capped=steps < self.num_steps)

    def _context(self):
        return (f"sampling={self.sampling!r}, sampling_prob={self.sampling_prob:.4g}, "
                f"num_steps={self.num_steps}, delta={self.delta:g}")

    # -- Records --------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-able description, for checkpoints, ledgers and reports."""
        return dataclasses.asdict(self) | {"fixed_seeds": list(self.fixed_seeds)}

    @classmethod
    def from_dict(cls, record: Dict[str, Any]) -> "DPMechanism":
        """The inverse of `to_dict` (validates again).

        Raises:
          ValueError: on unknown or invalid fields.
        """
        record = dict(record)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"Unknown DPMechanism fields {unknown}.")
        if record.get("data_normalization") is not None:
            record["data_normalization"] = DataNormalization(**record["data_normalization"])
        if record.get("truncation") is not None:
            record["truncation"] = Truncation(**record["truncation"])
        record["fixed_seeds"] = tuple(record.get("fixed_seeds", ()))
        return cls(**record)

    def differences(self, other: "DPMechanism") -> List[str]:
        """The mechanism-defining fields on which `other` differs, as readable lines.

        Compares the sampling scheme, N, B (so q), C, sigma, the sensitivity
        (normalized update, microbatches), delta, the accountant, the data
        normalization (sigma and bounds), the truncation cap and which seeds the
        user fixed; not the step count (a resumed run may run longer) nor how
        sigma was found.
        """
        lines = []
        for name in _MECHANISM_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "truncation":
                mine = mine and mine.static_batch_size
                theirs = theirs and theirs.static_batch_size
                name = "static_batch_size (truncation cap)"
            if not _same(mine, theirs):
                lines.append(f"{name}: {mine!r} vs {theirs!r}")
        return lines


def _same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return all(_same(x, y) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)))
    return a == b


def shared_sampling_seed_event(mechanisms: List[DPMechanism]):
    """The DP event of several Poisson runs that drew their batches with ONE seed.

    Runs on the same data with the same sampling seed, N and q train on the
    same batch at every step they share, so they are not independent
    subsampled mechanisms. At step t the runs still active release Gaussian
    sums of one Poisson sample: one subsampled mechanism whose base is the
    product of their Gaussians, i.e. a Gaussian with noise multiplier
    (sum_i sigma_i^-2)^(-1/2) (the privacy loss of independent Gaussians on
    the same input adds in quadrature). The steps are cut into segments by
    the runs' step counts; each segment is a self-composition. The runs' data
    normalizations (released once each, with their own noise) compose as
    usual.

    Args:
      mechanisms: the runs' `DPMechanism`s, each with `num_steps` = the steps
        it took; all Poisson, with the same N and B.

    Returns:
      A `dp_accounting.DpEvent`.

    Raises:
      ValueError: if the runs differ in sampling scheme, N or B: their
        batches are then correlated in a way no accountant here composes.
    """
    first = mechanisms[0]
    for other in mechanisms[1:]:
        if (other.sampling, other.num_examples, other.batch_size) != (
                first.sampling, first.num_examples, first.batch_size) or first.sampling != "poisson":
            raise ValueError(
                "Runs that share a fixed sampling seed must all use Poisson sampling with the "
                f"same NUM_EXAMPLES and BATCH_SIZE (got {first.sampling}/{first.num_examples}/"
                f"{first.batch_size} and {other.sampling}/{other.num_examples}/"
                f"{other.batch_size}): their batches are correlated and cannot be composed. "
                "Leave sampling_seed unset (a secret seed per run), or give each run its own.")
    events, done = [], 0
    for steps in sorted({m.num_steps for m in mechanisms}):
        active = [m for m in mechanisms if m.num_steps >= steps]
        sigma = sum(m.noise_multiplier ** -2 for m in active) ** -0.5
        events.append(accountant_lib.dp_sgd_event(
            noise_multiplier=sigma, sampling_prob=first.sampling_prob, num_steps=steps - done))
        done = steps
    for m in mechanisms:
        extra = m.dp_event(num_steps=0)
        if extra is not None:
            events.append(extra)
    return accountant_lib.compose_events(events)


def plan_mechanism(
    *,
    num_examples,
    batch_size,
    num_steps,
    l2_clip_norm,
    target_delta,
    noise_multiplier=None,
    target_epsilon=None,
    accountant="rdp",
    sampling="poisson",
    normalize_update=False,
    num_microbatches=None,
    data_normalization=None,
    fixed_seeds=(),
) -> DPMechanism:
    """Validates the gin-bound privacy values and fills in what is missing.

    * `noise_multiplier` None: it is calibrated so that `num_steps` updates
      spend at most `target_epsilon` (`DPMechanism.calibrated`).
    * both given: `num_steps` is lowered, if needed, to the largest step count
      whose epsilon is <= `target_epsilon`, so training never goes past it.

    Args:
      num_examples: N; batch_size: B (expected); num_steps: T (updates).
      l2_clip_norm: C > 0. target_delta: delta in (0, 1).
      noise_multiplier: sigma > 0, or None to calibrate.
      target_epsilon: the budget, or None (then `noise_multiplier` is needed).
      accountant: "rdp" or "pld". sampling: "poisson" or "shuffle".
      normalize_update, num_microbatches: see `DPMechanism`.
      data_normalization: None, a `DataNormalization` or its gin dict.
      fixed_seeds: names of the seeds the user fixed.

    Returns:
      The `DPMechanism`.

    Raises:
      ValueError: on an invalid value, or when neither noise_multiplier nor
        target_epsilon is given.
    """
    if noise_multiplier is None and target_epsilon is None:
        raise ValueError(
            "Neither NOISE_MULTIPLIER nor TARGET_EPSILON is set: set one of them "
            "(e.g. --gin_param=TARGET_EPSILON=3.0) so the run has a privacy budget.")
    if target_epsilon is not None:
        _positive_number("target_epsilon", target_epsilon)
    # The calibration and the cap build a DPMechanism per candidate, and each would repeat
    # the same warnings (delta >= 1/N: 16 times in one make_private call when warnings are
    # shown "always"): they are collected here and each distinct one is given once.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mechanism = DPMechanism(
            num_examples=num_examples, batch_size=batch_size, num_steps=num_steps,
            noise_multiplier=1.0 if noise_multiplier is None else noise_multiplier,
            l2_clip_norm=l2_clip_norm, delta=target_delta, accountant=accountant,
            sampling=sampling, normalize_update=normalize_update,
            num_microbatches=num_microbatches,
            data_normalization=DataNormalization.from_config(data_normalization),
            target_epsilon=target_epsilon, fixed_seeds=tuple(fixed_seeds),
        )
        if noise_multiplier is None:
            mechanism = mechanism.calibrated(target_epsilon)
        elif target_epsilon is not None:
            mechanism = mechanism.capped(target_epsilon)
    given = set()
    for warning in caught:
        key = (warning.category, str(warning.message))
        if key not in given:
            given.add(key)
            warnings.warn(warning.message, stacklevel=2)
    return mechanism


def epsilon_upper_bound(mechanism: DPMechanism, step: int, every: int = 10) -> float:
    """Epsilon at the next multiple of `every` steps at or after `step`.

    Epsilon grows with the step count, so this bounds what has been spent and
    is cheap enough for a progress bar (it is cached per multiple).
    """
    rounded = min(mechanism.num_steps, every * math.ceil(step / every)) if step > 0 else 0
    return mechanism.epsilon(max(rounded, step))
