"""train_and_evaluate: the gin root that wires data, model, DP-SGD and export.

Flow: data (TFDS, Poisson sampling) -> augment (augmult views) -> model ->
DPModel (per-example clipping, noise once per logical batch) -> fit with
callbacks (epsilon, metrics.jsonl, TensorBoard, checkpoints) -> privacy report
-> SavedModel. Under a tf.distribute strategy (`tfdp.training.distribute`) the
model is built in the strategy's scope, each replica trains on its slice of
every (padded, masked) logical batch, and only the chief writes the outputs.
"""

import json
import math
import os
import shutil
import sys

import gin
import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdp import augment
from tfdp import data
from tfdp import models
from tfdp.export import privacy_report
from tfdp.export import saved_model
from tfdp.training import callbacks as callbacks_lib
from tfdp.training import distribute
from tfdp.training import evaluation
from tfdp.training import optimizers  # noqa: F401  (registers build_optimizer)
from tfdp.training import privacy
from tfdp.training.dp_model import DPModel

METRICS_FILE = "metrics.jsonl"
OPERATIVE_CONFIG = "operative_config.gin"
EXPORT_DIR = "export"
CHECKPOINT_DIR = "checkpoints"
DATA_NORMALIZATION_FILE = "data_normalization.json"


@gin.configurable(module="tfdp", denylist=["workdir"])
def train_and_evaluate(
    workdir,
    *,
    dataset=gin.REQUIRED,
    num_examples=gin.REQUIRED,
    batch_size=gin.REQUIRED,
    num_steps=gin.REQUIRED,
    l2_clip_norm=gin.REQUIRED,
    target_delta=gin.REQUIRED,
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
    noise_seed=None,
    progress_bar=None,
    strategy="default",
    static_batch_size=None,
    checkpoint_every_steps=None,
    deterministic=False,
):
    """Trains a classifier with DP-SGD, evaluates it, exports it with its report.

    Privacy-coupled values (num_examples, batch_size, num_steps,
    noise_multiplier, target_epsilon, target_delta, l2_clip_norm) come from gin
    macros defined once per config; the sampler, DPModel and the accountant all
    read them from one `PrivacyPlan`.

    Args:
      workdir: output directory (see README: operative_config.gin, metrics.jsonl,
        tensorboard/, checkpoints/, privacy_report.{json,md}, export/).
      dataset: TFDS name, e.g. "fashion_mnist".
      num_examples: N, the size of the training split; checked against the data.
      batch_size: B, expected examples per optimizer update (logical batch).
      num_steps: T, optimizer updates (not epochs).
      l2_clip_norm: C, the per-example L2 bound.
      target_delta: delta at which epsilon is reported.
      noise_multiplier: sigma (noise std / C), or None to calibrate it to
        target_epsilon.
      target_epsilon: the budget; training never goes past it.
      model_fn: builder `(num_classes, input_shape=...) -> keras.Model`.
      optimizer_fn: builder `() -> keras.optimizers.Optimizer`.
      data_dir: TFDS data_dir (None: TFDS's default, ~/tensorflow_datasets).
      train_split, test_split: TFDS split names.
      accountant: "rdp" or "pld".
      sampling: "poisson" (default, what the accountant assumes) or "shuffle".
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
      study_dir: None, or a tuning-study directory: the run appends its DP
        event to the study's ledger and the report states the epsilon of the
        whole study (How to DP-fy ML, Sec. 5.4.2).
      eval_every_steps: optimizer updates between evaluations (each is also a
        checkpoint).
      eval_batch_size: evaluation batch size.
      eval_examples: evaluate on the first this-many test examples (None: all).
      seed: seed of sampling, augmentation and initialization.
      noise_seed: seed of the DP noise, or None for a non-deterministic one.
      progress_bar: Keras progress bar per step (None: only on a terminal).
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
        written at every evaluation and at the last step. It holds the model,
        EMA, optimizer (and step), noise-generator state and the privacy
        ledger; the input position is the step (batches are keyed by
        (seed, step)). A run restarted with the same command resumes there.
      deterministic: call `tf.config.experimental.enable_op_determinism()`
        (process-wide; slower) so that a fixed seed and noise_seed give
        identical weights.

    Returns:
      The privacy report dict.

    Raises:
      ValueError: on invalid or inconsistent privacy parameters, a
        num_examples that does not match the data, an unknown strategy, a
        static_batch_size that does not split evenly or truncates too often,
        a checkpoint_every_steps that does not divide eval_every_steps, a
        checkpoint written under another privacy plan, or augmentation asked
        together with precomputed `features`.
      tfdp.data.DatasetNotFoundError: if the dataset is not prepared; the
        message says what to run.
    """
    # First, before any other op: multi-worker and TPU strategies configure the runtime.
    dist = distribute.make_strategy(strategy)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    checkpoint_every_steps = _checkpoint_interval(checkpoint_every_steps, eval_every_steps)
    if features is not None and (augmult > 0 or augmentation is not None):
        raise ValueError(
            f"features={features!r} are computed once from the un-augmented images, so "
            f"augmentation={augmentation!r} and augmult={augmult} would transform feature "
            "maps, not images. Set augmult = 0 and augmentation = None for feature models."
        )
    keras.utils.set_random_seed(seed)

    plan = privacy.plan_privacy(
        num_examples=num_examples,
        batch_size=batch_size,
        num_steps=num_steps,
        l2_clip_norm=l2_clip_norm,
        target_delta=target_delta,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        accountant=accountant,
        sampling=sampling,
        data_normalization_noise=(data_normalization or {}).get("noise_multiplier"),
    )
    # Read by index from disk (ArrayRecord); no split is held in memory.
    train = data.TFDSSource(dataset, train_split, data_dir=data_dir, image_size=image_size)
    test = data.TFDSSource(dataset, test_split, data_dir=data_dir, image_size=image_size)
    if train.num_examples != num_examples:
        raise ValueError(
            f"NUM_EXAMPLES={num_examples} but the {dataset!r} split {train_split!r} has "
            f"{train.num_examples} examples. The accountant must use the real N: set "
            f"NUM_EXAMPLES = {train.num_examples} (or change the split)."
        )
    os.makedirs(workdir, exist_ok=True)
    if data_normalization and strategy == "multi_worker_mirrored":
        raise ValueError(
            "data_normalization is not supported under multi_worker_mirrored: every worker "
            "would draw its own private release. Run it on one worker first (the release is "
            f"saved to {DATA_NORMALIZATION_FILE} and reused), or use strategy 'mirrored'."
        )
    num_replicas = dist.num_replicas_in_sync
    chief = distribute.is_chief(dist)
    out_dir = distribute.output_dir(workdir, dist)  # workdir, or a temp dir off the chief
    image_shape = train.image_shape
    train, test, head_kwargs = _features(train, test, features, data_normalization, workdir)
    static_size, truncation = _static_batch_size(
        static_batch_size, plan, dist, accumulation_steps
    )
    with dist.scope():  # model, DP state and optimizer are mirrored; datasets are not
        model = model_fn(
            num_classes=train.num_classes, input_shape=train.image_shape,
            **head_kwargs
        )
        models.validate_dp_model(model)
        dp_model = DPModel(
            model,
            l2_clip_norm=plan.l2_clip_norm,
            noise_multiplier=plan.noise_multiplier,
            batch_size=plan.batch_size,
            accumulation_steps=accumulation_steps,
            normalize_update=normalize_update,
            noise_seed=noise_seed,
            num_microbatches=num_microbatches,
            ema_decay=ema_decay,
        )
        dp_model.compile(optimizer=optimizer_fn(), jit_compile=False)

    ledger = callbacks_lib.make_privacy_ledger(plan)
    checkpoint = tf.train.Checkpoint(
        model=dp_model, optimizer=dp_model.optimizer, noise_generator=dp_model.noise_generator,
        ledger=ledger,
    )
    # Every worker saves (saving may run collectives); only the chief's copy is kept.
    manager = tf.train.CheckpointManager(
        checkpoint, os.path.join(out_dir, CHECKPOINT_DIR), max_to_keep=2
    )
    latest = tf.train.latest_checkpoint(os.path.join(workdir, CHECKPOINT_DIR))
    if latest:
        checkpoint.restore(latest).expect_partial()
        logging.info("Resumed from %s.", latest)
    start_step = int(dp_model.optimizer.iterations.numpy())
    if latest:
        callbacks_lib.check_privacy_ledger(ledger, plan, start_step)
    if chief:
        _remove_finished_outputs(workdir)

    augment_fn = None
    if augmult > 0 or augmentation is not None:
        augment_fn = augment.get_augmentation(
            augmentation or "none", **(augmentation_kwargs or {})
        )
    train_ds = _train_dataset(
        train, plan, seed=seed, start_step=start_step, augment_fn=augment_fn, augmult=augmult,
        static_batch_size=static_size, multiple=num_replicas,
    )
    train_ds = distribute.distribute_logical_batches(
        dist, train_ds, per_replica_size=static_size // num_replicas if static_size else None
    )
    eval_ds = data.eval_batches(test, batch_size=eval_batch_size, num_examples=eval_examples)
    if progress_bar is None:
        progress_bar = sys.stdout.isatty()
    augtest_spec = None
    if augtest:
        if augment_fn is None or augmult < 1:
            raise ValueError("augtest needs an augmentation and augmult >= 1 (the K views).")
        augtest_spec = (augment_fn, augmult, [seed, 2])
    callbacks = [
        callbacks_lib.EvaluationEpochsOnly(
            evaluation.ExtraEvaluation(dp_model, eval_ds, augtest=augtest_spec)),
        callbacks_lib.PrivacyCallback(plan),
        callbacks_lib.ProgressLog(plan.num_steps),
        callbacks_lib.CheckpointCallback(manager, ledger=ledger, plan=plan),
        callbacks_lib.MetricsJsonl(
            os.path.join(out_dir, METRICS_FILE),
            extra={"simulation": True} if simulation else None,
        ),
        callbacks_lib.OperativeConfigSaver(os.path.join(out_dir, OPERATIVE_CONFIG)),
        callbacks_lib.tensorboard_callback(out_dir),
    ]
    if start_step < plan.num_steps:
        # fit epochs are checkpoint intervals; only some of them evaluate.
        epochs, initial_epoch, validation_freq = _fit_schedule(
            plan.num_steps, start_step, checkpoint_every_steps, eval_every_steps)
        dp_model.fit(
            train_ds,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=checkpoint_every_steps,
            validation_data=eval_ds,
            validation_freq=validation_freq,
            callbacks=callbacks,
            verbose=1 if progress_bar else 0,
        )
    steps_done = int(dp_model.optimizer.iterations.numpy())
    if steps_done != plan.num_steps:
        raise RuntimeError(
            f"Training stopped at step {steps_done}, not the planned {plan.num_steps}; "
            "no privacy report or export was written."
        )
    study = None
    if study_dir and chief:  # one ledger entry per run, not per worker
        study = _record_in_study(study_dir, workdir, plan, steps_done)
    if simulation:
        logging.warning(
            "This run SIMULATES %s; it is not private at the reference epsilon.",
            simulation.get("reference", simulation),
        )
    report = privacy_report.build_privacy_report(
        plan,
        steps_completed=steps_done,
        epsilon=plan.epsilon(steps_done),
        epsilon_without_amplification=_epsilon_without_amplification(plan),
        hyperparameters=_hyperparameters(
            dataset=dataset, augmentation=augmentation, augmult=augmult,
            accumulation_steps=accumulation_steps, normalize_update=normalize_update,
            ema_decay=ema_decay, augtest=augtest,
            optimizer=keras.optimizers.serialize(dp_model.optimizer)["config"],
        ),
        num_microbatches=num_microbatches,
        exported_parameters="ema" if ema_decay is not None else "last",
        extra_mechanisms=[
            {"mechanism": "private data normalization (Tramer & Boneh 2021, App. B)",
             "dp_event": "two Gaussian mechanisms", **data_normalization}
        ] if data_normalization else (),
        simulation=simulation,
        study=study,
        truncation=truncation and {
            **truncation,
            "delta_with_truncation": data.delta_with_truncation(
                plan.delta, plan.epsilon(steps_done), truncation["truncation_probability"]),
        },
    )
    # The chief writes the report and the SavedModel once; other workers export
    # too (the save may run collectives) into their temp dir, then delete it.
    json_path, md_path = privacy_report.write_privacy_report(report, out_dir)
    export_model = model
    if features == "scatternet":
        export_model = models.build_scatternet_classifier(model, image_shape)
    with dp_model.use_ema_parameters():
        saved_model.export_saved_model(
            export_model, os.path.join(out_dir, EXPORT_DIR), image_shape=image_shape,
            asset_paths=(json_path, md_path),
        )
    if out_dir != workdir:
        shutil.rmtree(out_dir, ignore_errors=True)
    logging.info(
        "Done: epsilon=%.4f at delta=%g after %d steps; SavedModel in %s.",
        report["epsilon"], report["delta"], steps_done, os.path.join(workdir, EXPORT_DIR),
    )
    return report


