"""The checkpoint's privacy record: what every checkpoint states, and what a resume may change.

Every checkpoint of a run carries a record of the privacy it was written
under. A private run's record holds the whole `DPMechanism` (as JSON), the
steps taken and their epsilon, the secret seeds, the gin bindings and the data
fingerprints; a non-private run's (`privacy=None`) holds the mark
`NOT_PRIVATE` instead of a mechanism, and no epsilon. A resume reads the record
back from the checkpoint file, before anything is built, and `check_private`
or `check_non_private` compares it with the new run: another mechanism, the
other mode, a fixed seed that differs, or fewer planned steps than the
checkpoint holds is refused, so that one epsilon never covers two mechanisms.

Not the study ledger (`tfdp.accounting.ledger`), which composes the runs of
a study. `tfdp.training.record_variables` holds the record as variables of
the `tf.train.Checkpoint`, under the object name `CHECKPOINT_NAME`, and reads
a saved one into the `{field: value}` mapping the functions here take (text
fields as bytes or str, numbers as Python numbers; a field the checkpoint
lacks is absent). Pure Python: nothing here imports TensorFlow.
"""

import json
from typing import Any, Dict, Mapping, Optional, Tuple

from tfdp.accounting import mechanism as mechanism_lib

NOT_PRIVATE = "NOT PRIVATE"

# The record's object name in the `tf.train.Checkpoint`, hence in every saved key
# (`ledger/steps/.ATTRIBUTES/VARIABLE_VALUE`): the name every checkpoint has used, kept
# so that older checkpoints still resume.
CHECKPOINT_NAME = "ledger"

# Each field and its type: `str` a string, `int` an int64, `float` a float64 variable.
PRIVATE_FIELDS = {"mechanism_json": str, "steps": int, "epsilon": float, "sampling_seed": int,
                  "noise_seed": int, "config": str, "data": str}
NON_PRIVATE_FIELDS = {"privacy": str, "steps": int, "sampling_seed": int, "config": str,
                      "data": str}


def private_record(mechanism: mechanism_lib.DPMechanism, *, sampling_seed: int,
                   noise_seed: Optional[int] = None, config: str = "",
                   data: str = "") -> Dict[str, Any]:
    """A private run's record before its first checkpoint (`PRIVATE_FIELDS`).

    Args:
      mechanism: the run's `DPMechanism`; stored whole, as
        `mechanism.to_dict()` in sorted-key JSON (`mechanism_json`).
      sampling_seed: the run's sampling seed (secret, or fixed by the user).
      noise_seed: the user's fixed noise seed, or None (stored as -1: drawn from
        OS entropy). The checkpoint is the ONLY place the seeds are written
        (`tfdp.dp.seeds`).
      config: the run's gin bindings (`gin.config_str()`), so that a rerun can
        say which settings changed.
      data: JSON of the fingerprints of the splits the run reads
        (`tfdp.data.fingerprint`), so that a resume trains on the same data.

    Returns:
      `{field: value}`: `steps` 0 and `epsilon` 0.0, set before each save
      (`at_step`).
    """
    return {"mechanism_json": json.dumps(mechanism.to_dict(), sort_keys=True),
            "steps": 0, "epsilon": 0.0, "sampling_seed": int(sampling_seed),
            "noise_seed": -1 if noise_seed is None else int(noise_seed),
            "config": config, "data": data}


def non_private_record(*, sampling_seed: int, config: str = "",
                       data: str = "") -> Dict[str, Any]:
    """A non-private run's record (`NON_PRIVATE_FIELDS`): the mark, no mechanism, no epsilon.

    It takes the private record's place in the checkpoint, under the same
    name, with `privacy` = `NOT_PRIVATE` as its mark, so that a private run
    never resumes a non-private checkpoint, nor the other way round.

    Args:
      sampling_seed: the seed of the batches (the batches of step t are a
        function of (seed, t), so a resumed run continues the same stream; not
        a secret here).
      config: the run's gin bindings.
      data: the run's data fingerprints, as JSON.

    Returns:
      `{field: value}`, with `steps` 0.
    """
    return {"privacy": NOT_PRIVATE, "steps": 0, "sampling_seed": int(sampling_seed),
            "config": config, "data": data}


def at_step(mechanism: Optional[mechanism_lib.DPMechanism], step: int) -> Dict[str, Any]:
    """The fields a checkpoint of optimizer step `step` sets: `steps`, and `epsilon` if private.

    Args:
      mechanism: the run's `DPMechanism`, or None for a non-private run.
      step: optimizer updates taken (the checkpoint number).

    Returns:
      `{"steps": step, "epsilon": mechanism.epsilon(step)}`, without `epsilon`
      when `mechanism` is None.
    """
    fields = {"steps": int(step)}
    if mechanism is not None:
        fields["epsilon"] = mechanism.epsilon(step)
    return fields


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def is_non_private(saved: Mapping[str, Any]) -> bool:
    """Whether a saved record carries the `NOT_PRIVATE` mark.

    Args:
      saved: a checkpoint's record (`{field: value}`).

    Returns:
      True for a non-private run's record; False for a private run's, or a
      record of neither kind.
    """
    return "privacy" in saved and _text(saved["privacy"]) == NOT_PRIVATE


