"""train_and_evaluate: the gin root that wires data, model, DP-SGD and export.

With `privacy=None` the same stages train WITHOUT privacy (`NonPrivateModel`)
and write a NOT_PRIVATE statement where the privacy report would be.

Flow: data (TFDS, Poisson sampling) -> augment (augmult views) -> model ->
DPModel (per-example clipping, noise once per logical batch) -> fit with
callbacks (epsilon, metrics.jsonl, TensorBoard, checkpoints) -> privacy report
-> SavedModel. Under a tf.distribute strategy (`tfdp.training.distribute`) the
model is built in the strategy's scope, each host reads only its replicas'
chunks of every (padded, masked) logical batch, and only the chief writes the
outputs.
"""

import contextlib
import dataclasses
import inspect
import json
import math
import os
import re
import shutil
import sys
import tempfile

import gin
import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdp import accounting
from tfdp import augment
from tfdp import data
from tfdp import gin_bindings
from tfdp import host
from tfdp import models
from tfdp import storage
from tfdp import resume_rule
from tfdp import workdir as workdir_lib
from tfdp.data import fingerprint
from tfdp.dp import coins
from tfdp.dp import precision
from tfdp.export import privacy_report
from tfdp.export import saved_model
from tfdp.training import callbacks as callbacks_lib
from tfdp.training import distribute
from tfdp.training import evaluation
from tfdp.training import optimizers  # noqa: F401  (registers build_optimizer)
from tfdp.training.dp_model import CLIPPING_PATHS, DPModel
from tfdp.training.non_private_model import NonPrivateModel

METRICS_FILE = "metrics.jsonl"
OPERATIVE_CONFIG = "operative_config.gin"
EXPORT_DIR = "export"
CHECKPOINT_DIR = workdir_lib.CHECKPOINT_DIR
DATA_NORMALIZATION_FILE = "data_normalization.json"
PRIVACY_MODES = ("dp", None)
NOT_PRIVATE = privacy_report.NOT_PRIVATE
# Settings of the DP mechanism that a non-private run (privacy=None) does not use: given
# (bound in gin, or not their default), they are listed in a warning and in NOT_PRIVATE.json.
PRIVACY_SETTINGS = ("noise_multiplier", "target_epsilon", "l2_clip_norm", "target_delta",
                    "accountant", "normalize_update", "num_microbatches", "noise_seed",
                    "clipping", "simulation")


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