def _features(train, test, features, data_normalization, workdir):
    """Replaces pixels by cached ScatterNet features, privately normalized if asked.

    The features of every image are computed once and held in memory
    (`tfdp.data.ArraySource`): fine for the small datasets the ScatterNet
    configs use (Fashion-MNIST, CIFAR-10: about 1 GB of float32 features),
    not meant for ImageNet. Without features, the splits stay on disk.

    The private mean and variance are released once per run: they are saved to
    `workdir/data_normalization.json` and reused on resume, so a restarted run
    never draws (and spends privacy on) a second noisy release.

    Returns:
      `(train, test, head_kwargs)`: the sources (`ArraySource`s of float32
      `[N, h, w, K]` features, or the `TFDSSource`s unchanged), and the keyword
      arguments that pass the private feature mean and variance to the head
      builder.

    Raises:
      ValueError: on an unknown `features`, or data normalization without them.
    """
    if features is None:
        if data_normalization:
            raise ValueError("data_normalization needs features='scatternet'.")
        return train, test, {}
    if features != "scatternet":
        raise ValueError(f"Unknown features {features!r}; use None or 'scatternet'.")
    logging.info("Computing ScatterNet features of %d + %d images once.",
                 train.num_examples, test.num_examples)
    train, test = (data.read_split(source) for source in (train, test))
    train = train._replace(images=models.compute_scatternet_features(train.images))
    test = test._replace(images=models.compute_scatternet_features(test.images))
    sources = data.ArraySource(*train), data.ArraySource(*test)
    if not data_normalization:
        return (*sources, {})
    path = os.path.join(workdir, DATA_NORMALIZATION_FILE)
    if os.path.exists(path):
        with open(path) as f:
            released = json.load(f)
    else:
        from tfdp.dp import data_normalization as data_norm  # pylint: disable=g-import-not-at-top

        mean, variance = data_norm.private_channel_mean_and_var(
            train.images,
            l2_clip_norm_mean=data_normalization["l2_clip_norm_mean"],
            l2_clip_norm_square=data_normalization["l2_clip_norm_square"],
            noise_multiplier=data_normalization["noise_multiplier"],
            threshold=data_normalization["threshold"],
        )
        released = {"feature_mean": mean.numpy().tolist(),
                    "feature_variance": variance.numpy().tolist()}
        with open(path, "w") as f:
            json.dump(released, f)
    return (*sources, {k: np.asarray(v, np.float32) for k, v in released.items()})


