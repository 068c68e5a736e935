"""What a resumed run may change: the rule, and the check that applies it before anything is built.

A run restarted with the same command resumes from its checkpoint
(`tfdp.workdir.resume_checkpoint`). The checkpoint holds the model, the
optimizer (its learning rate, momentum, step) and the privacy record, and a
restore puts them back whatever the new command says, so a new learning rate
or optimizer given on resume would be printed but not used: the workdir's
operative config and report would state a setting that did not train the
model. The rule is therefore:

**A resume may change only settings that change neither the model nor what
its metrics and report say** (`RESUMABLE`): the planned number of steps
(only up; `NUM_STEPS`, with the privacy record's check), how often it
evaluates and checkpoints, the evaluation batch size, the progress display,
where the data is read from, the strategy and devices, XLA, op determinism.
**Every other setting that differs from the checkpoint's is refused, by
name, before anything is built or written**: the optimizer and its learning
rate, the model and its builder's arguments, augmentation, EMA, the data
split, the evaluation set, seeds, ... The privacy mechanism itself is checked
separately, field by field (`tfdp.accounting.checkpoint_record.check_private`).

Settings are compared as values, not as text (`tfdp.gin_bindings`): a
learning rate set by a macro, a `--gin_param` or a file is the same setting,
and `NUM_STEPS = 6` changes `tfdp.OptimizationConfig.num_steps`.
"""

import dataclasses
from typing import List

from tfdp import configs
from tfdp import gin_bindings

DATA, OPTIMIZATION, EVALUATION, RUNTIME = (
    f"tfdp.{cls.__name__}" for cls in (configs.DataConfig, configs.OptimizationConfig,
                                       configs.EvaluationConfig, configs.RuntimeConfig))
STRATEGY = "tfdp.training.make_strategy"

# (configurable, argument) pairs that a resume may change, and why each is harmless.
RESUMABLE = {
    (OPTIMIZATION, "num_steps"): "more steps extend the run (fewer than the checkpoint holds are "
                            "refused); the report states the steps it covers",
    (EVALUATION, "eval_every_steps"): "when it evaluates, not what",
    (RUNTIME, "checkpoint_every_steps"): "when it saves",
    (EVALUATION, "eval_batch_size"): "how the same test examples are batched",
    (RUNTIME, "progress_bar"): "the display",
    (DATA, "data_dir"): "where the same prepared dataset is read from (its fingerprint "
                           "is checked: tfdp.data.fingerprint)",
    (RUNTIME, "strategy"): "the devices; each logical batch and its noise stay the same",
    (RUNTIME, "jit_compile"): "how the same step is compiled",
    (RUNTIME, "deterministic"): "op determinism, not the computation",
    (STRATEGY, "tpu"): "which TPU",
    (STRATEGY, "devices"): "which local devices",
    (STRATEGY, "worker_timeout_s"): "how long to wait for workers",
    (STRATEGY, "wait_log_every_s"): "how often the wait is logged",
}


@dataclasses.dataclass(frozen=True)
class Change:
    """One setting that differs between the checkpoint's config and this run's.

    Attributes:
      name: the full name, e.g. "tfdp.training.build_optimizer.learning_rate".
      before: its value in the checkpoint's config, as text (an unbound
        argument: the function's default, or "(not set)" if unknown).
      after: its value now, as text.
      resumable: whether `RESUMABLE` allows a resume to change it.
    """

    name: str
    before: str
    after: str
    resumable: bool

    def lines(self):
        """The change as '-'/'+' lines of `name = value` (a side that is not set is left out)."""
        out = []
        if self.before != UNSET:
            out.append(f"- {self.name} = {self.before}")
        if self.after != UNSET:
            out.append(f"+ {self.name} = {self.after}")
        return out


UNSET = "(not set)"


def changed_settings(saved_config: str, current_config: str) -> List[Change]:
    """The settings whose values differ between two gin config texts.

    Args:
      saved_config: the config the checkpoint was written under (the privacy record's
        `config`, a `gin.config_str()`).
      current_config: this run's `gin.config_str()`.

    Returns:
      One `Change` per (configurable, argument) whose resolved value differs,
      or that is bound in only one of them; sorted by name. The saved
      config's old-style trainer arguments (`tfdp.train_and_evaluate.batch_size`)
      are compared under their new homes (`tfdp.configs.new_key`). A saved text gin
      can no longer parse is compared line by line instead (each differing
      line a non-resumable change).
    """
    try:
        old = gin_bindings.resolved(saved_config)
        new = gin_bindings.resolved(current_config)
    except (ValueError, SyntaxError):
        return _changed_lines(saved_config, current_config)
    # A checkpoint of an older tfdp bound the settings as tfdp.train_and_evaluate's
    # arguments: compared under their homes today (tfdp.configs.MOVED).
    old = {configs.new_key(key): value for key, value in old.items()}
    changes = []
    for key in sorted(set(old) | set(new)):
        before, after = (side[key] if key in side else gin_bindings.default_value(key)
                         for side in (old, new))
        if not same_value(before, after):
            changes.append(Change(gin_bindings.setting_name(key), _text(before), _text(after),
                                  resumable=key in RESUMABLE))
    return changes


def same_value(a, b) -> bool:
    """Whether two gin values are the same setting: numbers by value (4 == 4.0), not text.

    Containers compare element by element (a tuple is not a list); booleans
    are not numbers here (True is not 1); NaN equals NaN; anything else
    compares by type and `==`, or by `repr` where `==` is not defined.
    """
    if a is gin_bindings.NO_DEFAULT or b is gin_bindings.NO_DEFAULT:
        return a is b
    if _is_number(a) and _is_number(b):
        return a == b or (a != a and b != b)  # pylint: disable=comparison-with-itself
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # pylint: disable=broad-except  (an object without a plain ==)
        return repr(a) == repr(b)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value):
    """A value as text: "(not set)" for an unbound argument without a default."""
    return UNSET if value is gin_bindings.NO_DEFAULT else repr(value)


def _changed_lines(saved, current):
    def lines(text):
        return {line for line in text.splitlines() if line and not line.startswith("#")}

    old, new = lines(saved), lines(current)
    return [Change(line, line, UNSET, False) for line in sorted(old - new)] + [
        Change(line, UNSET, line, False) for line in sorted(new - old)]


def refusal(workdir: str, steps: int, changes: List[Change]) -> str:
    """The message that refuses to resume `workdir` at `steps` for the non-resumable `changes`."""
    refused = [c for c in changes if not c.resumable]
    names = ", ".join(c.name.rsplit(".", 1)[-1] for c in refused)
    lines = "\n  ".join(line for c in refused for line in c.lines())
    allowed = ", ".join(sorted({arg for (_, arg) in RESUMABLE}))
    return (
        f"{workdir} holds a run stopped at step {steps}, trained with other values of "
        f"{names} than this command's (- the checkpoint's, + this command's):\n  {lines}\n"
        "A resume restores the checkpoint's model and optimizer and continues that run: "
        f"from step {steps} on, these settings would be printed but not used (the restored "
        "optimizer keeps its own learning rate and slots), or would train one model under "
        "two settings that the report states as one. Nothing was changed. Run the same "
        "command as before to resume (its values are in operative_config.gin), or use a new "
        f"workdir for the new settings. A resume may change only: {allowed}.")
