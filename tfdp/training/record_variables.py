"""The checkpoint's privacy record as variables: made, saved with each checkpoint, read back.

What the record holds and what a resume may change are
`tfdp.accounting.checkpoint_record`'s (pure Python). This module holds the
record as host variables of a `tf.Module`, which the run's
`tf.train.Checkpoint` saves under `checkpoint_record.CHECKPOINT_NAME`
(`ledger`, the name every checkpoint has used), and reads a saved record
back from a checkpoint file, before anything is built.
"""

import tensorflow as tf

from tfdp import accounting
from tfdp import storage
from tfdp.accounting import checkpoint_record

# The saved key of a record field, e.g. "ledger/epsilon/.ATTRIBUTES/VARIABLE_VALUE".
KEY = checkpoint_record.CHECKPOINT_NAME + "/{}/.ATTRIBUTES/VARIABLE_VALUE"
_DTYPES = {str: tf.string, int: tf.int64, float: tf.float64}


def _variables(name, fields, types) -> tf.Module:
    module = tf.Module(name=name)
    with tf.device("/CPU:0"):
        for field, value in fields.items():
            setattr(module, field, tf.Variable(value, dtype=_DTYPES[types[field]],
                                               trainable=False, name=field))
    return module


def make_privacy_record(mechanism: accounting.DPMechanism, *, sampling_seed: int,
                        noise_seed=None, config: str = "", data: str = "") -> tf.Module:
    """Variables that put the run's privacy record and secret seeds into every checkpoint.

    The module holds the fields of `checkpoint_record.private_record`:
    * `mechanism_json` (string): the whole mechanism the checkpoint's steps
      were taken under;
    * `steps` (int64) and `epsilon` (float64), set before each save
      (`save_checkpoint`; read them with `tf.train.load_checkpoint(path).
      get_tensor("ledger/epsilon/.ATTRIBUTES/VARIABLE_VALUE")`);
    * `sampling_seed` (int64) and `noise_seed` (int64, -1 when drawn from
      OS entropy): the secret seeds. The noise generator's state is saved
      with the DPModel;
    * `config` (string): the run's gin bindings;
    * `data` (string): the run's data fingerprints, as JSON
      (`saved_data_fingerprint`).

    `check_privacy_record` compares a saved record with the new run.
    Create it outside any strategy scope (plain host variables). The
    mechanism itself stays a Python attribute (`record.mechanism`).

    Args:
      mechanism: the run's `DPMechanism`.
      sampling_seed: the run's sampling seed (secret, or fixed by the user).
      noise_seed: the user's fixed noise seed, or None.
      config: the run's gin bindings.
      data: the run's data fingerprints, as JSON.

    Returns:
      A `tf.Module` to add to the `tf.train.Checkpoint` as `ledger`.
    """
    record = _variables("privacy_record", checkpoint_record.private_record(
        mechanism, sampling_seed=sampling_seed, noise_seed=noise_seed, config=config,
        data=data), checkpoint_record.PRIVATE_FIELDS)
    record.mechanism = mechanism
    return record


def make_non_private_record(num_steps: int, *, sampling_seed: int,
                            config: str = "", data: str = "") -> tf.Module:
    """The checkpoint's record of a NON-PRIVATE run (`privacy=None`): no mechanism, no epsilon.

    It takes the privacy record's place in the checkpoint (under the same
    name, `ledger`), with `privacy` = "NOT PRIVATE" as its mark
    (`checkpoint_record.non_private_record`), so that a private run never
    resumes a non-private checkpoint, nor the other way round
    (`check_privacy_record`, `check_non_private_record`). It holds `privacy`
    (string), `steps` (int64, set before each save), the run's
    `sampling_seed` (int64, not a secret here), `config` and `data` (as in
    `make_privacy_record`). `record.mechanism` is None.

    Args:
      num_steps: the planned optimizer updates (kept as `record.num_steps`).
      sampling_seed: the seed of the batches.
      config: the run's gin bindings.
      data: the run's data fingerprints, as JSON.

    Returns:
      A `tf.Module` to add to the `tf.train.Checkpoint` as `ledger`.
    """
    record = _variables("non_private_record", checkpoint_record.non_private_record(
        sampling_seed=sampling_seed, config=config, data=data),
        checkpoint_record.NON_PRIVATE_FIELDS)
    record.mechanism = None
    record.num_steps = int(num_steps)
    return record


def save_checkpoint(manager: tf.train.CheckpointManager, record: tf.Module, step: int) -> None:
    """Sets the record to `step` and its epsilon, then saves checkpoint number `step`.

    A non-private run's record (`make_non_private_record`) has no epsilon.

    Args:
      manager: the run's checkpoint manager.
      record: the `make_privacy_record` (or `make_non_private_record`) module
        its checkpoint holds.
      step: optimizer updates taken.
    """
    for field, value in checkpoint_record.at_step(record.mechanism, step).items():
        getattr(record, field).assign(value)
    manager.save(checkpoint_number=step)


def read_record(checkpoint_path: str) -> dict:
    """The record a checkpoint file holds, as `{field: value}`, without building anything.

    Args:
      checkpoint_path: a checkpoint prefix (local or gs://).

    Returns:
      The fields of either kind of record the checkpoint has (a field it
      lacks is absent): strings as bytes, numbers as Python int or float.
    """
    reader = storage.checkpoint_reader(checkpoint_path)
    saved = {}
    for field in {**checkpoint_record.PRIVATE_FIELDS, **checkpoint_record.NON_PRIVATE_FIELDS}:
        if reader.has_tensor(KEY.format(field)):
            value = reader.get_tensor(KEY.format(field))
            saved[field] = value if isinstance(value, bytes) else value.item()
    return saved


def saved_data_fingerprint(checkpoint_path: str):
    """The data fingerprints a checkpoint's record holds (a dict), or None if it has none.

    None for a checkpoint that records no data fingerprints, or one whose
    record is not readable JSON (`checkpoint_record.data_fingerprints`).
    """
    return checkpoint_record.data_fingerprints(read_record(checkpoint_path))


def check_non_private_record(checkpoint_path: str, num_steps: int):  # -> (steps, config)
    """Refuses to resume a PRIVATE run's checkpoint without privacy, or too many steps.

    Reads the record from the file (`checkpoint_record.check_non_private`).

    Args:
      checkpoint_path: the workdir's latest checkpoint.
      num_steps: the non-private run's planned updates.

    Returns:
      `(steps, config)`: the steps the checkpoint holds and its gin bindings.

    Raises:
      ValueError: the checkpoint is a private run's (or an unknown one's), or
        it holds more steps than planned.
    """
    return checkpoint_record.check_non_private(read_record(checkpoint_path), num_steps,
                                               where=checkpoint_path)


def check_privacy_record(checkpoint_path: str, mechanism: accounting.DPMechanism, *,
                         sampling_seed=None, noise_seed=None):  # -> (steps, config)
    """Refuses to resume a checkpoint that was written under another mechanism.

    Reads the record from the file, so it runs before anything is built,
    written or released (`checkpoint_record.check_private` says what is
    compared).

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
    return checkpoint_record.check_private(
        read_record(checkpoint_path), mechanism, where=checkpoint_path,
        sampling_seed=sampling_seed, noise_seed=noise_seed)