def _record_in_study(study_dir, workdir, plan, steps_done):
    """Appends this run to the study ledger; returns the study's epsilon."""
    from tfdp import accounting  # pylint: disable=g-import-not-at-top

    extra = []
    if plan.data_normalization_noise is not None:
        extra = [{"kind": "gaussian", "noise_multiplier": plan.data_normalization_noise,
                  "count": 2}]
    accounting.append_run(
        study_dir, run_name=os.path.basename(os.path.normpath(workdir)),
        noise_multiplier=plan.noise_multiplier, sampling_prob=plan.sampling_prob,
        num_steps=steps_done, extra_events=extra,
    )
    epsilon, runs = accounting.study_epsilon(study_dir, delta=plan.delta,
                                             accountant=plan.accountant)
    return {"dir": str(study_dir), "epsilon": epsilon, "delta": plan.delta,
            "runs": {name: eps for name, eps in runs}}


def _remove_finished_outputs(workdir):
    """A run that is (re)starting does not keep outputs that mark a finished run."""
    for name in (privacy_report.REPORT_JSON, privacy_report.REPORT_MD):
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            os.remove(path)
    shutil.rmtree(os.path.join(workdir, EXPORT_DIR), ignore_errors=True)


def _train_dataset(train, plan, *, seed, start_step, augment_fn, augmult,
                   static_batch_size=None, multiple=1):
    """Poisson (or shuffled) logical batches -> augmult views -> padded, one per update.

    `train` is the split's source (`tfdp.data.TFDSSource`, read from disk, or
    `ArraySource` for cached features); batches are read and decoded in
    parallel, ahead of the training step.

    Batches are padded with a mask (`tfdp.data.pad_batches`) to the static
    size, or else to a multiple of the replica count when there are several
    replicas; one replica and no static size keep the plain variable batches.
    """
    ds = data.train_batches(
        train, sampling=plan.sampling, batch_size=plan.batch_size,
        num_steps=plan.num_steps, seed=seed, start_step=start_step,
    )
    if augment_fn is not None:
        ds = augment.augment_dataset(
            ds, augment_fn=augment_fn, augmult=augmult, seed=[seed, 1], start_step=start_step
        )
    if static_batch_size is not None or multiple > 1:
        ds = data.pad_batches(ds, static_batch_size=static_batch_size, multiple=multiple)
    return ds.prefetch(tf.data.AUTOTUNE)


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


