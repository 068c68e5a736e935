"""Keras callbacks of a DP run: epsilon in the logs, metrics.jsonl, checkpoints."""

import json
import os
import time

import gin
import keras
import tensorflow as tf
from absl import logging

from tfdp import accounting
from tfdp import storage
from tfdp import workdir as workdir_lib
from tfdp.training import record_variables


class WorkdirHeld(keras.callbacks.Callback):
    """Stops training when the run no longer holds its workdir.

    A local workdir path that no longer names the folder the run locked, or
    a URL workdir whose lease the run has lost (`tfdp.lease`), raises
    `tfdp.workdir.check_held`'s error. First among the run's callbacks, so
    that no later one (metrics, a checkpoint, TensorBoard) writes into a
    folder another run may hold. Checked at every training step's end, every
    evaluation batch's end and every epoch's end.

    Args:
      workdir: the run's output folder (a local path or a URL).
    """

    def __init__(self, workdir):
        super().__init__()
        self.workdir = workdir

    def on_train_begin(self, logs=None):
        workdir_lib.check_held(self.workdir)

    def on_train_batch_end(self, batch, logs=None):
        workdir_lib.check_held(self.workdir)

    def on_test_batch_end(self, batch, logs=None):
        workdir_lib.check_held(self.workdir)

    def on_epoch_end(self, epoch, logs=None):
        workdir_lib.check_held(self.workdir)


class StepCallback(keras.callbacks.Callback):
    """Puts the optimizer step into each epoch's logs; stops at the planned step.

    The step is the optimizer's update count (`optimizer.iterations`), i.e.
    logical batches, not micro-steps. A non-private run (`privacy=None`) uses
    it alone; a private run uses `PrivacyCallback`, which adds epsilon.

    Args:
      num_steps: the planned optimizer updates.
    """

    def __init__(self, num_steps: int):
        super().__init__()
        self.num_steps = int(num_steps)

    def _step(self):
        return int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        if self._step() >= self.num_steps:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["step"] = self._step()


class PrivacyCallback(StepCallback):
    """Puts the exact epsilon spent into each epoch's logs; stops at the planned step.

    Place it BEFORE the loggers so they record `step`, `epsilon` and `delta`.
    The step is the optimizer's update count (`optimizer.iterations`), i.e.
    logical batches, not micro-steps; `delta` is the delta of the whole
    guarantee (`DPMechanism.guarantee`, truncation included).

    Args:
      mechanism: the run's `tfdp.accounting.DPMechanism`.
    """

    def __init__(self, mechanism: accounting.DPMechanism):
        super().__init__(mechanism.num_steps)
        self.mechanism = mechanism

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if logs is not None:
            logs["epsilon"], logs["delta"] = self.mechanism.guarantee(logs["step"])


class MetricsJsonl(keras.callbacks.Callback):
    """Appends one JSON object per evaluation to `path`.

    Each line has `step`, `epsilon`, `delta`, `test_accuracy`, `test_loss`, the
    training metrics of the interval, `wall_time_s` since training began, and
    the items of `extra` (e.g. `{"simulation": true}`). A non-private run's
    lines have no `epsilon` and `delta` (its logs hold none) and its `extra`
    is `{"privacy": "NOT PRIVATE"}`. Epochs that ran no
    validation (checkpoint-only intervals, see `train_and_evaluate`'s
    `checkpoint_every_steps`) write nothing.
    """

    def __init__(self, path, extra=None):
        super().__init__()
        self.path = path
        self.extra = dict(extra or {})
        self._start = None

    def on_train_begin(self, logs=None):
        self._start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        if not ran_validation(logs):
            return
        logs = dict(logs or {})
        record = {"step": int(logs.pop("step"))}
        for key in ("epsilon", "delta"):
            if key in logs:
                record[key] = float(logs.pop(key))
        for key, value in sorted(logs.items()):
            name = "test_" + key[len("val_"):] if key.startswith("val_") else "train_" + key
            record[name] = float(value)
        record["wall_time_s"] = round(time.time() - self._start, 2)
        record.update(self.extra)
        workdir_lib.check_held(storage.parent(self.path))
        storage.append_text(self.path, json.dumps(record) + "\n")


