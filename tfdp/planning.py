"""Stage 1, the plan: what a run samples and trains, fixed before any I/O.

A private run's plan is its `tfdp.accounting.DPMechanism` (sigma calibrated,
the target-epsilon cap, static-batch truncation); a non-private run's is a
`NonPrivatePlan`: the same sampling facts (N, B, T, the sampler, the static
batch), and no privacy fact at all. The sampler, the model's step, the
checkpoint's privacy record and the report read these values from the plan only.
"""

import dataclasses
import math

import tensorflow as tf
from absl import logging

from tfdp import accounting
from tfdp import data
from tfdp.training import distribute

# A non-private run's static batch: the truncation probability over the run, <= this.
NON_PRIVATE_MAX_TRUNCATION = 1e-6


@dataclasses.dataclass(frozen=True)
class NonPrivatePlan:
    """What a non-private run (`privacy=None`) samples and trains: no privacy facts at all.

    It stands where a private run's `DPMechanism` stands for the data and
    training stages (the sampler, padding, the step count); it has no noise,
    clip norm, delta or epsilon, and nothing accounts for it.

    Attributes:
      num_examples: N of the training split (checked against the data).
      batch_size: B, the expected (Poisson) or fixed (shuffle) logical batch.
      num_steps: optimizer updates.
      sampling: "poisson" or "shuffle" (`tfdp.data.train_batches`).
      truncation: None, or the `tfdp.accounting.Truncation` of static batches.
      unused_privacy_settings: {name: value} of the privacy settings given
        but not used.

    Raises:
      ValueError: N, B or T not a positive int, B > N, or an unknown sampling.
    """

    num_examples: int
    batch_size: int
    num_steps: int
    sampling: str = "poisson"
    truncation: object = None
    unused_privacy_settings: dict = dataclasses.field(default_factory=dict)
    data_normalization = None  # the private release; refused without privacy

    def __post_init__(self):
        for name in ("num_examples", "batch_size", "num_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.batch_size > self.num_examples:
            raise ValueError(f"batch_size={self.batch_size} is larger than num_examples="
                             f"{self.num_examples}. Lower BATCH_SIZE or check NUM_EXAMPLES.")
        if self.sampling not in accounting.SAMPLING_SCHEMES:
            raise ValueError(f"Unknown sampling scheme {self.sampling!r}; use one of "
                             f"{accounting.SAMPLING_SCHEMES}.")

    @property
    def sampling_prob(self):
        return self.batch_size / self.num_examples


def plan_private(config, strategy):
    """The run's `DPMechanism` (`tfdp.accounting.plan_mechanism`), truncation included.

    Args:
      config: the `tfdp.configs.RunConfig` (its `privacy` is set).
      strategy: the tf.distribute strategy (replicas R for the static batch).

    Raises:
      ValueError: from `plan_mechanism` (invalid or inconsistent privacy
        values) or `truncation`.
    """
    mechanism = private_mechanism(config.privacy, config.optimization,
                                  num_examples=config.data.num_examples)
    return dataclasses.replace(mechanism, truncation=truncation(
        config.runtime.static_batch_size, mechanism, strategy,
        config.optimization.accumulation_steps))


def private_mechanism(privacy, optimization, *, num_examples):
    """The `DPMechanism` of a `PrivacyConfig` and an `OptimizationConfig` over N examples.

    The one place the settings become `tfdp.accounting.plan_mechanism`'s
    arguments, for the trainer (`plan_private`) and `tfdp.make_private`
    alike; no static-batch truncation.

    Args:
      privacy: the `tfdp.configs.PrivacyConfig`.
      optimization: the `tfdp.configs.OptimizationConfig`.
      num_examples: N, the training examples.

    Raises:
      ValueError: from `plan_mechanism` (invalid or inconsistent privacy values).
    """
    return accounting.plan_mechanism(
        num_examples=num_examples, batch_size=optimization.batch_size,
        num_steps=optimization.num_steps, l2_clip_norm=privacy.l2_clip_norm,
        target_delta=privacy.target_delta, noise_multiplier=privacy.noise_multiplier,
        target_epsilon=privacy.target_epsilon, accountant=privacy.accountant,
        sampling=optimization.sampling, normalize_update=privacy.normalize_update,
        num_microbatches=privacy.num_microbatches,
        data_normalization=privacy.data_normalization, fixed_seeds=privacy.fixed_seeds)


def plan_non_private(config, strategy, unused):
    """The `NonPrivatePlan`, and a warning that lists the privacy settings given but not used.

    Args:
      config: the `tfdp.configs.RunConfig` (its `privacy` is None).
      strategy: the tf.distribute strategy.
      unused: {name: value} of the privacy settings the config gives.

    Raises:
      ValueError: an invalid N, B, T, sampling or static_batch_size.
    """
    optimization = config.optimization
    plan = NonPrivatePlan(num_examples=config.data.num_examples,
                          batch_size=optimization.batch_size, num_steps=optimization.num_steps,
                          sampling=optimization.sampling, unused_privacy_settings=unused)
    plan = dataclasses.replace(plan, truncation=truncation(
        config.runtime.static_batch_size, plan, strategy, optimization.accumulation_steps))
    logging.warning(
        "NOT PRIVATE: privacy=None trains without clipping, noise or accounting (mean loss "
        "over each realized batch); no privacy report is written, NOT_PRIVATE.{json,md} "
        "stands in its place.%s",
        (" Privacy settings given but NOT used: "
         + ", ".join(f"{k}={v!r}" for k, v in sorted(unused.items()))
         + ". The optimizer settings were tuned for clipped (and, with normalize_update, "
         "rescaled) gradients: without clipping the same learning rate can be far too large."
         ) if unused else "")
    return plan


def truncation(static_batch_size, plan, strategy, accumulation_steps):
    """Resolves `static_batch_size` into the plan's `Truncation` (`tfdp.data.padding`).

    A private plan (`DPMechanism`) bounds eta, the probability that any
    step's Poisson batch exceeded the cap S, so that it adds at most delta / 10
    to delta ("auto") or refuses an S that adds more than delta. A
    `NonPrivatePlan` has no delta: "auto" takes the smallest S whose eta over
    the run is <= NON_PRIVATE_MAX_TRUNCATION, so a batch is almost never cut.

    Returns:
      None (variable batches), or a `tfdp.accounting.Truncation` with the
      static logical batch S and eta.

    Raises:
      ValueError: on an invalid value, None under a TPU strategy, an S that
        is not a multiple of replicas * accumulation_steps, an S below the
        fixed batch size of shuffled sampling, or (private) an S whose
        truncation term exceeds delta.
    """
    private = isinstance(plan, accounting.DPMechanism)
    if static_batch_size is None:
        if isinstance(strategy, tf.distribute.TPUStrategy):
            raise ValueError(
                "strategy 'tpu' needs static batch shapes: set "
                "tfdp.RuntimeConfig.static_batch_size = 'auto' (or an int)"
                + ("; the truncation bound is then stated in the privacy report." if private
                   else "."))
        return None
    num_replicas = strategy.num_replicas_in_sync
    unit = num_replicas * int(accumulation_steps)
    if private:  # the accountant's final epsilon bounds every intermediate one
        epsilon = plan.epsilon()
        max_eta = plan.delta / 10.0 / (1.0 + math.exp(min(epsilon, 700.0)))
    else:
        max_eta = NON_PRIVATE_MAX_TRUNCATION
    if static_batch_size == "auto":
        if plan.sampling == "poisson":
            size = data.choose_static_batch_size(plan.num_examples, plan.sampling_prob,
                                                 plan.num_steps, max_eta, multiple=unit)
        else:
            size = -(-plan.batch_size // unit) * unit
    elif isinstance(static_batch_size, int) and not isinstance(static_batch_size, bool):
        size = static_batch_size
    else:
        raise ValueError(
            f"static_batch_size must be None, a positive int or 'auto', got {static_batch_size!r}.")
    if plan.sampling != "poisson" and size < plan.batch_size:
        raise ValueError(
            f"static_batch_size={size} is below the fixed batch size {plan.batch_size} of "
            "shuffled batches; use 'auto' or at least the batch size.")
    per_replica = distribute.per_replica_batch_size(size, num_replicas, accumulation_steps)
    eta = (data.truncation_probability(plan.num_examples, plan.sampling_prob, size,
                                       plan.num_steps) if plan.sampling == "poisson" else 0.0)
    if private and plan.sampling == "poisson":
        _check_truncation(plan, size, eta, epsilon, max_eta, unit)
    logging.info("Static logical batch %d = %d replicas x %d chunks x %d slots; truncation "
                 "probability <= %.3g (%s).", size, num_replicas, accumulation_steps,
                 per_replica // int(accumulation_steps), eta,
                 "the cap is on the logical batch" if private else "no privacy depends on it")
    return accounting.Truncation(static_batch_size=size, per_replica_batch_size=per_replica,
                                 num_replicas=num_replicas, truncation_probability=eta,
                                 accumulation_steps=int(accumulation_steps))


def _check_truncation(mechanism, size, eta, epsilon, max_eta, unit):
    """Refuses a cap whose truncation adds more than delta; warns above delta / 10."""
    added = data.delta_with_truncation(0.0, epsilon, eta)
    if added > mechanism.delta:
        suggested = data.choose_static_batch_size(
            mechanism.num_examples, mechanism.sampling_prob, mechanism.num_steps, max_eta,
            multiple=unit)
        raise ValueError(
            f"static_batch_size={size} truncates Poisson batches (expected size "
            f"{mechanism.batch_size}) too often: with probability <= {eta:.3g} over "
            f"{mechanism.num_steps} steps, which would add (1 + e^epsilon) * {eta:.3g} = "
            f"{added:.3g} to delta={mechanism.delta:g}. Use static_batch_size='auto' "
            f"({suggested} here) or at least that.")
    if added > mechanism.delta / 10:
        logging.warning("static_batch_size=%d adds %.3g to delta=%g (truncation).",
                        size, added, mechanism.delta)
