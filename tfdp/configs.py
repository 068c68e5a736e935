"""The run's settings, grouped by concern: six small frozen dataclasses bound in gin.

Each group has one home, one docstring and one `__post_init__` that checks
it, before anything is read or written:

  `DataConfig`          what the data is: dataset, N, splits, data_dir, image size, features
  `AugmentationConfig`  augmentation, augmult views, AugTest
  `PrivacyConfig`       DP-SGD: clip, noise or target epsilon, delta, accountant, seeds, ...
                        (`tfdp.train_and_evaluate.privacy = None`: no privacy at all)
  `OptimizationConfig`  optimizer, batch size, steps, batch sampling, accumulation, EMA
  `EvaluationConfig`    how often and on how many test examples
  `RuntimeConfig`       strategy, static batches, XLA, determinism, checkpoints, display, seed

A config file binds their fields by the class's name (t5x's `DatasetConfig`
style, `t5x/utils.py`), and the trainer builds each one from gin:

    tfdp.DataConfig.dataset = "fashion_mnist"
    tfdp.OptimizationConfig.batch_size = %BATCH_SIZE
    tfdp.PrivacyConfig.l2_clip_norm = %L2_CLIP_NORM

Checks that span two groups (features without augmentation, checkpoints
that fall on evaluations, data normalization under multi-worker) are in
`check_together`. Privacy-coupled values (N, B, T, sigma, epsilon, delta, C)
stay macros in the configs, defined once; the sampler, DPModel and the
accountant read them through one `tfdp.accounting.DPMechanism`.

Settings of the first layout were arguments of `tfdp.train_and_evaluate`;
`MOVED` maps each to its new home: gin refuses such a binding as an unknown
parameter, and `moved_setting_error` adds where it lives now.

`tfdp.make_private` takes a `PrivateTrainingConfig`: the same `PrivacyConfig`
and `OptimizationConfig`, built in Python, and refuses the settings only the
trainer supports (`MAKE_PRIVATE_REFUSES`) instead of dropping them.
"""

import dataclasses
import inspect
from typing import Optional

import gin

from tfdp import augment
from tfdp import gin_bindings
from tfdp import storage
from tfdp.accounting import mechanism as mechanism_lib
from tfdp.dp.clipping import CLIPPING_PATHS


def _positive_int(name, value, fix=""):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.{fix}")


def _seed(name, value, high):
    """Refuses a seed that is not an int in [0, high], naming the setting."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= high):
        raise ValueError(f"tfdp.{name}={value!r}: a seed must be an int from 0 to {high} "
                         f"(2**{high.bit_length()} - 1).")


@gin.configurable(module="tfdp")
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What the data is.

    Attributes:
      dataset: TFDS name, e.g. "fashion_mnist" (or a JPEG folder's name,
        `tfdp.data.open_split`).
      num_examples: N, the size of the training split (the NUM_EXAMPLES
        macro); checked against the data, and what the accountant uses.
      data_dir: TFDS data_dir (None: TFDS's default, ~/tensorflow_datasets).
      train_split, test_split: TFDS split names, e.g. "train[:50000]".
      image_size: resize images to this (height, width) when loading (needed
        for ImageNet, whose images differ in size), or None.
      features: None (train on pixels) or "scatternet": the fixed ScatterNet
        features (Tramer & Boneh 2021, App. C.1) of every image, computed
        once, held in memory and cached in the workdir until the run finishes
        (`tfdp.features.cached_features`); `model_fn` builds the head on them
        and the export composes ScatterNet + head, so it still serves uint8
        images.

    Raises:
      ValueError: a num_examples that is not a positive int, or unknown features.
    """

    dataset: str = gin.REQUIRED
    num_examples: int = gin.REQUIRED
    data_dir: Optional[str] = None
    train_split: str = "train"
    test_split: str = "test"
    image_size: Optional[tuple] = None
    features: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ValueError(f"tfdp.DataConfig.dataset={self.dataset!r}: give the dataset's "
                             "name, e.g. 'fashion_mnist' (a TFDS name or a JPEG folder's).")
        _positive_int("num_examples", self.num_examples, " Set NUM_EXAMPLES to the size of "
                      "the training split.")
        if self.features not in (None, "scatternet"):
            raise ValueError(f"Unknown features {self.features!r}; use None or 'scatternet'.")