@gin.configurable(module="tfdp", denylist=["workdir", "audit"])
def train_and_evaluate(
    workdir,
    *,
    dataset=gin.REQUIRED,
    num_examples=gin.REQUIRED,
    batch_size=gin.REQUIRED,
    num_steps=gin.REQUIRED,
    l2_clip_norm=None,
    target_delta=None,
    noise_multiplier=None,
    target_epsilon=None,
    model_fn=gin.REQUIRED,
    optimizer_fn=gin.REQUIRED,
    data_dir=None,
    train_split="train",
    test_split="test",
    accountant="rdp",
    sampling="poisson",
    augmentation=None,
    augmentation_kwargs=None,
    augmult=0,
    accumulation_steps=1,
    num_microbatches=None,
    normalize_update=False,
    ema_decay=None,
    augtest=False,
    image_size=None,
    features=None,
    data_normalization=None,
    simulation=None,
    study_dir=None,
    eval_every_steps=100,
    eval_batch_size=1000,
    eval_examples=None,
    seed=0,
    sampling_seed=None,
    noise_seed=None,
    progress_bar=None,
    strategy="default",
    static_batch_size=None,
    checkpoint_every_steps=None,
    deterministic=False,
    clipping="auto",
    jit_compile=False,
    audit=None,
    privacy="dp",
):
    """Trains a classifier with DP-SGD, evaluates it, exports it with its report.

    With `privacy=None` it trains WITHOUT privacy instead (plain mean-loss
    steps, `tfdp.training.NonPrivateModel`), on the same data, sampler,
    model, augmentation, optimizer, EMA, evaluation, checkpoints and workdir
    protocol, and writes `NOT_PRIVATE.{json,md}` where the privacy report
    would be (docs/non_private.md).

    Privacy-coupled values (num_examples, batch_size, num_steps,
    noise_multiplier, target_epsilon, target_delta, l2_clip_norm) come from gin
    macros defined once per config; the sampler, DPModel, the accountant, the
    checkpoint, the study ledger and the report all read them from one
    `tfdp.accounting.DPMechanism`.

    The run goes through named stages, and nothing is written to `workdir`
    (and no private statistic is released) until every setting has been
    checked, the data loaded and any checkpoint in the workdir checked against
    this run's mechanism:

    1. `_plan`: the mechanism (calibration, the target-epsilon cap, static
       batch truncation) and every other setting;
    2. `_load_data`: the splits, checked against NUM_EXAMPLES;
    3. `_check_workdir`, under the workdir's lock (`tfdp.workdir`): an
       existing checkpoint must be intact and hold this mechanism, the same
       fixed seeds and no more steps than planned; without one, the workdir
       must hold no output of an earlier run;
    4. `_feature_extractor`, `_features`: a frozen public feature
       extractor's features (ScatterNet, or a fine-tuning model's frozen
       trunk), computed once, and the private data normalization, released
       once per workdir;
    5. `_build_model`: the model and its DPModel, in the strategy's scope;
    6. `_restore`: the checkpoint, or a first one at step 0 holding the
       secret coins;
    7. `_fit`: training with evaluations, checkpoints and logs;
    8. `_finish`: the study ledger, the SavedModel, the privacy report and,
       last, `FINISHED` (written atomically once both are complete). A
       failed write (full disk, read-only folder) stops the run with a
       `tfdp.workdir.WorkdirError`, keeping the checkpoints saved so far.

    Args:
      workdir: output directory (see docs/workdir.md: operative_config.gin, metrics.jsonl,
        tensorboard/, checkpoints/, privacy_report.{json,md}, export/, and
        FINISHED last). A local path; one run at a time (locked).
      dataset: TFDS name, e.g. "fashion_mnist".
      num_examples: N, the size of the training split; checked against the data.
      batch_size: B, expected examples per optimizer update (logical batch).
      num_steps: T, optimizer updates (not epochs).
      l2_clip_norm: C, the per-example L2 bound (required with privacy="dp").
      target_delta: delta at which epsilon is reported (required with
        privacy="dp").
      noise_multiplier: sigma (noise std / sensitivity), or None to calibrate
        it to target_epsilon.
      target_epsilon: the budget; training never goes past it.
      model_fn: builder `(num_classes, input_shape=...) -> keras.Model`. A
        `tfdp.models.build_finetune_model` whose head alone trains, with
        augmult 0, has its frozen trunk's features computed once and its head
        trained on them (as `features`); the export composes the two.
      optimizer_fn: builder `() -> keras.optimizers.Optimizer`.
      data_dir: TFDS data_dir (None: TFDS's default, ~/tensorflow_datasets).
      train_split, test_split: TFDS split names.
      accountant: "rdp" or "pld".
      sampling: "poisson" (default: amplification by subsampling) or
        "shuffle" (fixed-size shuffled batches: replace-one adjacency, no
        amplification, see `tfdp.accounting.DPMechanism`).
      augmentation: name in `tfdp.augment.AUGMENTATIONS`, or None.
      augmentation_kwargs: keyword arguments of that augmentation (dict).
      augmult: K views per example (0 = no augmentation; De et al. 2022).
        Sensitivity and epsilon do not depend on K.
      accumulation_steps: chunks each logical batch is processed in (virtual
        batching, to bound memory); noise is added once per logical batch.
      num_microbatches: None, or microbatches per logical batch whose mean
        gradient is clipped (sensitivity 2C; see `DPModel`).
      normalize_update: De et al. 2022, eq. (3).
      ema_decay: None, or the EMA decay (De et al. 2022, App. C.3); the EMA
        parameters are then evaluated beside the last ones and exported.
      augtest: also report AugTest accuracy: majority vote over the same
        `augmult` test-time views (TAN, Sec. 4.2, Table 2).
      image_size: resize images to this (height, width) when loading (needed
        for ImageNet, whose images differ in size), or None.
      features: None (train on pixels) or "scatternet": compute the fixed
        ScatterNet features (Tramer & Boneh 2021, App. C.1) of every image once,
        keep them in memory, and train `model_fn`'s head on them; the export
        composes ScatterNet + head so it still serves uint8 images.
      data_normalization: None, or a dict with `l2_clip_norm_mean`,
        `l2_clip_norm_square`, `noise_multiplier`, `threshold`: Tramer & Boneh's
        private feature normalization (App. B), whose Gaussian-mechanism cost
        is composed into the run's epsilon and stated in the report.
      simulation: None, or a dict describing the reference run this run
        simulates at a smaller batch (TAN, Sec. 3.4; printed by
        `tools/privacy.py simulate`): the run is labelled as a simulation,
        not private at the reference epsilon, in metrics.jsonl and the report.
      study_dir: None, or a tuning-study directory: the run appends its
        mechanism to the study's ledger and the report states the epsilon of
        the whole study (How to DP-fy ML, Sec. 5.4.2).
      eval_every_steps: optimizer updates between evaluations (each is also a
        checkpoint).
      eval_batch_size: evaluation batch size.
      eval_examples: evaluate on the first this-many test examples (None: all).
      seed: public seed of augmentation and initialization. It does NOT
        choose the batches or the noise.
      sampling_seed: None (default: drawn from OS entropy, kept only in the
        checkpoint), or an int to reproduce the batches; the report then says
        the guarantee assumes it stays secret (`tfdp.dp.coins`).
      noise_seed: the same for the DP noise.
      progress_bar: a progress bar over the run's steps (None: only on a
        terminal); otherwise a log line at least every 10 s. Both show the
        step out of num_steps, the loss and the exact epsilon spent.
      strategy: "default", "mirrored", "multi_worker_mirrored" (TF_CONFIG) or
        "tpu" (`tfdp.training.make_strategy`; its `tpu` address is a gin
        binding of that function). With R replicas each replica gets a
        contiguous 1/R of every logical batch; noise stays exact (`DPModel`).
        Under "multi_worker_mirrored" only the chief writes the workdir's
        outputs (metrics, TensorBoard, checkpoints, report, export).
      static_batch_size: None (variable Poisson batches; padded only to a
        multiple of R), an int S (every logical batch is truncated/padded to S
        masked slots, S a multiple of R * accumulation_steps: static shapes for
        XLA and TPUs), or "auto" (the smallest such S whose truncation adds at
        most delta / 10 to delta). The cap and the truncation bound are in the
        privacy report (`tfdp.data.padding`).
      checkpoint_every_steps: optimizer updates between checkpoints (None:
        eval_every_steps); must divide eval_every_steps. A checkpoint is also
        written before the first step, at every evaluation and at the last
        step. It holds the model, EMA, optimizer (and step), noise-generator
        state, the secret sampling seed and the privacy ledger (the whole
        mechanism); the input position is the step (batches are keyed by
        (sampling seed, step)). A run restarted with the same command resumes
        there.
      deterministic: call `tf.config.experimental.enable_op_determinism()`
        (process-wide; slower) so that fixed seeds give identical weights.
      clipping: how the clipped sum of per-example gradients is computed:
        "auto" (ghost norms when every trainable layer has a rule, else
        vectorized), "ghost" or "vectorized" (`tfdp.training.DPModel`). The
        sum, and so the privacy guarantee, is the same.
      jit_compile: compile the training step with XLA (as TPUs require; use
        with `static_batch_size`, or every new Poisson batch size compiles
        anew). Off by default: on the 2-core CPU XLA made the step slower.
      audit: None, or an empirical privacy audit hook (`tfdp.audit`, run by
        `tools/audit.py`; not a gin value): `audit.prepare_train(split)` may
        put canaries into the training split (before NUM_EXAMPLES is
        checked), `audit.build_dp_model(model, mechanism, **kwargs)` builds
        the DPModel, and `audit.result(dp_model, mechanism)` becomes the
        report's "audit" section. It needs a workdir without a checkpoint.
      privacy: "dp" (default: DP-SGD) or None: NON-PRIVATE training, for
        public pretraining and non-private ceilings. Then no mechanism is
        planned, the batches come from the same sampler (`sampling`, with
        `sampling_seed`, or `seed` when it is None: nothing is secret), and
        the privacy settings given (PRIVACY_SETTINGS: noise_multiplier,
        target_epsilon, l2_clip_norm, target_delta, accountant,
        normalize_update, num_microbatches, noise_seed, clipping,
        simulation) are not used: a warning lists them, and so does
        NOT_PRIVATE.json. `accumulation_steps` keeps its meaning (chunks of
        one update); `data_normalization`, `study_dir` and `audit` are
        refused. metrics.jsonl lines say "privacy": "NOT PRIVATE"; a
        workdir of one mode is never resumed in the other.

    Returns:
      The privacy report dict (with privacy=None: the NOT_PRIVATE.json dict,
      `"privacy": "NOT PRIVATE"`, no epsilon).

    Raises:
      ValueError: on invalid or inconsistent privacy parameters, a
        num_examples that does not match the data, an unknown strategy, a
        static_batch_size that does not split evenly or truncates too often,
        a checkpoint_every_steps that does not divide eval_every_steps, a
        checkpoint written under another mechanism or with more steps than
        planned, augmentation asked together with precomputed `features`, or
        an unknown `clipping` or non-bool `jit_compile`, an unknown
        `privacy`, a private run without l2_clip_norm or target_delta, or a
        non-private run with data_normalization, study_dir or audit, or a
        workdir of the other privacy mode.
      tfdp.data.DatasetNotFoundError: if the dataset is not prepared, or a
        shard is missing or corrupt; the message says what to run.
      tfdp.workdir.WorkdirError: (a ValueError) the workdir is a URL tfdp
        cannot lock (not gs://, or no Cloud Storage client), is in
        use by another run, is not writable, holds outputs of an earlier run
        but no checkpoint to resume, or holds a corrupt checkpoint; or a
        write failed during the run (full disk), after which the same
        command resumes.
    """
    # First, before any other op: multi-worker and TPU strategies configure the runtime.
    dist = distribute.make_strategy(strategy)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    # Once per run: the CPU flags and oneDNN state that every time in the log depends on.
    logging.info("%s", host.describe_host())

    # 1. The mechanism and every other setting, before any I/O.
    checkpoint_every_steps = _checkpoint_interval(checkpoint_every_steps, eval_every_steps)
    _check_augmentation(features, augmentation, augmentation_kwargs, augmult, augtest)
    if clipping not in CLIPPING_PATHS or not isinstance(jit_compile, bool):
        raise ValueError(
            f"clipping={clipping!r} and jit_compile={jit_compile!r}: clipping must be one of "
            f"{CLIPPING_PATHS} and jit_compile True or False.")
    if data_normalization and strategy == "multi_worker_mirrored":
        raise ValueError(
            "data_normalization is not supported under multi_worker_mirrored: every worker "
            "would draw its own private release. Run it on one worker first (the release is "
            f"saved to {DATA_NORMALIZATION_FILE} and reused), or use strategy 'mirrored'."
        )
    if privacy not in PRIVACY_MODES:
        raise ValueError(f"privacy={privacy!r}: use 'dp' (DP-SGD, the default) or None "
                         "(non-private training, e.g. tfdp.train_and_evaluate.privacy = None).")
    if privacy is None:
        # `mechanism` is then a NonPrivatePlan: the sampling facts, no privacy.
        mechanism = _plan_non_private(
            dist, accumulation_steps, static_batch_size, num_examples=num_examples,
            batch_size=batch_size, num_steps=num_steps, sampling=sampling,
            data_normalization=data_normalization, study_dir=study_dir, audit=audit,
            given=dict(noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
                       l2_clip_norm=l2_clip_norm, target_delta=target_delta,
                       accountant=accountant, normalize_update=normalize_update,
                       num_microbatches=num_microbatches, noise_seed=noise_seed,
                       clipping=clipping, simulation=simulation))
    else:
        mechanism = _plan(
            dist, accumulation_steps, static_batch_size,
            num_examples=num_examples, batch_size=batch_size, num_steps=num_steps,
            l2_clip_norm=l2_clip_norm, target_delta=target_delta,
            noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            accountant=accountant, sampling=sampling, normalize_update=normalize_update,
            num_microbatches=num_microbatches, data_normalization=data_normalization,
            fixed_seeds=tuple(name for name, value in (("sampling_seed", sampling_seed),
                                                       ("noise_seed", noise_seed))
                              if value is not None),
        )
    keras.utils.set_random_seed(seed)

    # 2. Data (read only).
    train, test = _load_data(dataset, train_split, test_split, data_dir=data_dir,
                             image_size=image_size, num_examples=mechanism.num_examples,
                             prepare_train=audit and audit.prepare_train)
    data.check_duplicates(train, private=isinstance(mechanism, accounting.DPMechanism))
    image_shape = train.image_shape
    test_examples = _test_examples(eval_examples, test)
    data_fingerprint = {"train": fingerprint.split_fingerprint(train),
                        "test": fingerprint.split_fingerprint(test)}

    # 3. The workdir: locked for the whole run by the chief (which writes it), then
    # checked: a checkpoint of this very mechanism, or no output of an earlier run.
    workdir_lib.check_lockable(workdir)
    chief = distribute.is_chief(dist)
    with contextlib.ExitStack() as run:
        if chief:
            run.enter_context(workdir_lib.locked(workdir))
        latest, finished = _check_workdir(workdir, mechanism, {"train": train, "test": test},
                                          data_fingerprint, audit=audit,
                                          sampling_seed=sampling_seed, noise_seed=noise_seed)
        if finished is not None:
            return finished
        out_dir = distribute.output_dir(workdir, dist)  # workdir, or a temp dir off the chief
        workdir_lib.clear_finished(out_dir)  # not finished until this run says so
        run.enter_context(_stops_cleanly(out_dir))

        # 4. A frozen public feature extractor's features, computed once, and the private
        # data normalization (released once per workdir).
        _check_builder_bindings(model_fn)
        with dist.scope():
            extractor, model, backbone = _feature_extractor(
                features, model_fn, train, augmult=augmult, augmentation=augmentation)
        train, test, head_kwargs = _features(train, test, extractor,
                                             mechanism.data_normalization, workdir)

        # 5. Model and DP state, mirrored under the strategy.
        with dist.scope():
            if extractor is not None:
                # The head on features: the fine-tuning model's own, or model_fn's (ScatterNet).
                model = extractor.head or model_fn(
                    num_classes=train.num_classes, input_shape=train.image_shape, **head_kwargs)
            _check_output_width(model, train.num_classes, dataset)
            if privacy is None:  # NOT PRIVATE: plain mean-loss steps
                dp_model = NonPrivateModel(model, accumulation_steps=accumulation_steps,
                                           ema_decay=ema_decay)
            else:
                build_dp_model = DPModel if audit is None else audit.build_dp_model
                dp_model = build_dp_model(model, mechanism,
                                          accumulation_steps=accumulation_steps,
                                          noise_seed=noise_seed, ema_decay=ema_decay,
                                          clipping=clipping)
            dp_model.compile(optimizer=optimizer_fn(), jit_compile=jit_compile)
        if privacy is None:  # the batches' seed is public: `seed` unless fixed
            ledger = callbacks_lib.make_non_private_ledger(
                mechanism.num_steps, config=gin.config_str(),
                data=json.dumps(data_fingerprint, sort_keys=True),
                sampling_seed=seed if sampling_seed is None else sampling_seed)
        else:
            ledger = callbacks_lib.make_privacy_ledger(
                mechanism, noise_seed=noise_seed, config=gin.config_str(),
                data=json.dumps(data_fingerprint, sort_keys=True),
                sampling_seed=distribute.broadcast_from_chief(
                    dist, coins.secret_seed() if sampling_seed is None else sampling_seed))

        # 6. Restore, or write a first checkpoint that holds the secret coins.
        storage.makedirs(out_dir)
        manager, start_step = _restore(dp_model, ledger, out_dir, latest)

        # 7. Fit.
        augment_fn = None
        if augmult > 0 or augmentation is not None:
            augment_fn = augment.get_augmentation(
                augmentation or "none", **(augmentation_kwargs or {})
            )
        train_ds = distribute.distribute_chunks(dist, _train_dataset(
            train, mechanism, seed=int(ledger.sampling_seed.numpy()), start_step=start_step,
            augment_fn=augment_fn, augment_seed=[seed, 1], augmult=augmult,
            static_batch_size=mechanism.truncation and mechanism.truncation.static_batch_size,
            num_replicas=dist.num_replicas_in_sync, accumulation_steps=accumulation_steps,
        ), accumulation_steps=accumulation_steps)
        eval_ds = data.eval_batches(test, batch_size=eval_batch_size, num_examples=eval_examples)
        augtest_spec = (augment_fn, augmult, [seed, 2]) if augtest else None
        try:
            _fit(dp_model, mechanism, manager, ledger, train_ds, eval_ds, out_dir,
                 start_step=start_step, checkpoint_every_steps=checkpoint_every_steps,
                 eval_every_steps=eval_every_steps, augtest=augtest_spec,
                 simulation=simulation, test_examples=test_examples,
                 progress_bar=sys.stdout.isatty() if progress_bar is None else progress_bar)
        except tf.errors.OpError:
            # A corrupt shard met by a batch (a split too large to read whole at start):
            # the source kept the clear error that TensorFlow wrapped.
            try:
                data.raise_read_error(train, test)
            except data.DatasetNotFoundError as e:
                raise data.DatasetNotFoundError(
                    f"{e} The checkpoints saved so far are kept: once the data is fixed, the "
                    "same command resumes.") from None
            raise

        # 8. Study ledger, privacy report and SavedModel.
        steps_done = int(dp_model.optimizer.iterations.numpy())
        if steps_done != mechanism.num_steps:
            raise RuntimeError(
                f"Training stopped at step {steps_done}, not the planned {mechanism.num_steps}; "
                "no privacy report or export was written."
            )
        hyperparameters = _hyperparameters(
            dataset=dataset, train_split=train_split, augmentation=augmentation,
            augmult=augmult, accumulation_steps=accumulation_steps, ema_decay=ema_decay,
            augtest=augtest, seed=seed,
            optimizer=keras.optimizers.serialize(dp_model.optimizer)["config"],
        )
        if privacy is None:
            report = privacy_report.build_not_private_report(
                steps_completed=steps_done, planned_steps=mechanism.num_steps,
                num_examples=mechanism.num_examples, batch_size=mechanism.batch_size,
                sampling=mechanism.sampling,
                unused_privacy_settings=_hyperparameters(**mechanism.unused_privacy_settings),
                hyperparameters=hyperparameters | {
                    "sampling_seed": seed if sampling_seed is None else sampling_seed},
                exported_parameters="ema" if ema_decay is not None else "last")
            if mechanism.truncation is not None:
                report["truncation"] = dataclasses.asdict(mechanism.truncation)
        else:
            study = None
            if study_dir and chief:  # one ledger entry per run, not per worker
                study = _record_in_study(study_dir, workdir, mechanism,
                                         sampling_seed=sampling_seed)
            if simulation:
                logging.warning(
                    "This run SIMULATES %s; it is not private at the reference epsilon.",
                    simulation.get("reference", simulation),
                )
            report = privacy_report.build_privacy_report(
                mechanism,
                steps_completed=steps_done,
                hyperparameters=hyperparameters,
                exported_parameters="ema" if ema_decay is not None else "last",
                simulation=simulation,
                study=study,
                clip_margin=precision.clip_margin_record(
                    mechanism.l2_clip_norm, device=dp_model.traced_matmul_inputs),
            )
            if audit is not None:
                report["audit"] = audit.result(dp_model, mechanism)
        if backbone is not None:  # outside this run's guarantee: the report says whence
            report["backbone"] = backbone
        _finish(report, dp_model, extractor.compose(model) if extractor else model, out_dir,
                image_shape=image_shape)
        if out_dir != workdir:
            shutil.rmtree(out_dir, ignore_errors=True)
        if privacy is None:
            logging.warning(
                "Done: NOT PRIVATE (no clipping, no noise, no epsilon) after %d steps; "
                "SavedModel in %s, with %s in its assets.", steps_done,
                os.path.join(workdir, EXPORT_DIR), privacy_report.NOT_PRIVATE_MD)
        else:
            logging.info(
                "Done: epsilon=%.4f at delta=%g after %d steps; SavedModel in %s.",
                report["epsilon"], report["delta"], steps_done,
                os.path.join(workdir, EXPORT_DIR),
            )
        return report