def data_fingerprints(saved: Mapping[str, Any]) -> Optional[dict]:
    """The data fingerprints a saved record holds, or None.

    Args:
      saved: a checkpoint's record (`{field: value}`).

    Returns:
      `{split: fingerprint}` (`tfdp.data.fingerprint`), non-empty; None for a
      record without them (an older tfdp), or whose `data` is not a JSON object.
    """
    if "data" not in saved:
        return None
    try:
        fingerprints = json.loads(_text(saved["data"]))
    except ValueError:
        return None
    return fingerprints if isinstance(fingerprints, dict) and fingerprints else None


def check_non_private(saved: Mapping[str, Any], num_steps: int, *,
                      where: str) -> Tuple[int, str]:
    """Refuses to resume a PRIVATE run's checkpoint without privacy, or too many steps.

    Args:
      saved: the checkpoint's record.
      num_steps: the non-private run's planned updates.
      where: the checkpoint's path, for the messages.

    Returns:
      `(steps, config)`: the steps the checkpoint holds and its gin bindings.

    Raises:
      ValueError: the checkpoint is a private run's (or an unknown one's), or
        it holds more steps than planned.
    """
    if not is_non_private(saved):
        private = "mechanism_json" in saved
        raise ValueError(
            f"The checkpoint {where} is of a "
            f"{'PRIVATE (DP-SGD) run' if private else 'run that recorded no privacy mode'}; "
            "this run has privacy=None (NOT PRIVATE). Resuming it without privacy would "
            "continue private iterates with non-private steps, and neither the privacy "
            "report nor the NOT PRIVATE statement would describe the model. Nothing was "
            "changed. Use a new workdir for the non-private run, or drop privacy=None to "
            "resume the private one.")
    steps = int(saved["steps"])
    if steps > num_steps:
        raise ValueError(
            f"This workdir already holds {steps} steps, more than the {num_steps} planned "
            f"now (NUM_STEPS). Nothing was changed. Plan at least {steps} steps to resume it, "
            "or use a new workdir.")
    return steps, _text(saved["config"])


def check_private(saved: Mapping[str, Any], mechanism: mechanism_lib.DPMechanism, *,
                  where: str, sampling_seed: Optional[int] = None,
                  noise_seed: Optional[int] = None) -> Tuple[int, str]:
    """Refuses to resume a checkpoint that was written under another mechanism.

    Resuming under a different mechanism (another sigma, q, C, delta,
    sensitivity, sampling scheme, truncation cap, data normalization or
    accountant: `DPMechanism.differences`) would compose two mechanisms under
    one epsilon, or silently change the run's epsilon series; fixing a seed
    that differs from the checkpoint's would be silently ignored; a plan with
    fewer steps than the checkpoint holds cannot be met.

    Args:
      saved: the checkpoint's record.
      mechanism: the new run's `DPMechanism`.
      where: the checkpoint's path, for the messages.
      sampling_seed, noise_seed: the seeds the user fixed now, or None.

    Returns:
      `(steps, config)`: the steps the checkpoint holds and the gin bindings
      it was written under.

    Raises:
      ValueError: on any mismatch; the message names every differing field
        (never a secret seed's value) and says what to do.
    """
    if is_non_private(saved):
        raise ValueError(
            f"The checkpoint {where} is of a NON-PRIVATE run (privacy=None): its "
            "steps had no clipping and no noise. Resuming it with DP-SGD would train a model "
            "whose earlier steps no privacy report covers. Nothing was changed. Use a new "
            "workdir for the private run (to fine-tune privately from it, load it as a "
            "pretrained backbone), or set tfdp.train_and_evaluate.privacy = None to resume "
            "the non-private one.")
    if "mechanism_json" not in saved:
        raise ValueError(
            f"The checkpoint {where} was written by an older tfdp that did not "
            "record the whole privacy mechanism, so resuming it cannot be checked. Use a new "
            "workdir.")
    previous = mechanism_lib.DPMechanism.from_dict(json.loads(saved["mechanism_json"]))
    problems = [f"  {line} (checkpoint vs this run)" for line in previous.differences(mechanism)]
    for name, fixed in (("sampling_seed", sampling_seed), ("noise_seed", noise_seed)):
        if fixed is not None and int(saved[name]) != int(fixed):
            problems.append(f"  {name}: this run fixes another value than the checkpoint's")
    if problems:
        raise ValueError(
            "The checkpoint in the workdir was written under another privacy mechanism:\n"
            + "\n".join(problems)
            + "\nResuming would mix two mechanisms under one epsilon. Restore the original "
            "settings, or use a new workdir."
        )
    steps = int(saved["steps"])
    if steps > mechanism.num_steps:
        raise ValueError(
            f"This workdir already holds {steps} steps, more than the {mechanism.num_steps} "
            "planned now (NUM_STEPS, or the TARGET_EPSILON cap). Nothing was changed. Plan at "
            f"least {steps} steps to resume it, or use a new workdir.")
    return steps, _text(saved["config"])
