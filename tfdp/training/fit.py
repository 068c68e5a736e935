"""Stage 7, fit: Keras `fit` over checkpoint intervals, with the run's callbacks.

`fit`'s epochs are checkpoint intervals, so that checkpoints, evaluations and
the last step all fall on epoch ends, and a resumed run keeps the same
epoch (and evaluation) boundaries as an uninterrupted one.
"""

import functools
import math
import os

from tfdp import workdir as workdir_lib
from tfdp.training import callbacks as callbacks_lib
from tfdp.training import evaluation

METRICS_FILE = "metrics.jsonl"
OPERATIVE_CONFIG = "operative_config.gin"


def fit(dp_model, plan, *, step_callback, metrics_fields, manager, checkpoint_record, train_ds,
        eval_ds,
        out_dir, start_step, checkpoint_every_steps, eval_every_steps, augtest, progress_bar,
        test_examples):
    """Trains `dp_model` from `start_step` to `plan.num_steps`, evaluating every eval_every_steps.

    Args:
      dp_model: the compiled `DPModel` or `NonPrivateModel`.
      plan: the run's `DPMechanism` or `NonPrivatePlan` (`num_steps`: updates).
      step_callback: the mode's callback that puts the step (and epsilon) into
        each epoch's logs (`tfdp.modes`); it goes before the loggers.
      metrics_fields: what every metrics.jsonl line also says (the mode's).
      manager, checkpoint_record: the checkpoint manager and the privacy record it saves
        (`tfdp.training.record_variables`).
      train_ds, eval_ds: the distributed training chunks and the test batches.
      out_dir: where metrics.jsonl, operative_config.gin and tensorboard/ go.
      start_step: the restored optimizer step.
      checkpoint_every_steps, eval_every_steps: intervals in optimizer updates.
      augtest: None, or `(augment_fn, augmult, seed)` of AugTest.
      progress_bar: a bar (True) or log lines (False).
      test_examples: the test examples each evaluation uses (every
        metrics.jsonl line states it).
    """
    if start_step >= plan.num_steps:
        return
    callbacks = [
        callbacks_lib.WorkdirHeld(out_dir),
        callbacks_lib.EvaluationEpochsOnly(
            evaluation.ExtraEvaluation(dp_model, eval_ds, augtest=augtest,
                                       check=functools.partial(workdir_lib.check_held,
                                                               out_dir))),
        step_callback,
        callbacks_lib.ProgressLog(plan, bar=progress_bar),
        callbacks_lib.CheckpointCallback(manager, checkpoint_record),
        callbacks_lib.MetricsJsonl(os.path.join(out_dir, METRICS_FILE),
                                   extra={"test_examples": test_examples, **metrics_fields}),
        callbacks_lib.OperativeConfigSaver(os.path.join(out_dir, OPERATIVE_CONFIG)),
        callbacks_lib.TensorBoardScalars(os.path.join(out_dir, "tensorboard")),
    ]
    # fit epochs are checkpoint intervals; only some of them evaluate.
    epochs, initial_epoch, validation_freq = fit_schedule(
        plan.num_steps, start_step, checkpoint_every_steps, eval_every_steps)
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


def fit_schedule(num_steps, start_step, checkpoint_every_steps, eval_every_steps):
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