class ProgressLog(keras.callbacks.Callback):
    """Progress over the whole run: step of total, loss, accuracy and the exact epsilon.

    `fit`'s epochs are checkpoint intervals, so Keras' own bar ("Epoch 3/12")
    says little; this shows optimizer steps out of `num_steps` instead, with
    the epsilon spent so far computed exactly at that step (not a bound).
    With `bar=True` (a terminal) it is a `keras.utils.Progbar` refreshed at
    most once a second; otherwise one log line at least every
    `every_seconds`, at the first step, at every evaluation and at the end.
    A non-private run (any `mechanism` that is not a `DPMechanism`, e.g. the
    trainer's `NonPrivatePlan`) shows "NOT PRIVATE" where epsilon would be.

    Args:
      mechanism: the run's `DPMechanism` (num_steps, epsilon), or an object
        with `num_steps` for a non-private run.
      bar: draw a progress bar instead of log lines.
      every_seconds: the longest gap between two log lines.
    """

    def __init__(self, mechanism, *, bar=False, every_seconds=10.0):
        super().__init__()
        self.mechanism = mechanism
        self.private = isinstance(mechanism, accounting.DPMechanism)
        self.bar = bar
        self.every_seconds = every_seconds
        self._progbar = None
        self._last = 0.0
        self._start = None
        self._first_step = 0

    def on_train_begin(self, logs=None):
        self._start = time.time()
        self._first_step = int(self.model.optimizer.iterations.numpy())
        if self.bar:
            self._progbar = keras.utils.Progbar(
                self.mechanism.num_steps, unit_name="step",
                stateful_metrics=["loss", "accuracy", "epsilon"] if self.private
                else ["loss", "accuracy"])

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        now = time.time()
        last = step >= self.mechanism.num_steps
        due = now - self._last >= (1.0 if self.bar else self.every_seconds)
        if not (last or due or step == self._first_step + 1):
            return
        self._last = now
        logs = logs or {}
        if self._progbar is not None:
            values = [("loss", logs.get("loss", float("nan"))),
                      ("accuracy", logs.get("accuracy", float("nan")))]
            if self.private:
                values.append(("epsilon", self.mechanism.epsilon(step)))
            self._progbar.update(step, values=values, finalize=last)
            return
        rate = (step - self._first_step) / max(now - self._start, 1e-9)
        remaining = (self.mechanism.num_steps - step) / max(rate, 1e-9)
        if not self.private:
            logging.info(
                "step %d/%d  loss %.4f  accuracy %.4f  NOT PRIVATE  %.2f steps/s  %s left",
                step, self.mechanism.num_steps, logs.get("loss", float("nan")),
                logs.get("accuracy", float("nan")), rate, _duration(remaining))
            return
        epsilon = self.mechanism.epsilon(step)
        logging.info(
            "step %d/%d  loss %.4f  accuracy %.4f  grad_norm %.3f  clipped %.2f  "
            "epsilon %.3f (delta %.3g)  %.2f steps/s  %s left",
            step, self.mechanism.num_steps, logs.get("loss", float("nan")),
            logs.get("accuracy", float("nan")), logs.get("grad_norm", float("nan")),
            logs.get("clipped_fraction", float("nan")), epsilon, self.mechanism.delta,
            rate, _duration(remaining),
        )

    def on_epoch_end(self, epoch, logs=None):
        if not ran_validation(logs):
            return
        logs = logs or {}
        message = (f"eval at step {logs.get('step', -1)}/{self.mechanism.num_steps}: "
                   f"test_accuracy {logs.get('val_accuracy', float('nan')):.4f}  "
                   f"test_loss {logs.get('val_loss', float('nan')):.4f}  "
                   + (f"epsilon {logs.get('epsilon', float('nan')):.3f}" if self.private
                      else "NOT PRIVATE"))
        if self._progbar is not None:
            print(f"\n{message}")
        else:
            logging.info("%s", message)


def _duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else (
        f"{seconds // 60}m{seconds % 60:02d}s")