def _plan(strategy, accumulation_steps, static_batch_size, **privacy):
    """Stage 1: the run's `DPMechanism`, truncation of static batches included."""
    missing = [name for name in ("l2_clip_norm", "target_delta") if privacy[name] is None]
    if missing:
        raise ValueError(
            f"A private run (privacy='dp') needs {' and '.join(missing)}: set "
            f"{' and '.join(f'tfdp.train_and_evaluate.{n}' for n in missing)} (the configs' "
            "L2_CLIP_NORM and TARGET_DELTA macros), or set tfdp.train_and_evaluate.privacy = "
            "None to train without privacy.")
    mechanism = accounting.plan_mechanism(**privacy)
    truncation = _truncation(static_batch_size, mechanism, strategy, accumulation_steps)
    return dataclasses.replace(mechanism, truncation=truncation)


def _plan_non_private(strategy, accumulation_steps, static_batch_size, *, num_examples,
                      batch_size, num_steps, sampling, data_normalization, study_dir, audit,
                      given):
    """Stage 1 without privacy: the `NonPrivatePlan`, and a warning of what is not used.

    `given` maps each name of PRIVACY_SETTINGS to this call's value; a
    setting counts as given when gin binds it or it is not the default, and
    is then listed (never silently ignored). What has no non-private meaning
    and would change what the run does is refused instead.

    Raises:
      ValueError: data_normalization, study_dir or audit is set; or an
        invalid N, B, T, sampling or static_batch_size.
    """
    refused = {"data_normalization": (
        data_normalization, "Tramer & Boneh's private feature normalization (a noisy DP "
        "release); for a non-private ScatterNet head use GroupNorm (e.g. "
        "tfdp.models.build_scatternet_linear.groups = 27)"),
        "study_dir": (study_dir, "a study ledger composes PRIVATE runs; a non-private run has "
                      "no epsilon to add, and if it trained on the study's private data the "
                      "study has no guarantee at all"),
        "audit": (audit, "an empirical privacy audit of a run without privacy")}
    for name, (value, why) in refused.items():
        if value:
            raise ValueError(f"privacy=None (NOT PRIVATE) does not take {name}: {why}. "
                             f"Remove {name}, or train privately (privacy='dp').")
    assert set(given) == set(PRIVACY_SETTINGS), sorted(set(given) ^ set(PRIVACY_SETTINGS))
    defaults = inspect.signature(train_and_evaluate).parameters
    try:
        bound = gin.get_bindings(train_and_evaluate)
    except (ValueError, TypeError):
        bound = {}
    unused = {name: value for name, value in given.items()
              if name in bound or value != defaults[name].default}
    plan = NonPrivatePlan(num_examples=num_examples, batch_size=batch_size,
                          num_steps=num_steps, sampling=sampling,
                          unused_privacy_settings=unused)
    plan = dataclasses.replace(plan, truncation=_non_private_truncation(
        static_batch_size, plan, strategy, accumulation_steps))
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