@gin.configurable(module="tfdp")
@dataclasses.dataclass(frozen=True)
class AugmentationConfig:
    """Augmentation multiplicity (De et al. 2022, Sec. 3.1) and AugTest (TAN, Sec. 4.2).

    Attributes:
      augmentation: a name in `tfdp.augment.AUGMENTATIONS`, or None.
      augmentation_kwargs: that augmentation's keyword arguments (dict), or None.
      augmult: K views per example (0: no augmentation). Sensitivity and
        epsilon do not depend on K: each example's K view gradients are
        averaged before clipping.
      augtest: also report AugTest accuracy, a majority vote over the same
        K test-time views (TAN, Sec. 4.2, Table 2).

    Raises:
      ValueError: augtest without augmult >= 1, augmentation_kwargs that no
        augmentation reads, or keywords the augmentation does not take.
    """

    augmentation: Optional[str] = None
    augmentation_kwargs: Optional[dict] = None
    augmult: int = 0
    augtest: bool = False

    def __post_init__(self):
        if isinstance(self.augmult, bool) or not isinstance(self.augmult, int) or (
                self.augmult < 0):
            raise ValueError(f"augmult must be an int >= 0, got {self.augmult!r}.")
        if self.augtest and self.augmult < 1:
            raise ValueError("augtest needs an augmentation and augmult >= 1 (the K views).")
        if self.augmentation_kwargs and self.augmentation in (None, "none"):
            raise ValueError(
                f"augmentation_kwargs={self.augmentation_kwargs!r} with augmentation="
                f"{self.augmentation!r}: no augmentation reads them (augmult's views are then "
                "the images themselves), so the run would drop them. Set an augmentation "
                "(tfdp.AugmentationConfig.augmentation, one of "
                f"{sorted(set(augment.AUGMENTATIONS) - {'none'})}), or remove them.")
        if self.active:  # the keywords, checked as the input stage uses them
            self.augment_fn()

    @property
    def active(self):
        """Whether training views are augmented (augmult > 0 or an augmentation is named)."""
        return self.augmult > 0 or self.augmentation is not None

    def augment_fn(self):
        """The augmentation function, or None when not `active` (`tfdp.augment.get_augmentation`)."""
        if not self.active:
            return None
        return augment.get_augmentation(self.augmentation or "none",
                                        **(self.augmentation_kwargs or {}))