class OperativeConfigSaver(keras.callbacks.Callback):
    """Writes `gin.operative_config_str()` after the first training step.

    Bindings that gin passes but the run does not read (a config file's
    `momentum` after a --gin_param chose Adam: `tfdp.gin_bindings.NOT_READ`)
    are listed first, under a comment that says so.
    """

    def __init__(self, path):
        super().__init__()
        self.path = path
        self._done = False

    def on_train_batch_end(self, batch, logs=None):
        if not self._done:
            from tfdp import gin_bindings  # pylint: disable=g-import-not-at-top

            header = "".join(f"# NOT READ by this run: {text}\n"
                             for text in gin_bindings.NOT_READ)
            workdir_lib.check_held(storage.parent(self.path))
            storage.write_whole(self.path, header + ("\n" if header else "")
                                + gin.operative_config_str())
            self._done = True


class CheckpointCallback(keras.callbacks.Callback):
    """Saves a `tf.train.CheckpointManager` checkpoint at the end of each epoch.

    An epoch is one checkpoint interval (`train_and_evaluate` makes every
    evaluation and the last step an epoch end too); the checkpoint number is
    the optimizer step, so a restarted run resumes from the last saved step.
    Before saving, the checkpoint's privacy record
    (`tfdp.training.record_variables.make_privacy_record`) is set to the step
    and its epsilon, so the checkpoint states what it has spent.

    Under `multi_worker_mirrored` every worker must call this (saving may run
    collectives); non-chief workers give a manager writing to a temporary
    directory.

    Args:
      manager: the `tf.train.CheckpointManager` of the run.
      record: the privacy record module held by the checkpoint
        (`record_variables.make_privacy_record` or `make_non_private_record`).
    """

    def __init__(self, manager: tf.train.CheckpointManager, record):
        super().__init__()
        self.manager = manager
        self.record = record

    def on_epoch_end(self, epoch, logs=None):
        workdir_lib.check_held(storage.parent(self.manager.directory))
        record_variables.save_checkpoint(self.manager, self.record,
                                         int(self.model.optimizer.iterations.numpy()))


def ran_validation(logs):
    """True when an epoch's logs hold validation results (keys `val_...`)."""
    return bool(logs) and any(key.startswith("val_") for key in logs)


class EvaluationEpochsOnly(keras.callbacks.Callback):
    """Runs another callback's `on_epoch_end` only on epochs that evaluated.

    For callbacks that only act in `on_epoch_end` (e.g.
    `tfdp.training.evaluation.ExtraEvaluation`) when the fit epochs are
    checkpoint intervals and only some of them evaluate.

    Args:
      callback: the wrapped `keras.callbacks.Callback`.
    """

    def __init__(self, callback):
        super().__init__()
        self.callback = callback

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def on_epoch_end(self, epoch, logs=None):
        if ran_validation(logs):
            self.callback.on_epoch_end(epoch, logs)


class TensorBoardScalars(keras.callbacks.Callback):
    """TensorBoard scalars at every evaluation, against the optimizer step.

    Keras' TensorBoard callback writes epoch summaries against the epoch
    index, which here is a checkpoint interval. This writes `train/` (loss,
    accuracy, grad_norm, clipped_fraction, epsilon, delta) and `validation/`
    (loss, accuracy, ema_accuracy, augtest_accuracy) scalars with
    `tf.summary.scalar(..., step=optimizer.iterations)`.

    Args:
      log_dir: the run's `tensorboard/` directory.
    """

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir
        self._writers = {}

    def _writer(self, name):
        workdir_lib.check_held(storage.parent(self.log_dir))
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(
                os.path.join(self.log_dir, name))
        return self._writers[name]

    def on_epoch_end(self, epoch, logs=None):
        if not ran_validation(logs):
            return
        step = int(self.model.optimizer.iterations.numpy())
        for key, value in logs.items():
            if key == "step":
                continue
            split = "validation" if key.startswith("val_") else "train"
            with self._writer(split).as_default():
                tf.summary.scalar(key.removeprefix("val_"), float(value), step=step)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs=None):
        for writer in self._writers.values():
            writer.close()
