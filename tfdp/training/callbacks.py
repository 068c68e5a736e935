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
    Before saving, the privacy ledger (see `make_privacy_ledger`) is set to the
    step and its epsilon, so the checkpoint states what it has spent.

    Under `multi_worker_mirrored` every worker must call this (saving may run
    collectives); non-chief workers give a manager writing to a temporary
    directory.

    Args:
      manager: the `tf.train.CheckpointManager` of the run.
      ledger: the `make_privacy_ledger` module held by the checkpoint.
    """

    def __init__(self, manager: tf.train.CheckpointManager, ledger):
        super().__init__()
        self.manager = manager
        self.ledger = ledger

    def on_epoch_end(self, epoch, logs=None):
        workdir_lib.check_held(storage.parent(self.manager.directory))
        save_checkpoint(self.manager, self.ledger, int(self.model.optimizer.iterations.numpy()))


def save_checkpoint(manager, ledger, step):
    """Sets the ledger to `step` and its epsilon, then saves checkpoint number `step`.

    A non-private run's ledger (`make_non_private_ledger`) has no epsilon.
    """
    ledger.steps.assign(step)
    if ledger.mechanism is not None:
        ledger.epsilon.assign(ledger.mechanism.epsilon(step))
    manager.save(checkpoint_number=step)


def make_privacy_ledger(mechanism: accounting.DPMechanism, *, sampling_seed: int,
                        noise_seed=None, config: str = "", data: str = "") -> tf.Module:
    """Variables that put the run's privacy ledger and secret seeds into every checkpoint.

    The module holds:
    * `mechanism_json` (string): `mechanism.to_dict()` as JSON, the whole
      mechanism the checkpoint's steps were taken under;
    * `steps` (int64) and `epsilon` (float64), set before each save (read
      them with `tf.train.load_checkpoint(path).get_tensor(
      "ledger/epsilon/.ATTRIBUTES/VARIABLE_VALUE")`);
    * `sampling_seed` (int64) and `noise_seed` (int64, -1 when drawn from
      OS entropy): the secret seeds. The checkpoint is the ONLY place they
      are written (`tfdp.dp.seeds`); the noise generator's state is saved
      with the DPModel;
    * `config` (string): the run's gin bindings (`gin.config_str()`), so a
      rerun can say which settings changed;
    * `data` (string): JSON of the fingerprints of the splits the run reads
      (`tfdp.data.fingerprint`), so a resume trains on the same data
      (`saved_data_fingerprint`).

    `check_privacy_ledger` compares a restored ledger with the new run.
    Create it outside any strategy scope (plain host variables). The
    mechanism itself stays a Python attribute (`ledger.mechanism`).

    Args:
      mechanism: the run's `DPMechanism`.
      sampling_seed: the run's sampling seed (secret, or fixed by the user).
      noise_seed: the user's fixed noise seed, or None.
      config: the run's gin bindings.
      data: the run's data fingerprints, as JSON.

    Returns:
      A `tf.Module` to add to the `tf.train.Checkpoint`.
    """
    ledger = tf.Module(name="privacy_ledger")
    ledger.mechanism = mechanism
    with tf.device("/CPU:0"):
        ledger.mechanism_json = tf.Variable(
            json.dumps(mechanism.to_dict(), sort_keys=True), trainable=False,
            name="mechanism_json")
        ledger.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="steps")
        ledger.epsilon = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="epsilon")
        ledger.sampling_seed = tf.Variable(int(sampling_seed), dtype=tf.int64, trainable=False,
                                           name="sampling_seed")
        ledger.noise_seed = tf.Variable(-1 if noise_seed is None else int(noise_seed),
                                        dtype=tf.int64, trainable=False, name="noise_seed")
        ledger.config = tf.Variable(config, trainable=False, name="config")
        ledger.data = tf.Variable(data, trainable=False, name="data")
    return ledger


_LEDGER_KEY = "ledger/{}/.ATTRIBUTES/VARIABLE_VALUE"
NOT_PRIVATE = "NOT PRIVATE"


def make_non_private_ledger(num_steps: int, *, sampling_seed: int,
                            config: str = "", data: str = "") -> tf.Module:
    """The checkpoint's ledger of a NON-PRIVATE run (`privacy=None`): no mechanism, no epsilon.

    It takes the privacy ledger's place in the checkpoint (under the same
    name, `ledger`), with `privacy` = "NOT PRIVATE" as its mark, so that a
    private run never resumes a non-private checkpoint, nor the other way
    round (`check_privacy_ledger`, `check_non_private_ledger`). It holds
    `privacy` (string), `steps` (int64, set before each save), the run's
    `sampling_seed` (int64: the batches of step t are a function of (seed,
    t), so a resumed run continues the same stream; not a secret here),
    `config` (the gin bindings) and `data` (the data fingerprints, as in
    `make_privacy_ledger`). `ledger.mechanism` is None.

    Args:
      num_steps: the planned optimizer updates (kept as `ledger.num_steps`).
      sampling_seed: the seed of the batches.
      config: the run's gin bindings.
      data: the run's data fingerprints, as JSON.

    Returns:
      A `tf.Module` to add to the `tf.train.Checkpoint` as `ledger`.
    """
    ledger = tf.Module(name="non_private_ledger")
    ledger.mechanism = None
    ledger.num_steps = int(num_steps)
    with tf.device("/CPU:0"):
        ledger.privacy = tf.Variable(NOT_PRIVATE, trainable=False, name="privacy")
        ledger.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="steps")
        ledger.sampling_seed = tf.Variable(int(sampling_seed), dtype=tf.int64, trainable=False,
                                           name="sampling_seed")
        ledger.config = tf.Variable(config, trainable=False, name="config")
        ledger.data = tf.Variable(data, trainable=False, name="data")
    return ledger


def saved_data_fingerprint(checkpoint_path: str):
    """The data fingerprints a checkpoint's ledger recorded (a dict), or None if it has none.

    None for a checkpoint that records no data fingerprints,
    or one whose record is not readable JSON.
    """
    reader = storage.checkpoint_reader(checkpoint_path)
    key = _LEDGER_KEY.format("data")
    if not reader.has_tensor(key):
        return None
    try:
        saved = json.loads(reader.get_tensor(key).decode())
    except ValueError:
        return None
    return saved if isinstance(saved, dict) and saved else None


def _is_non_private(reader):
    key = _LEDGER_KEY.format("privacy")
    return reader.has_tensor(key) and reader.get_tensor(key).decode() == NOT_PRIVATE


def check_non_private_ledger(checkpoint_path: str, num_steps: int):  # -> (steps, config)
    """Refuses to resume a PRIVATE run's checkpoint without privacy, or too many steps.

    Args:
      checkpoint_path: the workdir's latest checkpoint.
      num_steps: the non-private run's planned updates.

    Returns:
      `(steps, config)`: the steps the checkpoint holds and its gin bindings.

    Raises:
      ValueError: the checkpoint is a private run's (or an unknown one's), or
        it holds more steps than planned.
    """
    reader = storage.checkpoint_reader(checkpoint_path)
    if not _is_non_private(reader):
        private = reader.has_tensor(_LEDGER_KEY.format("mechanism_json"))
        raise ValueError(
            f"The checkpoint {checkpoint_path} is of a "
            f"{'PRIVATE (DP-SGD) run' if private else 'run that recorded no privacy mode'}; "
            "this run has privacy=None (NOT PRIVATE). Resuming it without privacy would "
            "continue private iterates with non-private steps, and neither the privacy "
            "report nor the NOT PRIVATE statement would describe the model. Nothing was "
            "changed. Use a new workdir for the non-private run, or drop privacy=None to "
            "resume the private one.")
    steps = int(reader.get_tensor(_LEDGER_KEY.format("steps")))
    if steps > num_steps:
        raise ValueError(
            f"This workdir already holds {steps} steps, more than the {num_steps} planned "
            f"now (NUM_STEPS). Nothing was changed. Plan at least {steps} steps to resume it, "
            "or use a new workdir.")
    return steps, reader.get_tensor(_LEDGER_KEY.format("config")).decode()


def check_privacy_ledger(checkpoint_path: str, mechanism: accounting.DPMechanism, *,
                         sampling_seed=None, noise_seed=None):  # -> (steps, config)
    """Refuses to resume a checkpoint that was written under another mechanism.

    Reads the checkpoint's ledger (`make_privacy_ledger`) from the file, so it
    runs before anything is built, written or released. Resuming under a
    different mechanism (another sigma, q, C, delta, sensitivity, sampling
    scheme, truncation cap, data normalization or accountant) would compose
    two mechanisms under one epsilon, or silently change the run's epsilon
    series; fixing a seed that differs from the checkpoint's would be
    silently ignored; a plan with fewer steps than the checkpoint holds
    cannot be met.

    Args:
      checkpoint_path: the workdir's latest checkpoint.
      mechanism: the new run's `DPMechanism`.
      sampling_seed, noise_seed: the seeds the user fixed now, or None.

    Returns:
      `(steps, config)`: the steps the checkpoint holds and the gin bindings
      it was written under.

    Raises:
      ValueError: on any mismatch; the message names every differing field
        (never a secret seed's value) and says what to do.
    """
    reader = storage.checkpoint_reader(checkpoint_path)
    if _is_non_private(reader):
        raise ValueError(
            f"The checkpoint {checkpoint_path} is of a NON-PRIVATE run (privacy=None): its "
            "steps had no clipping and no noise. Resuming it with DP-SGD would train a model "
            "whose earlier steps no privacy report covers. Nothing was changed. Use a new "
            "workdir for the private run (to fine-tune privately from it, load it as a "
            "pretrained backbone), or set tfdp.train_and_evaluate.privacy = None to resume "
            "the non-private one.")
    if not reader.has_tensor(_LEDGER_KEY.format("mechanism_json")):
        raise ValueError(
            f"The checkpoint {checkpoint_path} was written by an older tfdp that did not "
            "record the whole privacy mechanism, so resuming it cannot be checked. Use a new "
            "workdir.")
    saved = accounting.DPMechanism.from_dict(
        json.loads(reader.get_tensor(_LEDGER_KEY.format("mechanism_json"))))
    problems = [f"  {line} (checkpoint vs this run)" for line in saved.differences(mechanism)]
    for name, fixed in (("sampling_seed", sampling_seed), ("noise_seed", noise_seed)):
        if fixed is not None and int(reader.get_tensor(_LEDGER_KEY.format(name))) != int(fixed):
            problems.append(f"  {name}: this run fixes another value than the checkpoint's")
    if problems:
        raise ValueError(
            "The checkpoint in the workdir was written under another privacy mechanism:\n"
            + "\n".join(problems)
            + "\nResuming would mix two mechanisms under one epsilon. Restore the original "
            "settings, or use a new workdir."
        )
    steps = int(reader.get_tensor(_LEDGER_KEY.format("steps")))
    if steps > mechanism.num_steps:
        raise ValueError(
            f"This workdir already holds {steps} steps, more than the {mechanism.num_steps} "
            "planned now (NUM_STEPS, or the TARGET_EPSILON cap). Nothing was changed. Plan at "
            f"least {steps} steps to resume it, or use a new workdir.")
    config = reader.get_tensor(_LEDGER_KEY.format("config")).decode()
    return steps, config


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