@gin.configurable(module="tfdp")
@dataclasses.dataclass(frozen=True)
class PrivacyConfig:
    """DP-SGD's settings (Abadi et al. 2016; De et al. 2022, Algorithm 1).

    A non-private run has none: `tfdp.train_and_evaluate.privacy = None`.
    The numbers are validated when the mechanism is planned
    (`tfdp.accounting.plan_mechanism`), which also calibrates sigma.

    Attributes:
      l2_clip_norm: C, the per-example L2 bound (required).
      target_delta: delta at which epsilon is reported (required).
      noise_multiplier: sigma (noise std / sensitivity, dimensionless), or
        None to calibrate it to target_epsilon.
      target_epsilon: the budget at target_delta; training never goes past it.
      accountant: "rdp" or "pld".
      num_microbatches: None, or microbatches per logical batch whose mean
        gradient is clipped (sensitivity 2C; `tfdp.training.DPModel`).
      normalize_update: divide the clipped sum by C (De et al. 2022, eq. 3).
      data_normalization: None, or a dict with `l2_clip_norm_mean`,
        `l2_clip_norm_square`, `noise_multiplier`, `threshold`: Tramer &
        Boneh's private feature normalization (App. B), composed into the
        run's epsilon. Needs features="scatternet".
      sampling_seed: None (default: drawn from OS entropy, kept only in the
        checkpoint), or an int to reproduce the batches; the report then
        says the guarantee assumes it stays secret (`tfdp.dp.seeds`).
      noise_seed: the same for the DP noise.
      clipping: how the clipped sum is computed: "auto" (ghost norms when
        every trainable layer has a rule, else vectorized), "ghost" or
        "vectorized". The sum, and so the guarantee, is the same.
      simulation: None, or the dict `tools/privacy.py simulate` prints: the
        run simulates a reference run at a smaller batch (TAN, Sec. 3.4) and
        is labelled so, not private at the reference epsilon.
      study_dir: None, or a tuning study's folder: the run appends its
        mechanism to the study's ledger and the report states the whole
        study's epsilon (How to DP-fy ML, Sec. 5.4.2).

    Raises:
      ValueError: without l2_clip_norm or target_delta, an unknown clipping,
        or a study_dir that is not a local path (a URL).
    """

    l2_clip_norm: Optional[float] = None
    target_delta: Optional[float] = None
    noise_multiplier: Optional[float] = None
    target_epsilon: Optional[float] = None
    accountant: str = "rdp"
    num_microbatches: Optional[int] = None
    normalize_update: bool = False
    data_normalization: Optional[dict] = None
    sampling_seed: Optional[int] = None
    noise_seed: Optional[int] = None
    clipping: str = "auto"
    simulation: Optional[dict] = None
    study_dir: Optional[str] = None

    def __post_init__(self):
        missing = [name for name in ("l2_clip_norm", "target_delta")
                   if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"A private run needs {' and '.join(missing)}: set "
                f"{' and '.join(f'tfdp.PrivacyConfig.{n}' for n in missing)} (the configs' "
                "L2_CLIP_NORM and TARGET_DELTA macros), or set tfdp.train_and_evaluate.privacy "
                "= None to train without privacy.")
        if self.clipping not in CLIPPING_PATHS:
            raise ValueError(f"clipping={self.clipping!r}: clipping must be one of "
                             f"{CLIPPING_PATHS}.")
        _seed("PrivacyConfig.sampling_seed", self.sampling_seed, 2**63 - 1)  # an int64
        _seed("PrivacyConfig.noise_seed", self.noise_seed, 2**63 - 1)
        if self.study_dir is not None and (not isinstance(self.study_dir, str)
                                           or storage.is_url(self.study_dir)):
            raise ValueError(
                f"study_dir={self.study_dir!r}: a study ledger is a local (or mounted) "
                "folder, locked with flock while runs read and write it; give a path on "
                "this machine (a shared mount for runs on several machines).")

    @property
    def fixed_seeds(self):
        """The names of the seeds the user fixed (the report says they must stay secret)."""
        return tuple(name for name in ("sampling_seed", "noise_seed")
                     if getattr(self, name) is not None)


@gin.configurable(module="tfdp")
@dataclasses.dataclass(frozen=True)
class OptimizationConfig:
    """What each update is: the optimizer, the logical batch, how many, and EMA.

    Attributes:
      optimizer_fn: builder `() -> keras.optimizers.Optimizer`
        (`tfdp.training.build_optimizer`).
      batch_size: B, the expected (Poisson) or fixed (shuffle) examples per
        optimizer update: the logical batch (the BATCH_SIZE macro).
      num_steps: T, optimizer updates, not epochs (the NUM_STEPS macro).
      sampling: "poisson" (amplification by subsampling; the accountant's
        assumption) or "shuffle" (fixed-size shuffled batches: replace-one
        adjacency, no amplification; `tfdp.accounting.DPMechanism`).
      accumulation_steps: chunks each logical batch is processed in (virtual
        batching, to bound memory); noise is added once per logical batch.
      ema_decay: None, or the EMA decay (De et al. 2022, App. C.3): the EMA
        parameters are evaluated beside the last ones and exported.

    Raises:
      ValueError: an unknown sampling, or accumulation_steps < 1. (batch_size
        and num_steps are checked by the plan, `tfdp.planning`, with N.)
    """

    optimizer_fn: object = gin.REQUIRED
    batch_size: int = gin.REQUIRED
    num_steps: int = gin.REQUIRED
    sampling: str = "poisson"
    accumulation_steps: int = 1
    ema_decay: Optional[float] = None

    def __post_init__(self):
        if self.sampling not in mechanism_lib.SAMPLING_SCHEMES:
            raise ValueError(f"Unknown sampling scheme {self.sampling!r}; use one of "
                             f"{mechanism_lib.SAMPLING_SCHEMES}.")
        _positive_int("accumulation_steps", self.accumulation_steps)


