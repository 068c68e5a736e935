"""train_and_evaluate: the gin root that runs the stages, in order.

Flow: plan (`tfdp.planning`) -> data (`tfdp.inputs`) -> workdir (`tfdp.run`)
-> features (`tfdp.features`) -> model (DPModel or NonPrivateModel,
`tfdp.modes`) -> restore -> fit (`tfdp.training.fit`) -> finish (report,
SavedModel, FINISHED). The settings come grouped by concern
(`tfdp.configs`); what differs between a private and a non-private run is
the mode's (`tfdp.modes`). Under a tf.distribute strategy
(`tfdp.training.distribute`) the model is built in the strategy's scope,
each host reads only its replicas' chunks of every (padded, masked) logical
batch, and only the chief writes the outputs.
"""

import dataclasses
import json
import re
import sys

import gin
import keras
import tensorflow as tf
from absl import logging

from tfdp import configs
from tfdp import data
from tfdp import features as features_lib
from tfdp import host
from tfdp import inputs
from tfdp import modes
from tfdp.data import fingerprint
from tfdp.run import Run
from tfdp.training import distribute
from tfdp.training import fit as fit_lib
from tfdp.training import optimizers  # also registers build_optimizer with gin


@gin.configurable(module="tfdp", denylist=["workdir", "audit"])
def train_and_evaluate(workdir, *, model_fn=gin.REQUIRED, privacy="dp", audit=None):
    """Trains a classifier (with DP-SGD by default), evaluates it, exports it with its report.

    The settings are read from gin, grouped by concern (`tfdp.configs`:
    `DataConfig`, `AugmentationConfig`, `PrivacyConfig`, `OptimizationConfig`,
    `EvaluationConfig`, `RuntimeConfig`). Privacy-coupled values (N, B, T,
    sigma, epsilon, delta, C) are macros defined once per config; the sampler,
    the model's step, the checkpoint, the study ledger and the report all read
    them from one plan (`tfdp.accounting.DPMechanism`).

    Nothing is written to `workdir` (and no private statistic is released)
    until every setting has been checked, the plan made, the data loaded and
    any checkpoint in the workdir checked against this run's plan. Stages:
    `_start` (strategy, determinism), `mode.plan`, `_open_data`, `Run.open`
    (lock, resume or refuse), `_build` (features, model, checkpoint record),
    `Run.restore`, `_fit`, `_finish` (report, SavedModel, then FINISHED).

    Args:
      workdir: output directory (docs/workdir.md: operative_config.gin,
        metrics.jsonl, tensorboard/, checkpoints/, privacy_report.{json,md},
        export/, and FINISHED last). A local path or gs:// URL; one run at a
        time (locked or leased). Not a gin value.
      model_fn: builder `(num_classes, input_shape=...) -> keras.Model`. A
        `tfdp.models.build_finetune_model` whose head alone trains, with
        augmult 0, has its frozen trunk's features computed once and its head
        trained on them; the export composes the two.
      privacy: "dp" (default: DP-SGD with `tfdp.PrivacyConfig`) or None:
        NON-PRIVATE training (`tfdp.modes.NonPrivateMode`,
        docs/non_private.md), for public pretraining and non-private ceilings.
      audit: None, or an empirical privacy audit's hooks (`tfdp.audit`, run
        by `tools/audit.py`; not a gin value; `tfdp.modes.AuditedMode`).

    Returns:
      The privacy report dict (non-private: the NOT_PRIVATE.json dict,
      `"privacy": "NOT PRIVATE"`, no epsilon).

    Raises:
      ValueError: an invalid or inconsistent setting (each config's and the
        plan's checks), a num_examples that does not match the data, a
        checkpoint this run may not resume (`tfdp.run`).
      tfdp.data.DatasetNotFoundError: the dataset is not prepared, or a shard
        is missing or corrupt; the message says what to run.
      tfdp.workdir.WorkdirError: (a ValueError) the workdir cannot be
        locked, is in use, holds an earlier run's outputs, a corrupt
        checkpoint; or a write failed (full disk), after which the same
        command resumes.
    """
    config = configs.RunConfig.from_gin(privacy)
    mode = modes.make_mode(config.privacy, audit)
    strategy = _start(config.runtime)
    plan = mode.plan(config, strategy)
    optimizers.refuse_step_miscounting(config.optimization.optimizer_fn(),
                                       where="tfdp.OptimizationConfig.optimizer_fn")
    context = RunContext(config=config, mode=mode, plan=plan, strategy=strategy)
    keras.utils.set_random_seed(config.runtime.seed)
    opened = _open_data(config=config, mode=mode)
    with Run.open(workdir, mode, plan, strategy=strategy, splits=opened.splits,
                  data_fingerprint=opened.fingerprints) as run:
        if run.finished_report is not None:
            if run.chief:  # a cache left behind (removal failed, or an older tfdp's)
                features_lib.remove_feature_cache(run.workdir)
            return run.finished_report
        resuming = run.latest is not None
        mode.check_start(plan, workdir=run.workdir, chief=run.chief, resuming=resuming)
        # The study line comes before the first release of private data: the private data
        # normalization, released while the model is built, if the run has one; else the
        # first step (after checkpoint 0), so that a run refused or killed before it leaves
        # no line and its rerun starts afresh.
        releases_first = getattr(plan, "data_normalization", None) is not None
        if releases_first:
            mode.start(plan, workdir=run.workdir, chief=run.chief, resuming=resuming)
        built = _build(context=context, run=run, model_fn=model_fn, opened=opened)
        manager, start_step = run.restore(built.dp_model, built.checkpoint_record)
        if not releases_first:
            mode.start(plan, workdir=run.workdir, chief=run.chief, resuming=resuming)
        if run.chief and built.features.unsaved is not None:  # checkpoint 0 exists now
            features_lib.write_feature_cache(run.workdir, built.extractor, opened.fingerprints,
                                             built.features.unsaved)
        _fit(context=context, run=run, built=built, manager=manager, start_step=start_step)
        return _finish(context=context, run=run, built=built)


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What every stage after planning reads, fixed before any I/O.

    Attributes:
      config: the run's `tfdp.configs.RunConfig` (the six groups).
      mode: the `tfdp.modes` object of the run (private, audited or non-private).
      plan: the mode's plan: a `tfdp.accounting.DPMechanism`, or a
        `tfdp.planning.NonPrivatePlan`.
      strategy: the `tf.distribute.Strategy` (`tfdp.training.make_strategy`).
    """

    config: configs.RunConfig
    mode: object
    plan: object
    strategy: object


@dataclasses.dataclass(frozen=True)
class OpenedData:
    """The two splits as opened and checked, before the workdir is touched (`_open_data`).

    Attributes:
      train, test: the splits' sources (`tfdp.data`), read by index: uint8
        images `[H, W, C]` and int labels.
      fingerprints: `{"train": ..., "test": ...}`, each split's
        `tfdp.data.fingerprint.split_fingerprint`, which a resume compares.
    """

    train: object
    test: object
    fingerprints: dict

    @property
    def splits(self):
        """`{"train": train, "test": test}`, as `tfdp.run.Run.open` takes them."""
        return {"train": self.train, "test": self.test}


@dataclasses.dataclass(frozen=True)
class BuiltRun:
    """The model and what it reads, built in the strategy's scope (`_build`).

    Attributes:
      train, test: the sources the model reads: the pixels' splits, or their
        cached features (a frozen extractor's, or ScatterNet's).
      extractor: the frozen public feature extractor (`tfdp.features`), or None.
      features: the `tfdp.features.Features`; its `unsaved` features are
        cached by the chief once checkpoint 0 exists.
      dp_model: the compiled Keras model: a `tfdp.training.DPModel`, or the
        non-private model of `tfdp.modes.NonPrivateMode`.
      checkpoint_record: the mode's privacy record (sampling seed, steps,
        `tfdp.training.record_variables`), checkpointed with the model.
      backbone: the pretrained backbone's provenance (dict), or None.
      image_shape: `(height, width, channels)` of the pixels (not features).
      test_examples: the test examples each evaluation reads (int).
      export_model: the model the SavedModel serves, on uint8 images
        (extractor and head composed when there is an extractor).
    """

    train: object
    test: object
    extractor: object
    features: object
    dp_model: object
    checkpoint_record: object
    backbone: object
    image_shape: tuple
    test_examples: int
    export_model: object


def _start(runtime):
    """The strategy (first, before any other op: multi-worker and TPU configure the runtime)."""
    strategy = distribute.make_strategy(runtime.strategy)
    if runtime.deterministic:
        tf.config.experimental.enable_op_determinism()
    # Once per run: the CPU flags and oneDNN state that every time in the log depends on.
    logging.info("%s", host.describe_host())
    return strategy


def _open_data(*, config, mode):
    """The two splits (read only), checked; and their fingerprints, which a resume compares."""
    train, test = inputs.load_data(config.data, prepare_train=mode.prepare_train)
    data.check_duplicates(train, private=mode.private)
    return OpenedData(train=train, test=test, fingerprints={
        "train": fingerprint.split_fingerprint(train),
        "test": fingerprint.split_fingerprint(test)})


def _build(*, context, run, model_fn, opened):
    """Features (frozen public extractors), the model and its DP (or plain) step, its record.

    Args:
      context: the `RunContext`.
      run: the open `tfdp.run.Run` (its workdir holds the feature cache).
      model_fn: the builder `(num_classes, input_shape=...) -> keras.Model`.
      opened: the `OpenedData`.

    Returns:
      A `BuiltRun`.
    """
    config, plan, strategy = context.config, context.plan, context.strategy
    train, test = opened.train, opened.test
    image_shape = train.image_shape
    test_examples = inputs.test_examples(config.evaluation.eval_examples, test)
    features_lib.check_builder_bindings(model_fn)
    aug = config.augmentation
    with strategy.scope():
        extractor, model, backbone = features_lib.feature_extractor(
            config.data.features, model_fn, train, augmult=aug.augmult,
            augmentation=aug.augmentation)
    features = features_lib.cached_features(
        train, test, extractor, plan.data_normalization, run.workdir,
        fingerprints=opened.fingerprints)
    train, test, head_kwargs = features.train, features.test, features.head_kwargs
    with strategy.scope():
        if extractor is not None:
            # The head on features: the fine-tuning model's own, or model_fn's (ScatterNet).
            model = extractor.head or model_fn(
                num_classes=train.num_classes, input_shape=train.image_shape, **head_kwargs)
        features_lib.check_output_width(model, train.num_classes, config.data.dataset)
        dp_model = context.mode.build_model(model, plan, config.optimization)
        dp_model.compile(optimizer=config.optimization.optimizer_fn(),
                         jit_compile=config.runtime.jit_compile)
    checkpoint_record = context.mode.make_checkpoint_record(
        plan, strategy=strategy, config_text=gin.config_str(),
        data=json.dumps(opened.fingerprints, sort_keys=True), seed=config.runtime.seed)
    return BuiltRun(train=train, test=test, extractor=extractor, features=features,
                    dp_model=dp_model, checkpoint_record=checkpoint_record, backbone=backbone,
                    image_shape=image_shape, test_examples=test_examples,
                    export_model=extractor.compose(model) if extractor else model)


def _fit(*, context, run, built, manager, start_step):
    """Trains to the planned step; a corrupt shard met by a batch is named, checkpoints kept.

    Args:
      context: the `RunContext`.
      run: the open `tfdp.run.Run` (metrics go to its `out_dir`).
      built: the `BuiltRun`.
      manager: the checkpoint manager `Run.restore` returned.
      start_step: the optimizer updates already taken (0, or the restored step).
    """
    config, mode, plan, strategy = context.config, context.mode, context.plan, context.strategy
    aug, evaluation, runtime = config.augmentation, config.evaluation, config.runtime
    augment_fn = aug.augment_fn()
    accumulation_steps = config.optimization.accumulation_steps
    train_ds = distribute.distribute_chunks(strategy, inputs.train_dataset(
        built.train, plan, seed=int(built.checkpoint_record.sampling_seed.numpy()),
        start_step=start_step,
        augment_fn=augment_fn, augment_seed=[runtime.seed, 1], augmult=aug.augmult,
        static_batch_size=plan.truncation and plan.truncation.static_batch_size,
        num_replicas=strategy.num_replicas_in_sync, accumulation_steps=accumulation_steps,
    ), accumulation_steps=accumulation_steps)
    eval_ds = data.eval_batches(built.test, batch_size=evaluation.eval_batch_size,
                                num_examples=evaluation.eval_examples)
    try:
        fit_lib.fit(
            built.dp_model, plan, step_callback=mode.step_callback(plan),
            metrics_fields=mode.metrics_fields(), manager=manager,
            checkpoint_record=built.checkpoint_record,
            train_ds=train_ds, eval_ds=eval_ds, out_dir=run.out_dir, start_step=start_step,
            checkpoint_every_steps=config.checkpoint_every_steps,
            eval_every_steps=evaluation.eval_every_steps,
            augtest=(augment_fn, aug.augmult, [runtime.seed, 2]) if aug.augtest else None,
            test_examples=built.test_examples,
            progress_bar=(sys.stdout.isatty() if runtime.progress_bar is None
                          else runtime.progress_bar))
    except tf.errors.OpError as error:
        # A corrupt shard met by a batch (a split too large to read whole at start):
        # the source kept the clear error that TensorFlow wrapped.
        kept = ("The checkpoints saved so far are kept: once the data is fixed, the same "
                "command resumes.")
        try:
            data.raise_read_error(built.train, built.test)
        except data.DatasetNotFoundError as e:
            raise data.DatasetNotFoundError(f"{e} {kept}") from None
        changed = changed_file_message(str(error.message))
        if changed:  # the source's own message, which names the file (`jpeg_folder`)
            raise data.DatasetNotFoundError(f"{changed} {kept}") from None
        raise


def changed_file_message(text):
    """The JPEG folder's "changed after it was indexed" message in `text`, as one line; or None.

    `tf.debugging.Assert` prints each of its items in brackets in a graph
    (`[a:] [/path] [has]`), and as bytes literals eagerly (`b'a:' b'/path'`).
    """
    found = re.search(r"A file of the JPEG folder changed after it was indexed:.*?index again\.",
                      " ".join(text.split()))
    return found and re.sub(r"['\]] b?['\[]", " ", found.group(0))


def _finish(*, context, run, built):
    """The report (the mode's), the SavedModel and FINISHED; returns the report."""
    config, mode, plan = context.config, context.mode, context.plan
    steps_done = int(built.dp_model.optimizer.iterations.numpy())
    if steps_done != plan.num_steps:
        raise RuntimeError(
            f"Training stopped at step {steps_done}, not the planned {plan.num_steps}; "
            "no privacy report or export was written.")
    report = mode.report(plan, config=config, dp_model=built.dp_model,
                         checkpoint_record=built.checkpoint_record,
                         steps_done=steps_done, workdir=run.workdir, chief=run.chief)
    if built.backbone is not None:  # outside this run's guarantee: the report says whence
        report["backbone"] = built.backbone
    if run.chief:  # features of private examples: kept no longer than the run needs them
        features_lib.remove_feature_cache(run.workdir)
    run.finish(report, built.dp_model, built.export_model, image_shape=built.image_shape)
    mode.say_done(report, run.export_dir)
    return report