def _static_batch_size(static_batch_size, plan, strategy, accumulation_steps):
    """Resolves `static_batch_size` and its truncation bound (`tfdp.data.padding`).

    Returns:
      `(size, truncation)`: size None (variable batches) or the static logical
      batch S; truncation None, or a dict with the cap and eta for the report
      (`delta_with_truncation` is added once the final epsilon is known).

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
        return None, None
    num_replicas = strategy.num_replicas_in_sync
    unit = num_replicas * int(accumulation_steps)
    # The accountant's final epsilon bounds every intermediate one.
    epsilon = plan.epsilon(plan.num_steps)
    max_eta = plan.delta / 10.0 / (1.0 + math.exp(min(epsilon, 700.0)))
    if static_batch_size == "auto":
        if plan.sampling == "poisson":
            size = data.choose_static_batch_size(
                plan.num_examples, plan.sampling_prob, plan.num_steps, max_eta, multiple=unit)
        else:
            size = -(-plan.batch_size // unit) * unit
    elif isinstance(static_batch_size, int) and not isinstance(static_batch_size, bool):
        size = static_batch_size
    else:
        raise ValueError(
            f"static_batch_size must be None, a positive int or 'auto', got {static_batch_size!r}."
        )
    per_replica = distribute.per_replica_batch_size(size, num_replicas, accumulation_steps)
    if plan.sampling != "poisson":
        if size < plan.batch_size:
            raise ValueError(
                f"static_batch_size={size} is below the fixed batch size {plan.batch_size} of "
                "shuffled batches; use 'auto' or at least the batch size."
            )
        eta = 0.0
    else:
        eta = data.truncation_probability(
            plan.num_examples, plan.sampling_prob, size, plan.num_steps)
        added = data.delta_with_truncation(0.0, epsilon, eta)
        if added > plan.delta:
            suggested = data.choose_static_batch_size(
                plan.num_examples, plan.sampling_prob, plan.num_steps, max_eta, multiple=unit)
            raise ValueError(
                f"static_batch_size={size} truncates Poisson batches (expected size "
                f"{plan.batch_size}) too often: with probability <= {eta:.3g} over "
                f"{plan.num_steps} steps, which would add (1 + e^epsilon) * {eta:.3g} = "
                f"{added:.3g} to delta={plan.delta:g}. Use static_batch_size='auto' "
                f"({suggested} here) or at least that."
            )
        if added > plan.delta / 10:
            logging.warning("static_batch_size=%d adds %.3g to delta=%g (truncation).",
                            size, added, plan.delta)
    logging.info("Static logical batch %d (%d per replica x %d replicas); truncation "
                 "probability <= %.3g.", size, per_replica, num_replicas, eta)
    return size, {
        "static_batch_size": size,
        "per_replica_batch_size": per_replica,
        "num_replicas": num_replicas,
        "truncation_probability": eta,
    }


def _epsilon_without_amplification(plan):
    """For shuffled batches: each example is used once per epoch, no amplification."""
    if plan.sampling == "poisson":
        return None
    from tfdp import accounting  # pylint: disable=g-import-not-at-top

    epochs = math.ceil(plan.num_steps * plan.batch_size / plan.num_examples)
    return accounting.compute_epsilon(
        noise_multiplier=plan.noise_multiplier, sampling_prob=1.0, num_steps=epochs,
        delta=plan.delta, accountant=plan.accountant,
    )


def _hyperparameters(**kwargs):
    return json.loads(json.dumps(kwargs, default=str))