@gin.configurable(module="tfdp")
@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """When and on what the model is evaluated (each evaluation is also a checkpoint).

    Attributes:
      eval_every_steps: optimizer updates between evaluations.
      eval_batch_size: examples per evaluation batch.
      eval_examples: evaluate on the first this-many test examples (None: all).

    Raises:
      ValueError: eval_every_steps < 1, or an eval_examples that is not None
        or a positive int.
    """

    eval_every_steps: int = 100
    eval_batch_size: int = 1000
    eval_examples: Optional[int] = None

    def __post_init__(self):
        if int(self.eval_every_steps) < 1:
            raise ValueError(f"eval_every_steps must be >= 1, got {self.eval_every_steps}.")
        if self.eval_examples is not None and (
                isinstance(self.eval_examples, bool) or not isinstance(self.eval_examples, int)
                or self.eval_examples < 1):
            raise ValueError(f"eval_examples must be None (the whole test split) or a positive "
                             f"int, got {self.eval_examples!r}.")


@gin.configurable(module="tfdp")
@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How the run executes: none of these changes what is trained.

    Attributes:
      strategy: "default", "mirrored", "multi_worker_mirrored" (TF_CONFIG)
        or "tpu" (`tfdp.training.make_strategy`; its `tpu` address is a gin
        binding of that function). With R replicas each gets a contiguous
        1/R of every logical batch; noise stays exact (`DPModel`). Under
        "multi_worker_mirrored" only the chief writes the workdir.
      static_batch_size: None (variable Poisson batches, padded only to a
        multiple of R), an int S (every logical batch truncated/padded to S
        masked slots, S a multiple of R * accumulation_steps: static shapes
        for XLA and TPUs), or "auto" (the smallest such S whose truncation
        adds at most delta / 10 to delta; `tfdp.data.padding`).
      jit_compile: compile the training step with XLA (as TPUs require; use
        with `static_batch_size`). Off by default: on the 2-core CPU XLA
        made the step slower.
      deterministic: `tf.config.experimental.enable_op_determinism()`
        (process-wide; slower), so that fixed seeds give identical weights.
      checkpoint_every_steps: optimizer updates between checkpoints (None:
        eval_every_steps); must divide eval_every_steps. A checkpoint is
        also written before the first step and at the last.
      progress_bar: a progress bar over the run's steps (None: only on a
        terminal); otherwise a log line at least every 10 s.
      seed: public seed of augmentation and initialization (and of a
        non-private run's batches). It does NOT choose a private run's
        batches or noise (`PrivacyConfig.sampling_seed`, `noise_seed`).

    Raises:
      ValueError: a non-bool jit_compile, or a static_batch_size that is not
        None, a positive int or "auto".
    """

    strategy: str = "default"
    static_batch_size: object = None
    jit_compile: bool = False
    deterministic: bool = False
    checkpoint_every_steps: Optional[int] = None
    progress_bar: Optional[bool] = None
    seed: int = 0

    def __post_init__(self):
        _seed("RuntimeConfig.seed", self.seed, 2**32 - 1)  # Keras' set_random_seed's range
        if not isinstance(self.jit_compile, bool):
            raise ValueError(f"jit_compile={self.jit_compile!r}: jit_compile must be True or "
                             "False.")
        size = self.static_batch_size
        if size not in (None, "auto") and (isinstance(size, bool) or not isinstance(size, int)
                                           or size < 1):
            raise ValueError(
                f"static_batch_size must be None, a positive int or 'auto', got {size!r}.")


CONFIGS = (DataConfig, AugmentationConfig, PrivacyConfig, OptimizationConfig,
           EvaluationConfig, RuntimeConfig)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The six groups of one run, built from gin (`from_gin`); `privacy` None: not private."""

    data: DataConfig
    augmentation: AugmentationConfig
    privacy: Optional[PrivacyConfig]
    optimization: OptimizationConfig
    evaluation: EvaluationConfig
    runtime: RuntimeConfig

    @classmethod
    def from_gin(cls, privacy="dp"):
        """Builds every group from its gin bindings; `privacy`: "dp", None or a `PrivacyConfig`.

        Raises:
          ValueError: from any group's check, from `check_together`, or an
            unknown `privacy`.
        """
        if isinstance(privacy, str) and privacy == "dp":
            privacy = PrivacyConfig()
        elif privacy is not None and not isinstance(privacy, PrivacyConfig):
            raise ValueError(f"privacy={privacy!r}: use 'dp' (DP-SGD, the default) or None "
                             "(non-private training, e.g. tfdp.train_and_evaluate.privacy = "
                             "None).")
        config = cls(data=DataConfig(), augmentation=AugmentationConfig(), privacy=privacy,
                     optimization=OptimizationConfig(), evaluation=EvaluationConfig(),
                     runtime=RuntimeConfig())
        check_together(config)
        return config

    @property
    def checkpoint_every_steps(self):
        """The checkpoint interval: `runtime.checkpoint_every_steps`, or eval_every_steps."""
        return int(self.runtime.checkpoint_every_steps or self.evaluation.eval_every_steps)


# The settings `tfdp.make_private` refuses, each with why and what to do instead: the CLI
# trainer (`python -m tfdp.main`) supports them, make_private would silently drop them.
MAKE_PRIVATE_REFUSES = {
    ("privacy", "data_normalization"): (
        "private feature normalization (Tramer & Boneh 2021, App. B) needs "
        "tfdp.DataConfig.features='scatternet', which only python -m tfdp.main computes"),
    ("privacy", "simulation"): (
        "a simulated run (TAN, Sec. 3.4) is labelled so only in the report of "
        "python -m tfdp.main"),
    ("privacy", "study_dir"): (
        "only python -m tfdp.main appends a run to a tuning study's ledger and reports the "
        "whole study's epsilon"),
    ("optimization", "sampling"): (
        "PrivateTraining.fit draws Poisson batches (q = batch_size / N, what the accountant "
        "assumes); fixed-size shuffled batches (sampling='shuffle') are trained by "
        "python -m tfdp.main"),
}
# What each refused setting holds when it is left unset.
_UNSET = {"data_normalization": None, "simulation": None, "study_dir": None,
          "sampling": "poisson"}


@dataclasses.dataclass(frozen=True)
class PrivateTrainingConfig:
    """What `tfdp.make_private` trains with: the CLI's own privacy and optimization groups.

    make_private reads the same `PrivacyConfig` and `OptimizationConfig` as
    `python -m tfdp.main` (each checks itself); the data's group is the data
    given to make_private. Training length is `optimization.num_steps`,
    optimizer updates; `tfdp.num_steps_for_epochs` turns epochs over N into
    it. The optimizer is `optimization.optimizer_fn()`, called once per
    make_private (e.g. `lambda: keras.optimizers.SGD(0.5)`, or
    `functools.partial(tfdp.training.build_optimizer, "sgd", learning_rate=0.5)`).

    Attributes:
      privacy: a `PrivacyConfig`: C, delta, sigma or the target epsilon, the
        accountant, num_microbatches, normalize_update, the seeds, clipping.
      optimization: an `OptimizationConfig`: optimizer_fn, the expected batch
        size B, num_steps T, accumulation_steps, ema_decay.
      trainable: None (train what the model marks trainable), "head", "all"
        or a list of fnmatch patterns of layer names
        (`tfdp.models.set_trainable`, applied to the model in place).
      data_dir: TFDS data_dir, when the training data is a dataset's name
        (None: TFDS's default).

    Raises:
      ValueError: privacy or optimization of another type (privacy None:
        make_private trains only privately), gin bindings of either group in
        the process (they would fill the fields not given), or a setting
        make_private does not support (`MAKE_PRIVATE_REFUSES`: data_normalization, simulation,
        study_dir, sampling other than "poisson"), named with what to do.
    """

    privacy: PrivacyConfig
    optimization: OptimizationConfig
    trainable: object = None
    data_dir: Optional[str] = None

    def __post_init__(self):
        for name, cls in (("privacy", PrivacyConfig), ("optimization", OptimizationConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(
                    f"PrivateTrainingConfig.{name} must be a tfdp.{cls.__name__}, got "
                    f"{type(getattr(self, name)).__name__}: e.g. tfdp.PrivateTrainingConfig("
                    "privacy=tfdp.PrivacyConfig(l2_clip_norm=1.0, target_delta=1e-5, "
                    "target_epsilon=3.0), optimization=tfdp.OptimizationConfig(optimizer_fn="
                    "lambda: keras.optimizers.SGD(0.5), batch_size=256, num_steps=1000)).")
        bound = [f"tfdp.{cls.__name__}.{name}" for cls in (PrivacyConfig, OptimizationConfig)
                 for name in gin.get_bindings(f"tfdp.{cls.__name__}")]
        if bound:
            raise ValueError(
                f"gin binds {', '.join(bound)} in this process (a parsed config): a "
                "PrivacyConfig or OptimizationConfig built in Python takes gin's value for "
                "every field not given, so make_private would train with settings that are "
                "not in its config. Call gin.clear_config() before building the configs.")
        for (group, name), why in MAKE_PRIVATE_REFUSES.items():
            value = getattr(getattr(self, group), name)
            if value != _UNSET[name]:
                cls = type(getattr(self, group)).__name__
                raise ValueError(
                    f"tfdp.{cls}.{name}={value!r}: make_private does not support it ({why}). "
                    f"Leave it at {_UNSET[name]!r}, or train with python -m tfdp.main.")


def check_together(config: RunConfig) -> None:
    """Refuses settings of two groups that would be silently wrong together.

    Raises:
      ValueError: augmentation with precomputed features; a checkpoint
        interval that does not divide the evaluation interval (fit epochs are
        checkpoint intervals, so checkpoints, evaluations and the last step
        all fall on epoch ends, and a resumed run keeps the same boundaries);
        private data normalization under multi_worker_mirrored.
    """
    data, aug = config.data, config.augmentation
    if data.features is not None and aug.active:
        raise ValueError(
            f"features={data.features!r} are computed once from the un-augmented images, so "
            f"augmentation={aug.augmentation!r} and augmult={aug.augmult} would transform "
            "feature maps, not images. Set augmult = 0 and augmentation = None for feature "
            "models.")
    every, evals = config.runtime.checkpoint_every_steps, config.evaluation.eval_every_steps
    if every is not None and (int(every) < 1 or evals % every):
        raise ValueError(
            f"checkpoint_every_steps={every} must be >= 1 and divide eval_every_steps={evals} "
            f"(every evaluation is also a checkpoint); e.g. use a divisor of {evals}.")
    if (config.privacy is not None and config.privacy.data_normalization
            and config.runtime.strategy == "multi_worker_mirrored"):
        raise ValueError(
            "data_normalization is not supported under multi_worker_mirrored: every worker "
            "would draw its own private release. Run it on one worker first (the release is "
            "saved to data_normalization.json and reused), or use strategy 'mirrored'.")


# Where each argument of the old `tfdp.train_and_evaluate` lives now.
MOVED = {field.name: f"tfdp.{cls.__name__}.{field.name}"
         for cls in CONFIGS for field in dataclasses.fields(cls)}
TRAINER = "tfdp.train_and_evaluate"


def moved_setting_error(name: str, where: str = "") -> str:
    """The message for a binding of `name` on the trainer: its new home (`MOVED`), and the fix.

    Args:
      name: the argument gin refused on `tfdp.train_and_evaluate`, e.g. "batch_size".
      where: gin's location of the binding ("In file ..., line N" and the line).

    Returns:
      "tfdp.train_and_evaluate.batch_size is now tfdp.OptimizationConfig.batch_size. ...",
      then `where`.
    """
    return (f"{TRAINER}.{name} is now {MOVED[name]}. The settings of {TRAINER} (all but "
            "model_fn and privacy) are grouped by concern (tfdp.DataConfig, "
            "tfdp.AugmentationConfig, tfdp.PrivacyConfig, tfdp.OptimizationConfig, "
            "tfdp.EvaluationConfig, tfdp.RuntimeConfig; docs/configs.md): rename each "
            f"{TRAINER}.<setting> binding to its group's; macros such as NUM_STEPS are "
            "unchanged." + (f"\n{where}" if where else ""))


def new_key(key):
    """A parsed binding key `(configurable, argument)` of an older config, in today's names.

    Checkpoints of older tfdp versions recorded `tfdp.train_and_evaluate.batch_size`; a
    resume compares it with `tfdp.OptimizationConfig.batch_size`.
    """
    selector, argument = key
    scope, _, name = selector.rpartition("/")
    if name == TRAINER and argument in MOVED:
        home, _, argument = MOVED[argument].rpartition(".")
        return (f"{scope}/{home}" if scope else home, argument)
    return key


# A bound augmentation_kwargs that the run's augmentation would not read is refused before
# the run starts (`tfdp.main`): every augmentation that takes keywords reads it.
gin_bindings.declare_branches(
    "tfdp.AugmentationConfig", setting=("tfdp.AugmentationConfig", "augmentation"),
    what="augmentation", reads={
        name: ("augmentation_kwargs",) if any(
            p.kind is inspect.Parameter.KEYWORD_ONLY
            for p in inspect.signature(fn).parameters.values()) else ()
        for name, fn in augment.AUGMENTATIONS.items()})
