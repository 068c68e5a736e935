"""Keras callbacks of a DP run: epsilon in the logs, metrics.jsonl, checkpoints."""

import json
import os
import time

import gin
import keras
import tensorflow as tf
from absl import logging

from tfdp import accounting


class PrivacyCallback(keras.callbacks.Callback):
    """Puts epsilon spent into the logs and stops at the planned step count.

    Place it BEFORE the progress bar and TensorBoard so they show `epsilon`.
    The step is the optimizer's update count (`optimizer.iterations`), i.e.
    logical batches, not micro-steps. On batches the logged value is
    `accounting.epsilon_upper_bound` (epsilon at the next multiple of 10
    steps); at the end of each epoch it is exact, with the delta of the
    whole guarantee (`DPMechanism.guarantee`, truncation included).

    Args:
      mechanism: the run's `tfdp.accounting.DPMechanism`.
    """

    def __init__(self, mechanism: accounting.DPMechanism):
        super().__init__()
        self.mechanism = mechanism

    def _step(self):
        return int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        if logs is not None:
            logs["epsilon"] = accounting.epsilon_upper_bound(self.mechanism, step)
        if step >= self.mechanism.num_steps:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            step = self._step()
            logs["step"] = step
            logs["epsilon"], logs["delta"] = self.mechanism.guarantee(step)


class MetricsJsonl(keras.callbacks.Callback):
    """Appends one JSON object per evaluation to `path`.

    Each line has `step`, `epsilon`, `delta`, `test_accuracy`, `test_loss`, the
    training metrics of the interval, `wall_time_s` since training began, and
    the items of `extra` (e.g. `{"simulation": true}`). Epochs that ran no
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
        record = {
            "step": int(logs.pop("step")),
            "epsilon": float(logs.pop("epsilon")),
            "delta": float(logs.pop("delta")),
        }
        for key, value in sorted(logs.items()):
            name = "test_" + key[len("val_"):] if key.startswith("val_") else "train_" + key
            record[name] = float(value)
        record["wall_time_s"] = round(time.time() - self._start, 2)
        record.update(self.extra)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class ProgressLog(keras.callbacks.Callback):
    """An absl log line every `every` steps: step, loss, accuracy, epsilon."""

    def __init__(self, num_steps, every=50):
        super().__init__()
        self.num_steps = num_steps
        self.every = every

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if logs and (step % self.every == 0 or step == self.num_steps):
            logging.info(
                "step %d/%d  loss %.4f  accuracy %.4f  grad_norm %.3f  clipped %.2f  epsilon %.3f",
                step, self.num_steps, logs.get("loss", float("nan")),
                logs.get("accuracy", float("nan")), logs.get("grad_norm", float("nan")),
                logs.get("clipped_fraction", float("nan")), logs.get("epsilon", float("nan")),
            )

    def on_epoch_end(self, epoch, logs=None):
        if not ran_validation(logs):
            return
        logs = logs or {}
        logging.info(
            "eval at step %d: test_accuracy %.4f  test_loss %.4f  epsilon %.3f",
            logs.get("step", -1), logs.get("val_accuracy", float("nan")),
            logs.get("val_loss", float("nan")), logs.get("epsilon", float("nan")),
        )


class OperativeConfigSaver(keras.callbacks.Callback):
    """Writes `gin.operative_config_str()` after the first training step."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self._done = False

    def on_train_batch_end(self, batch, logs=None):
        if not self._done:
            with open(self.path, "w") as f:
                f.write(gin.operative_config_str())
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
        save_checkpoint(self.manager, self.ledger, int(self.model.optimizer.iterations.numpy()))


def save_checkpoint(manager, ledger, step):
    """Sets the ledger to `step` and its epsilon, then saves checkpoint number `step`."""
    ledger.steps.assign(step)
    ledger.epsilon.assign(ledger.mechanism.epsilon(step))
    manager.save(checkpoint_number=step)


def make_privacy_ledger(mechanism: accounting.DPMechanism, *, sampling_seed: int,
                        noise_seed=None, config: str = "") -> tf.Module:
    """Variables that put the run's privacy ledger and secret coins into every checkpoint.

    The module holds:
    * `mechanism_json` (string): `mechanism.to_dict()` as JSON, the whole
      mechanism the checkpoint's steps were taken under;
    * `steps` (int64) and `epsilon` (float64), set before each save (read
      them with `tf.train.load_checkpoint(path).get_tensor(
      "ledger/epsilon/.ATTRIBUTES/VARIABLE_VALUE")`);
    * `sampling_seed` (int64) and `noise_seed` (int64, -1 when drawn from
      OS entropy): the secret coins. The checkpoint is the ONLY place they
      are written (`tfdp.dp.coins`); the noise generator's state is saved
      with the DPModel;
    * `config` (string): the run's gin bindings (`gin.config_str()`), so a
      rerun can say which settings changed.

    `check_privacy_ledger` compares a restored ledger with the new run.
    Create it outside any strategy scope (plain host variables). The
    mechanism itself stays a Python attribute (`ledger.mechanism`).

    Args:
      mechanism: the run's `DPMechanism`.
      sampling_seed: the run's sampling seed (secret, or fixed by the user).
      noise_seed: the user's fixed noise seed, or None.
      config: the run's gin bindings.

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
    return ledger


_LEDGER_KEY = "ledger/{}/.ATTRIBUTES/VARIABLE_VALUE"


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
    reader = tf.train.load_checkpoint(checkpoint_path)
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


def config_changes(saved: str, current: str) -> list:
    """The gin bindings that differ between two `gin.config_str()`s, as '-'/'+' lines."""
    def bindings(config):
        return {line for line in config.splitlines() if line and not line.startswith("#")}

    old, new = bindings(saved), bindings(current)
    return ([f"- {line}" for line in sorted(old - new)]
            + [f"+ {line}" for line in sorted(new - old)])


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


def tensorboard_callback(workdir):
    """Keras' TensorBoard callback: train/ and validation/ scalars per evaluation.

    Scalars (epsilon among them) are written once per evaluation interval,
    with `update_freq="epoch"`: in Keras 3.15 an integer `update_freq` leaves
    a `record_if` active at epoch end that drops the epoch summaries unless
    the step is a multiple of it.
    """
    return keras.callbacks.TensorBoard(
        log_dir=os.path.join(workdir, "tensorboard"), update_freq="epoch", write_graph=False
    )