def _non_private_truncation(static_batch_size, plan, strategy, accumulation_steps):
    """Static batches without privacy: S (int or "auto") -> a `tfdp.accounting.Truncation`.

    No delta depends on it: "auto" takes the smallest S whose truncation
    probability over the run is <= 1e-6, so a batch is almost never cut.
    """
    if static_batch_size is None:
        if isinstance(strategy, tf.distribute.TPUStrategy):
            raise ValueError("strategy 'tpu' needs static batch shapes: set "
                             "tfdp.train_and_evaluate.static_batch_size = 'auto' (or an int).")
        return None
    num_replicas = strategy.num_replicas_in_sync
    unit = num_replicas * int(accumulation_steps)
    if static_batch_size == "auto":
        size = (data.choose_static_batch_size(plan.num_examples, plan.sampling_prob,
                                              plan.num_steps, 1e-6, multiple=unit)
                if plan.sampling == "poisson" else -(-plan.batch_size // unit) * unit)
    elif isinstance(static_batch_size, int) and not isinstance(static_batch_size, bool):
        size = static_batch_size
    else:
        raise ValueError(
            f"static_batch_size must be None, a positive int or 'auto', got {static_batch_size!r}.")
    if plan.sampling != "poisson" and size < plan.batch_size:
        raise ValueError(f"static_batch_size={size} is below the fixed batch size "
                         f"{plan.batch_size} of shuffled batches; use 'auto' or at least it.")
    per_replica = distribute.per_replica_batch_size(size, num_replicas, accumulation_steps)
    eta = (data.truncation_probability(plan.num_examples, plan.sampling_prob, size,
                                       plan.num_steps) if plan.sampling == "poisson" else 0.0)
    logging.info("Static logical batch %d (%d per replica x %d replicas); truncation "
                 "probability <= %.3g (no privacy depends on it).", size, per_replica,
                 num_replicas, eta)
    return accounting.Truncation(static_batch_size=size, per_replica_batch_size=per_replica,
                                 num_replicas=num_replicas, truncation_probability=eta)


def _check_augmentation(features, augmentation, augmentation_kwargs, augmult, augtest):
    """Refuses augmentation settings that would be silently wrong, before any I/O."""
    if features is not None and (augmult > 0 or augmentation is not None):
        raise ValueError(
            f"features={features!r} are computed once from the un-augmented images, so "
            f"augmentation={augmentation!r} and augmult={augmult} would transform feature "
            "maps, not images. Set augmult = 0 and augmentation = None for feature models."
        )
    if augtest and augmult < 1:
        raise ValueError("augtest needs an augmentation and augmult >= 1 (the K views).")
    if augmentation_kwargs and augmentation in (None, "none"):
        raise ValueError(
            f"augmentation_kwargs={augmentation_kwargs!r} with augmentation={augmentation!r}: "
            "no augmentation reads them (augmult's views are then the images themselves), so "
            "the run would drop them. Set an augmentation (tfdp.train_and_evaluate."
            f"augmentation, one of {sorted(set(augment.AUGMENTATIONS) - {'none'})}), or remove "
            "them.")
    if augmult > 0 or augmentation is not None:  # the keywords, checked as stage 7 uses them
        augment.get_augmentation(augmentation or "none", **(augmentation_kwargs or {}))


# From gin, a bound augmentation_kwargs that the run's augmentation would not read is
# refused before the run starts (`tfdp.main`): every augmentation that takes keywords reads it.
gin_bindings.declare_branches(
    "tfdp.train_and_evaluate", setting=("tfdp.train_and_evaluate", "augmentation"),
    what="augmentation", reads={
        name: ("augmentation_kwargs",) if any(
            p.kind is inspect.Parameter.KEYWORD_ONLY
            for p in inspect.signature(fn).parameters.values()) else ()
        for name, fn in augment.AUGMENTATIONS.items()})


def _load_data(dataset, train_split, test_split, *, data_dir, image_size, num_examples,
               prepare_train=None):
    """Stage 2: the two splits, opened for reading by index (`tfdp.data.open_split`).

    By default from ArrayRecord on disk (`tfdp.data.TFDSSource`); gin's
    `tfdp.data.open_split.source` chooses the pure-TF input instead (arrays
    in memory, or a JPEG folder). `prepare_train` (an audit's canaries) may
    change the training split first. The training split's size is then
    checked against NUM_EXAMPLES, which the accountant uses.
    """
    train = data.open_split(dataset, train_split, data_dir=data_dir, image_size=image_size)
    if prepare_train is not None:
        train = prepare_train(train)
    test = data.open_split(dataset, test_split, data_dir=data_dir, image_size=image_size)
    if train.num_examples != num_examples:
        raise ValueError(
            f"NUM_EXAMPLES={num_examples} but the {dataset!r} split {train_split!r} has "
            f"{train.num_examples} examples. The accountant must use the real N: set "
            f"NUM_EXAMPLES = {train.num_examples} (or change the split)."
        )
    return train, test


def _test_examples(eval_examples, test):
    """How many test examples each evaluation uses; says so when eval_examples asks for more.

    Raises:
      ValueError: eval_examples that is not None or a positive int.
    """
    if eval_examples is None:
        return test.num_examples
    if isinstance(eval_examples, bool) or not isinstance(eval_examples, int) or (
            eval_examples < 1):
        raise ValueError(f"eval_examples must be None (the whole test split) or a positive "
                         f"int, got {eval_examples!r}.")
    if eval_examples > test.num_examples:
        logging.warning(
            "eval_examples=%d is more than the %d examples of the test split %r of %s: every "
            "evaluation uses all %d (metrics.jsonl says test_examples=%d).", eval_examples,
            test.num_examples, test.split, test.name, test.num_examples, test.num_examples)
    return min(eval_examples, test.num_examples)


def _check_workdir(workdir, mechanism, splits, data_fingerprint, *, audit, sampling_seed,
                   noise_seed):
    """Stage 3: what the workdir allows this run to do; read only (the chief holds the lock).

    A workdir without a checkpoint to resume must hold no output of an
    earlier run (`tfdp.workdir.earlier_run_outputs`). A checkpoint (read in
    full: a corrupt one is named, `tfdp.workdir.resume_checkpoint`) must hold
    this mechanism and no more steps than planned (`check_privacy_ledger`).
    A finished run (all steps and FINISHED, `tfdp.workdir.finished`) is not
    redone: the same settings return its report untouched, once every file
    FINISHED vouches for is checked against the digests it recorded
    (`tfdp.workdir.changed_since_finished`); a changed file is named and
    refused. A run with all its steps but no FINISHED (killed, or a full
    disk, while exporting) goes on to write its export and report. A resume
    follows `tfdp.resume_rule`: a setting that changes training (optimizer,
    learning rate, model, augmentation, ...) and differs from the
    checkpoint's is refused by name, before anything is built, so that a run
    never prints a setting that the restored checkpoint overrides; settings
    that change neither the model nor its metrics (more steps, evaluation
    interval, devices, ...) may change, and are logged. A private run's
    checkpoint is never resumed by a non-private run (`mechanism` a
    `NonPrivatePlan`), nor the other way round (`check_non_private_ledger`,
    `check_privacy_ledger`). Nor is it resumed, or its finished report
    returned, on other data: the fingerprints of `splits` (`{"train": ...,
    "test": ...}`, the opened splits, whose `data_fingerprint` this run has
    computed; `tfdp.data.fingerprint`) must equal the ones its ledger recorded.

    Returns:
      `(latest, report)`: the checkpoint to resume (or None), and the
      finished run's report (or None when there is work left to do).

    Raises:
      tfdp.workdir.WorkdirError: outputs of an earlier run without a
        checkpoint, a corrupt checkpoint, or a finished workdir whose files
        differ from what FINISHED recorded.
      ValueError: from `check_privacy_ledger`, an audit asked to resume, or
        settings that a resume cannot change (`tfdp.resume_rule`).
    """
    latest = workdir_lib.resume_checkpoint(os.path.join(workdir, CHECKPOINT_DIR))
    if not latest:
        found = workdir_lib.earlier_run_outputs(workdir)
        if found:
            workdir_lib.refuse_used_workdir(workdir, found)
        return None, None
    if audit is not None:
        raise ValueError(f"An audit draws new canaries, so it cannot resume {latest}: use a "
                         "fresh workdir.")
    private = isinstance(mechanism, accounting.DPMechanism)
    if private:
        steps, saved_config = callbacks_lib.check_privacy_ledger(
            latest, mechanism, sampling_seed=sampling_seed, noise_seed=noise_seed)
    else:  # refuses a private run's checkpoint
        steps, saved_config = callbacks_lib.check_non_private_ledger(latest, mechanism.num_steps)
    changes = resume_rule.changed_settings(saved_config, gin.config_str())
    refused = [change for change in changes if not change.resumable]
    if not refused:  # (a changed split, dataset or source is refused below, by its name)
        _check_same_data(workdir, latest, steps, splits, data_fingerprint,
                         resuming=steps < mechanism.num_steps)
    harmless = "\n  ".join(line for change in changes if change.resumable
                           for line in change.lines())
    finished = workdir_lib.finished(workdir)
    if steps == mechanism.num_steps:
        if refused:
            what = ("a finished run" if finished else
                    "a run trained for all its steps (its export is not finished)")
            raise ValueError(
                f"{workdir} holds {what} of {steps} steps with other settings; "
                "nothing was changed. What differs (- that run, + this one):\n  "
                + "\n  ".join(line for change in refused for line in change.lines())
                + "\nUse a new workdir for the new settings.")
        if finished:
            changed = workdir_lib.changed_since_finished(workdir, finished)
            if changed:
                raise workdir_lib.WorkdirError(
                    f"{workdir} is finished ({workdir_lib.FINISHED_FILE}, {steps} steps), but "
                    f"files it vouches for changed since it was written:\n  "
                    + "\n  ".join(changed) + "\nIts report and export may not be this "
                    "run's, so they are not called unchanged; nothing was changed. Put the "
                    "original files back; or, to write this run's export and report again "
                    f"from its checkpoint, remove {workdir_lib.FINISHED_FILE}, {EXPORT_DIR}/ "
                    "and the report files and run the same command again.")
            if changed is not None:
                logging.info("%s already holds this finished run (%d steps; see %s); %s "
                             "(checked against the digests in %s).%s", workdir, steps,
                             workdir_lib.FINISHED_FILE, _what_was_checked(finished),
                             workdir_lib.FINISHED_FILE,
                             f" Settings that do not change it differ:\n  {harmless}"
                             if harmless else "")
                name = privacy_report.REPORT_JSON if private else privacy_report.NOT_PRIVATE_JSON
                return latest, json.loads(storage.read_text(os.path.join(workdir, name)))
            logging.warning("%s has a %s without file digests (an older tfdp), so its export "
                            "and report cannot be checked: writing them again from the "
                            "checkpoint.", workdir, workdir_lib.FINISHED_FILE)
        else:
            logging.warning("%s holds all %d steps of this run but no finished export and "
                            "report (no %s): writing them now.", workdir, steps,
                            workdir_lib.FINISHED_FILE)
    elif refused:
        raise ValueError(resume_rule.refusal(workdir, steps, changes))
    elif harmless:
        logging.warning("Resuming %s at step %d with changed settings that change neither the "
                        "model nor its metrics (- before, + now):\n  %s", workdir, steps,
                        harmless)
    return latest, None


def _what_was_checked(record):
    """What a rerun's check of a finished workdir covered, in words, for its message."""
    if EXPORT_DIR in record.get("files", []):
        return "its report and export are unchanged (every file under export/)"
    return (f"the {len(record.get('digests', {}))} files its {workdir_lib.FINISHED_FILE} lists "
            f"are unchanged (written by an older tfdp: other files under {EXPORT_DIR}/ are "
            "not covered)")


def _check_same_data(workdir, latest, steps, splits, data_fingerprint, *, resuming):
    """Refuses a workdir whose checkpoint was trained on other data than this run reads.

    A checkpoint without fingerprints (an older tfdp) cannot be checked: its
    resume is refused; its finished report is returned with a warning.

    Raises:
      ValueError: naming each split whose fingerprint differs.
    """
    saved = callbacks_lib.saved_data_fingerprint(latest)
    if saved is None:
        if resuming:
            raise ValueError(
                f"{workdir} holds a run stopped at step {steps} whose checkpoint does not "
                "record which data it was trained on (written by an older tfdp), so a resume "
                "cannot check that it trains on the same examples: the accountant counts "
                "one dataset. Nothing was changed. Use a new workdir.")
        logging.warning("%s: its checkpoint does not record which data it was trained on (an "
                        "older tfdp); its data cannot be compared with this run's.", workdir)
        return
    changed = fingerprint.compare(saved, splits, data_fingerprint)
    if changed:
        raise ValueError(
            f"{workdir} holds a run of {steps} steps trained on other data than this command "
            "reads (the checkpoint's -> this command's):\n  " + "\n  ".join(changed)
            + "\nA resume must train on the examples its first steps were taken on: the "
            "accountant composes every step on one dataset, and the report's metrics are of "
            "one test set. Nothing was changed. Point data_dir (or $TFDS_DATA_DIR) at the data "
            "the run started on, or use a new workdir for this data. (The same dataset "
            "prepared again by another TFDS or array_record version can differ in its bytes: "
            "then too, use the files the run started on.)")


@contextlib.contextmanager
def _stops_cleanly(out_dir):
    """Turns a failed write (full disk, read-only folder) into a WorkdirError; tidies up.

    What a failed checkpoint save left (`ckpt-N_temp/`, part of `ckpt-N.*`)
    is removed, so nothing looks like progress that is not; checkpoints
    already saved stay, and the same command resumes from them.
    """
    checkpoint_dir = os.path.join(out_dir, CHECKPOINT_DIR)
    before = set(storage.listdir(checkpoint_dir)) if storage.isdir(checkpoint_dir) else set()
    try:
        yield
    except (OSError, tf.errors.OpError) as e:
        if not _is_failed_write(e):
            raise
        workdir_lib.remove_partial_checkpoints(checkpoint_dir, before)
        kept = tf.train.latest_checkpoint(checkpoint_dir)
        cause = ("fix the cause (free disk space, raise the file size limit `ulimit -f`, make "
                 "the workdir writable)")
        progress = (f"The checkpoint {kept} is kept; {cause} and run the same command again "
                    "to resume from it." if kept else
                    f"No checkpoint was kept; {cause} and run the same command again.")
        message = " ".join((getattr(e, "message", None) or str(e)).split())[:500]
        raise workdir_lib.WorkdirError(
            f"The run stopped on a failed write or read in {out_dir}: {type(e).__name__}: "
            f"{message}. {progress} The workdir is not finished (no "
            f"{workdir_lib.FINISHED_FILE}).") from e


# TensorFlow's ops that write files, and the errno texts of a failed write or read.
_WRITE_OPS = re.compile(r"\[Op:(SaveV2|MergeV2Checkpoints|WriteFile|Save|SaveSlices)\]")
_IO_ERRORS = re.compile(r"File too large|No space left|Disk quota exceeded|Read-only file "
                        r"system|Permission denied|Input/output error|Too many open files")


def _is_failed_write(error):
    """Whether `error` is a failed write or read of the workdir (any errno), not a bug.

    Python's OSError (any errno: ENOSPC, EFBIG, EROFS, EDQUOT, EIO, ...); TensorFlow's
    ResourceExhaustedError and PermissionDeniedError (a full disk, a read-only folder); and
    any other TensorFlow error raised by an op that writes files (SaveV2 reports EFBIG,
    "File too large", as OutOfRangeError) or that quotes an I/O errno.
    """
    if isinstance(error, data.DatasetNotFoundError):  # the data's fault, not the workdir's
        return False
    if isinstance(error, (OSError, tf.errors.ResourceExhaustedError,
                          tf.errors.PermissionDeniedError)):
        return True
    message = getattr(error, "message", None) or str(error)
    return bool(_WRITE_OPS.search(message) or _IO_ERRORS.search(message))


def _check_builder_bindings(model_fn):
    """Refuses gin bindings of what the trainer passes to `model_fn` itself.

    The trainer calls `model_fn(num_classes=..., input_shape=...)` from the
    data, and gin lets explicit arguments win over bindings silently, so a
    binding such as `build_tramer_cnn.num_classes = 5` would be ignored.
    """
    try:
        bound = sorted(set(gin.get_bindings(model_fn)) & {"num_classes", "input_shape"})
    except (ValueError, TypeError):  # not a gin configurable: nothing can be bound
        return
    if bound:
        raise ValueError(
            f"model_fn's {', '.join(bound)} is bound in the gin config, but the trainer sets "
            "it from the dataset (and gin would ignore the binding). Remove the binding; "
            "change the dataset or image_size instead.")


def _check_output_width(model, num_classes, dataset):
    """Refuses a model whose logits do not cover the dataset's classes, before training.

    Otherwise the first labels past the logits fail deep inside the loss, with
    a long TF traceback.
    """
    width = model.output_shape[-1] if len(model.output_shape) == 2 else None
    if width != num_classes:
        raise ValueError(
            f"model_fn built a model with output shape {model.output_shape}, but {dataset!r} "
            f"has {num_classes} classes: the model must return logits [batch, {num_classes}]. "
            "Check model_fn and its num_classes.")


def _restore(dp_model, ledger, out_dir, latest):
    """Stage 6: restores `latest`, or saves checkpoint 0 with the fresh coins.

    Returns:
      `(manager, start_step)`.
    """
    parts = {"model": dp_model, "optimizer": dp_model.optimizer, "ledger": ledger}
    if hasattr(dp_model, "noise_generator"):  # a NonPrivateModel has none
        parts["noise_generator"] = dp_model.noise_generator
    checkpoint = tf.train.Checkpoint(**parts)
    # Every worker saves (saving may run collectives); only the chief's copy is kept.
    manager = tf.train.CheckpointManager(
        checkpoint, os.path.join(out_dir, CHECKPOINT_DIR), max_to_keep=2
    )
    if latest:
        checkpoint.restore(latest).expect_partial()
        # The settings now in force (the resume rule let only harmless ones change): the
        # next checkpoints record them, for the next rerun's comparison.
        ledger.config.assign(gin.config_str())
        logging.info("Resumed from %s.", latest)
    start_step = int(dp_model.optimizer.iterations.numpy())
    if int(ledger.steps.numpy()) != start_step:
        raise ValueError(
            f"The checkpoint's privacy ledger records {int(ledger.steps.numpy())} steps but its "
            f"optimizer has taken {start_step}; the checkpoint is inconsistent. Use a fresh "
            "workdir."
        )
    if not latest:
        # A restart before the first interval then continues the same sample
        # and noise streams instead of drawing new secret coins.
        callbacks_lib.save_checkpoint(manager, ledger, 0)
    return manager, start_step


def _fit(dp_model, mechanism, manager, ledger, train_ds, eval_ds, out_dir, *, start_step,
         checkpoint_every_steps, eval_every_steps, augtest, simulation, progress_bar,
         test_examples):
    """Stage 7: `fit` over checkpoint intervals, evaluating every eval_every_steps.

    Every metrics.jsonl line states `test_examples`, the test examples each
    evaluation used.
    """
    if start_step >= mechanism.num_steps:
        return
    private = isinstance(mechanism, accounting.DPMechanism)
    callbacks = [
        callbacks_lib.EvaluationEpochsOnly(
            evaluation.ExtraEvaluation(dp_model, eval_ds, augtest=augtest)),
        callbacks_lib.PrivacyCallback(mechanism) if private
        else callbacks_lib.StepCallback(mechanism.num_steps),
        callbacks_lib.ProgressLog(mechanism, bar=progress_bar),
        callbacks_lib.CheckpointCallback(manager, ledger),
        callbacks_lib.MetricsJsonl(
            os.path.join(out_dir, METRICS_FILE),
            extra={"test_examples": test_examples,
                   **(({"simulation": True} if simulation else {}) if private
                      else {"privacy": NOT_PRIVATE})},
        ),
        callbacks_lib.OperativeConfigSaver(os.path.join(out_dir, OPERATIVE_CONFIG)),
        callbacks_lib.TensorBoardScalars(os.path.join(out_dir, "tensorboard")),
    ]
    # fit epochs are checkpoint intervals; only some of them evaluate.
    epochs, initial_epoch, validation_freq = _fit_schedule(
        mechanism.num_steps, start_step, checkpoint_every_steps, eval_every_steps)
    dp_model.fit(
        train_ds,
        epochs=epochs,
        initial_epoch=initial_epoch,
        steps_per_epoch=checkpoint_every_steps,
        validation_data=eval_ds,
        validation_freq=validation_freq,
        callbacks=callbacks,
        verbose=0,  # ProgressLog shows steps of the whole run, not fit's epochs
    )


def _finish(report, dp_model, export_model, out_dir, *, image_shape):
    """Stage 8: the SavedModel (EMA parameters when EMA is on), the report, then FINISHED.

    `export_model` takes images: the trained model, or a frozen feature
    extractor composed with the trained head (sharing its variables).

    The report is first written to a temporary folder and copied into the
    SavedModel's assets; the SavedModel goes to `export/` atomically
    (`tfdp.export.saved_model`); the report files are then renamed into the
    workdir, read back and compared with the export's copy, and only then is
    `FINISHED` written (atomically, `tfdp.workdir.write_finished`). A kill or
    a full disk at any point leaves a workdir without FINISHED, which a rerun
    finishes. Temporaries of an earlier, killed finish (`.export.tmp-*`,
    `.export.old-*`, `.report.tmp-*`) are removed first: under the lock,
    nothing else writes them.

    The chief writes them once; other workers export too (the save may run
    collectives) into their temp dir, which the caller deletes.

    A non-private run's `report` (`"privacy": "NOT PRIVATE"`) is written as
    `NOT_PRIVATE.{json,md}` instead, by the same steps, and FINISHED says
    "privacy": "NOT PRIVATE" instead of epsilon and delta.
    """
    workdir_lib.remove_stale_temporaries(out_dir)
    private = report.get("privacy") != NOT_PRIVATE
    write, files = ((privacy_report.write_privacy_report,
                     [privacy_report.REPORT_JSON, privacy_report.REPORT_MD]) if private else
                    (privacy_report.write_not_private_report,
                     [privacy_report.NOT_PRIVATE_JSON, privacy_report.NOT_PRIVATE_MD]))
    # Beside the outputs on a local disk (renamed into place); in a local temp folder for a
    # URL workdir (each file then uploaded as one object).
    tmp = tempfile.mkdtemp(prefix=".report.tmp-",
                           dir=None if storage.is_url(out_dir) else out_dir)
    try:
        paths = write(report, tmp)
        with dp_model.use_ema_parameters():
            saved_model.export_saved_model(
                export_model, os.path.join(out_dir, EXPORT_DIR), image_shape=image_shape,
                asset_paths=paths, overwrite=True,
            )
        for path in paths:
            storage.move(path, os.path.join(out_dir, os.path.basename(path)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name in files:
        if storage.read_bytes(os.path.join(out_dir, name)) != storage.read_bytes(
                os.path.join(out_dir, EXPORT_DIR, "assets", name)):
            raise RuntimeError(f"{name} differs from the export's copy; not finished.")
    if json.loads(storage.read_text(os.path.join(out_dir, files[0])))["steps"] != report["steps"]:
        raise RuntimeError("The privacy report read back is not this run's; not finished.")
    workdir_lib.write_finished(out_dir, {
        "steps": report["steps"],
        **({"epsilon": report["epsilon"], "delta": report["delta"]} if private
           else {"privacy": NOT_PRIVATE}),
        # The report and the whole export (every file under it: the SavedModel's graph,
        # fingerprint, variables and assets, the report's copies); FINISHED records the
        # size and SHA-256 of each file, and a rerun checks them and any file added since.
        "files": [*files, EXPORT_DIR],
    })


def _feature_extractor(features, model_fn, train, *, augmult, augmentation):
    """Stage 4a: the frozen public feature extractor (`tfdp.models.FrozenFeatureExtractor`), if any.

    One mechanism for two cases. `features="scatternet"`: the ScatterNet
    (Tramer & Boneh 2021, App. C.1), whose head `model_fn` builds later on
    the feature shape. `features=None`: `model_fn` builds the model on
    pixels; if only its head trains (`build_finetune_model` with
    trainable="head") and there is no augmentation (augmult 0), its frozen
    trunk is the extractor and its head is trained on cached features (De et
    al. 2022, Table 20: last layer, augmult 0). With augmult > 0 the trunk
    runs forward on every view instead, and only the head's variables get
    gradients.

    Returns:
      `(extractor, model, backbone)`: the extractor or None, the model built
      on pixels (None for ScatterNet, whose head is built on the features),
      and the model's pretrained backbone's provenance
      (`tfdp.models.backbone_provenance`) or None.

    Raises:
      ValueError: an unknown `features`, or a backbone trained on examples of
        this run's private split (`_check_backbone_data`).
    """
    if features == "scatternet":
        image_shape = train.image_shape
        return models.FrozenFeatureExtractor(
            name="scatternet", compute_features=models.compute_scatternet_features,
            compose=lambda head: models.build_scatternet_classifier(head, image_shape)
        ), None, None
    if features is not None:
        raise ValueError(f"Unknown features {features!r}; use None or 'scatternet'.")
    model = model_fn(num_classes=train.num_classes, input_shape=train.image_shape)
    backbone = _check_backbone_data(model, train)
    extractor = models.frozen_feature_extractor(model)
    if extractor is not None and (augmult > 0 or augmentation is not None):
        logging.info("Only the head trains, but with augmult=%d the %s runs forward on every "
                     "view (no backward pass through it) instead of once.", augmult,
                     extractor.name)
        return None, model, backbone
    return extractor, (None if extractor is not None else model), backbone


def _check_backbone_data(model, train):
    """The provenance of `model`'s pretrained backbone, refused if it saw this run's data.

    The guarantee of a fine-tuning run covers its own training only: the
    backbone's weights are a released function of the backbone's training
    data, which must therefore be public or disjoint from the private data
    (De et al. 2022, Sec. 4: pretraining on public data). For a tfdp-workdir
    backbone this is checked: a backbone trained (privately or not) on a
    split of the same dataset (any spelling TFDS accepts: versions and configs
    do not make another dataset, `tfdp.data.dataset_identity`) that shares an
    example with this run's split is refused, and so is one trained on
    another dataset built from the same images (`tfdp.data.image_collection`:
    ImageNet-32 and ImageNet), whose examples cannot be matched. Where the
    splits cannot be compared (a JPEG folder, a name that is not a TFDS
    dataset), the backbone is reported as not checked, with why. Keras files
    and keras.applications weights cannot be checked; the report says so.

    Returns:
      The provenance dict (`tfdp.models.backbone_provenance`), or None for a
      model without a pretrained backbone.

    Raises:
      ValueError: on a backbone trained on overlapping data or on the same
        collection of images, or a backbone workdir that does not record its
        dataset.
    """
    backbone = getattr(model, models.finetune.PROVENANCE_ATTRIBUTE, None)
    if backbone is None:
        return None
    if not backbone["verified"]:
        logging.warning(
            "The pretrained backbone %s (%s) cannot be checked: this run's guarantee assumes "
            "its training data is public, or disjoint from %s %s. The report says so.",
            backbone["source"], backbone["kind"], train.name, train.split)
        return backbone
    if backbone["dataset"] is None:
        raise ValueError(
            f"The backbone workdir {backbone['source']} does not record the dataset it was "
            "trained on (its operative_config.gin binds no tfdp.train_and_evaluate.dataset), "
            "so tfdp cannot check that it shares no example with this run's private data. "
            "Export it as a .keras file if its training data is public.")
    why_not = _backbone_not_comparable(backbone, train)
    if why_not:
        logging.warning(
            "The pretrained backbone %s was trained on %s %r, which tfdp cannot compare with "
            "this run's %s %r (%s): this run's guarantee assumes the two share no example. "
            "The report says so.", backbone["source"], backbone["dataset"],
            backbone["train_split"], train.name, train.split, why_not)
        return dict(backbone, verified=False, not_checked_because=why_not)
    trained = ("WITHOUT privacy" if backbone["privacy"] == "NOT PRIVATE" else
               f"at epsilon = {backbone['privacy']['epsilon']:.4g}")
    # Datasets are compared as TFDS identities, not strings: "fashion_mnist:3.0.1" and
    # "Fashion_MNIST" are fashion_mnist (tfdp.data.dataset_identity).
    if data.same_dataset(backbone["dataset"], train.name):
        if data.splits_overlap(train.name, backbone["train_split"], train.split,
                               data_dir=train.data_dir,
                               image_size=getattr(train, "image_size", None)):
            raise ValueError(
                f"The backbone {backbone['source']} was trained {trained} on "
                f"{backbone['dataset']} {backbone['train_split']!r}, which shares examples with "
                f"this run's private split {train.split!r} of {train.name}. Its weights would "
                "release those examples outside this run's guarantee. Pretrain on a disjoint "
                "public split (e.g. 'train[:2000]' and fine-tune on 'train[2000:]'), or train "
                "from scratch.")
    elif data.image_collection(backbone["dataset"]) == data.image_collection(train.name):
        raise ValueError(
            f"The backbone {backbone['source']} was trained {trained} on "
            f"{backbone['dataset']} {backbone['train_split']!r}, a dataset built from the same "
            f"images as this run's {train.name} ({data.image_collection(train.name)}), whose "
            "examples tfdp cannot match against this run's split: it may have seen this run's "
            "private examples. Pretrain on another collection of images.")
    return backbone


def _backbone_not_comparable(backbone, train):
    """Why the backbone's training split cannot be matched with `train`'s, or None.

    Splits are matched as ranges of one TFDS dataset's example order; a JPEG
    folder's slices follow its own index table instead, and a name that TFDS
    cannot parse (a JPEG folder's free-text name) names no TFDS dataset.
    """
    sources = {backbone.get("input_source", "array_record"),
               "jpeg_folder" if isinstance(train, data.JPEGFolderSource) else "tfds"}
    if "jpeg_folder" in sources:
        return "a JPEG folder's slices follow its own index table, not a TFDS example order"
    for name in (backbone["dataset"], train.name):
        if not data.is_tfds_dataset(name):
            return f"{name!r} is not a TFDS dataset"
    return None


def _features(train, test, extractor, data_normalization, workdir):
    """Stage 4b: replaces pixels by cached features, privately normalized if asked.

    The features of every image are computed once by the frozen extractor
    and held in memory (`tfdp.data.ArraySource`): fine for the small
    datasets the ScatterNet and fine-tuning configs use (Fashion-MNIST,
    CIFAR-10: about 1 GB of float32 ScatterNet features, far less for a
    backbone's pooled features), not meant for ImageNet. Without an
    extractor, the splits stay on disk.

    The private mean and variance are released once per run: they are saved,
    with the sigma and bounds they were released under, to
    `workdir/data_normalization.json` and reused on resume, so a restarted run
    never draws (and spends privacy on) a second noisy release. A saved
    release under other settings is refused, never reused.

    Args:
      train, test: the splits' sources (`tfdp.data.TFDSSource`).
      extractor: None or a `tfdp.models.FrozenFeatureExtractor`.
      data_normalization: None, or the mechanism's `DataNormalization`
        (ScatterNet only: the head builder takes the released statistics).
      workdir: where the release is kept.

    Returns:
      `(train, test, head_kwargs)`: the sources (`ArraySource`s of float32
      `[N, h, w, K]` features, or the `TFDSSource`s unchanged), and the keyword
      arguments that pass the private feature mean and variance to the head
      builder.

    Raises:
      ValueError: data normalization without ScatterNet features, or a
        saved release whose settings differ from `data_normalization`.
    """
    if data_normalization and (extractor is None or extractor.head is not None):
        raise ValueError("data_normalization needs features='scatternet'.")
    if extractor is None:
        return train, test, {}
    path = os.path.join(workdir, DATA_NORMALIZATION_FILE)
    released = None
    if data_normalization and storage.exists(path):
        released = json.loads(storage.read_text(path))
        settings = dataclasses.asdict(data_normalization)
        if released.get("released_with") != settings:
            raise ValueError(
                f"{path} holds a private normalization released with "
                f"{released.get('released_with', 'unrecorded settings')}, but this run asks for "
                f"{settings}. Reusing it would misstate the privacy cost, and releasing "
                "another would spend privacy twice in one workdir: restore the original "
                "settings, or use a new workdir.")
    logging.info("Computing the features of the %s for %d + %d images once.",
                 extractor.name, train.num_examples, test.num_examples)
    pure_tf = train.pure_tf  # the features keep the input's sampler (numpy or in-graph)
    train, test = (data.read_split(source) for source in (train, test))
    train = train._replace(images=extractor.compute_features(train.images))
    test = test._replace(images=extractor.compute_features(test.images))
    sources = data.ArraySource(*train, pure_tf=pure_tf), data.ArraySource(*test, pure_tf=pure_tf)
    if not data_normalization:
        return (*sources, {})
    if released is None:
        from tfdp.dp import data_normalization as data_norm  # pylint: disable=g-import-not-at-top

        mean, variance = data_norm.private_channel_mean_and_var(
            train.images,
            l2_clip_norm_mean=data_normalization.l2_clip_norm_mean,
            l2_clip_norm_square=data_normalization.l2_clip_norm_square,
            noise_multiplier=data_normalization.noise_multiplier,
            threshold=data_normalization.threshold,
        )
        released = {"feature_mean": mean.numpy().tolist(),
                    "feature_variance": variance.numpy().tolist(),
                    "released_with": dataclasses.asdict(data_normalization)}
        storage.makedirs(workdir)
        storage.write_whole(path, json.dumps(released))
    return (*sources, {k: np.asarray(released[k], np.float32)
                       for k in ("feature_mean", "feature_variance")})


def _record_in_study(study_dir, workdir, mechanism, *, sampling_seed):
    """Appends this run's mechanism to the study ledger; returns the study's epsilon."""
    accounting.append_run(
        study_dir, run_name=os.path.basename(os.path.normpath(workdir)),
        mechanism=mechanism, sampling_seed=sampling_seed,
    )
    epsilon, runs = accounting.study_epsilon(study_dir, delta=mechanism.delta,
                                             accountant=mechanism.accountant)
    return {"dir": str(study_dir), "epsilon": epsilon, "delta": mechanism.delta,
            "runs": {name: eps for name, eps in runs}}


def _train_dataset(train, mechanism, *, seed, start_step, augment_fn, augment_seed, augmult,
                   static_batch_size=None, num_replicas=1, accumulation_steps=1):
    """The chunks of the logical batches that some replicas read: a builder per host.

    Returns `make_chunks(replicas: range) -> tf.data.Dataset` for
    `tfdp.training.distribute.distribute_chunks`: Poisson (or shuffled)
    index vectors, padded/truncated to the static size (or to a multiple of
    R * accumulation_steps), cut into R * accumulation_steps chunks, of which
    only `replicas`' are read, decoded and given their augmult views
    (`tfdp.data.train_chunks`). Each element is one chunk `(views, labels,
    mask)`; host memory holds a few chunks, not a logical batch.

    `train` is the split's source (`tfdp.data.TFDSSource`, or `ArraySource`
    for cached features). `seed` is the secret sampling seed
    (`tfdp.dp.coins`); `augment_seed` the public one of the augmentations. An
    example's views at step t depend on (augment_seed, t, its pixels) only
    (`tfdp.augment.example_keyed_views`), so they are the same whatever
    chunk, replica or host reads it.
    """
    map_fn = None
    if augment_fn is not None:
        base_seed = augment.as_seed(augment_seed)

        def map_fn(step, images, labels):
            views = augment.example_keyed_views(
                images, tf.random.fold_in(base_seed, step), augment_fn=augment_fn,
                augmult=augmult)
            # Views stay uint8 pixels: 4x less host and device memory than float32.
            return augment.to_uint8_pixels(views), labels

    def make_chunks(replicas):
        return data.train_chunks(
            train, sampling=mechanism.sampling, batch_size=mechanism.batch_size,
            num_steps=mechanism.num_steps, seed=seed, start_step=start_step,
            num_replicas=num_replicas, accumulation_steps=accumulation_steps,
            replicas=replicas, static_batch_size=static_batch_size, map_fn=map_fn)

    return make_chunks


def _checkpoint_interval(checkpoint_every_steps, eval_every_steps):
    """The checkpoint interval, which must divide the evaluation interval.

    `fit` epochs are checkpoint intervals, so that checkpoints, evaluations and
    the last step all fall on epoch ends and a resumed run keeps the same
    epoch (and evaluation) boundaries as an uninterrupted one.

    Raises:
      ValueError: if either is < 1 or checkpoint_every_steps does not divide
        eval_every_steps.
    """
    if int(eval_every_steps) < 1:
        raise ValueError(f"eval_every_steps must be >= 1, got {eval_every_steps}.")
    if checkpoint_every_steps is None:
        return int(eval_every_steps)
    if int(checkpoint_every_steps) < 1 or eval_every_steps % checkpoint_every_steps:
        raise ValueError(
            f"checkpoint_every_steps={checkpoint_every_steps} must be >= 1 and divide "
            f"eval_every_steps={eval_every_steps} (every evaluation is also a checkpoint); "
            f"e.g. use a divisor of {eval_every_steps}."
        )
    return int(checkpoint_every_steps)


def _fit_schedule(num_steps, start_step, checkpoint_every_steps, eval_every_steps):
    """`fit` arguments: epochs of `checkpoint_every_steps`, validation on evaluations.

    Returns:
      `(epochs, initial_epoch, validation_freq)`: validation_freq lists the
      1-based epochs that end on a multiple of eval_every_steps, and the last.
    """
    epochs = math.ceil(num_steps / checkpoint_every_steps)
    validation_freq = [
        k for k in range(1, epochs + 1)
        if (k * checkpoint_every_steps) % eval_every_steps == 0 or k == epochs
    ]
    return epochs, start_step // checkpoint_every_steps, validation_freq


def _truncation(static_batch_size, mechanism, strategy, accumulation_steps):
    """Resolves `static_batch_size` into the mechanism's `Truncation` (`tfdp.data.padding`).

    Returns:
      None (variable batches), or a `tfdp.accounting.Truncation` with the
      static logical batch S and eta, the probability that any step's
      Poisson batch exceeded it.

    Raises:
      ValueError: on an invalid value, None under a TPU strategy, an S that
        is not a multiple of replicas * accumulation_steps, an S below the
        fixed batch size of shuffled sampling, or an S whose truncation term
        exceeds delta.
    """
    if static_batch_size is None:
        if isinstance(strategy, tf.distribute.TPUStrategy):
            raise ValueError(
                "strategy 'tpu' needs static batch shapes: set "
                "tfdp.train_and_evaluate.static_batch_size = 'auto' (or an int); the "
                "truncation bound is then stated in the privacy report."
            )
        return None
    num_replicas = strategy.num_replicas_in_sync
    unit = num_replicas * int(accumulation_steps)
    # The accountant's final epsilon bounds every intermediate one.
    epsilon = mechanism.epsilon()
    max_eta = mechanism.delta / 10.0 / (1.0 + math.exp(min(epsilon, 700.0)))
    if static_batch_size == "auto":
        if mechanism.sampling == "poisson":
            size = data.choose_static_batch_size(
                mechanism.num_examples, mechanism.sampling_prob, mechanism.num_steps, max_eta,
                multiple=unit)
        else:
            size = -(-mechanism.batch_size // unit) * unit
    elif isinstance(static_batch_size, int) and not isinstance(static_batch_size, bool):
        size = static_batch_size
    else:
        raise ValueError(
            f"static_batch_size must be None, a positive int or 'auto', got {static_batch_size!r}."
        )
    per_replica = distribute.per_replica_batch_size(size, num_replicas, accumulation_steps)
    if mechanism.sampling != "poisson":
        if size < mechanism.batch_size:
            raise ValueError(
                f"static_batch_size={size} is below the fixed batch size "
                f"{mechanism.batch_size} of shuffled batches; use 'auto' or at least the batch "
                "size."
            )
        eta = 0.0
    else:
        eta = data.truncation_probability(
            mechanism.num_examples, mechanism.sampling_prob, size, mechanism.num_steps)
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
                f"({suggested} here) or at least that."
            )
        if added > mechanism.delta / 10:
            logging.warning("static_batch_size=%d adds %.3g to delta=%g (truncation).",
                            size, added, mechanism.delta)
    logging.info("Static logical batch %d = %d replicas x %d chunks x %d slots; truncation "
                 "probability <= %.3g (the cap is on the logical batch).", size, num_replicas,
                 accumulation_steps, per_replica // int(accumulation_steps), eta)
    return accounting.Truncation(static_batch_size=size, per_replica_batch_size=per_replica,
                                 num_replicas=num_replicas, truncation_probability=eta,
                                 accumulation_steps=int(accumulation_steps))


def _hyperparameters(**kwargs):
    return json.loads(json.dumps(kwargs, default=str))
