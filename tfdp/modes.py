"""The two training modes, behind one interface: private (DP-SGD) and non-private.

The trainer (`tfdp.train_and_evaluate`) never asks which mode it runs: the
five places where the modes differ are methods of the mode object.

| what            | `PrivateMode`                          | `NonPrivateMode`                     |
|-----------------|--------------------------------------------|------------------------------------------|
| plan            | `DPMechanism` (`tfdp.planning.plan_private`) | `NonPrivatePlan`                       |
| Keras model     | `DPModel`: clipping, noise once per batch  | `NonPrivateModel`: mean loss             |
| privacy record  | the mechanism and the secret seeds         | "NOT PRIVATE", the public seed           |
| report          | `privacy_report.{json,md}` with epsilon    | `NOT_PRIVATE.{json,md}`, no epsilon      |
| final message   | epsilon at delta                           | NOT PRIVATE                              |

`AuditedMode` is a private run with an empirical audit's hooks
(`tfdp.audit`, run by `tools/audit.py`): canaries in the training split, its
own DPModel, and an "audit" section in the report.

`make_mode(privacy, audit)` picks one. A new mode (user-level DP, correlated
noise) is a new class here, not a branch of the trainer.
"""

import dataclasses
import json
import os

import gin
import keras
from absl import logging

from tfdp import accounting
from tfdp import configs
from tfdp import planning
from tfdp import storage
from tfdp.dp import seeds
from tfdp.dp import precision
from tfdp.export import privacy_report
from tfdp.training import callbacks as callbacks_lib
from tfdp.training import distribute
from tfdp.training import record_variables
from tfdp.training.dp_model import DPModel
from tfdp.training.non_private_model import NonPrivateModel

NOT_PRIVATE = privacy_report.NOT_PRIVATE


def make_mode(privacy, audit=None):
    """The mode of a run: `privacy` a `tfdp.configs.PrivacyConfig`, or None (not private).

    Raises:
      ValueError: an audit of a non-private run.
    """
    if privacy is None:
        if audit is not None:
            raise ValueError("privacy=None (NOT PRIVATE) does not take audit: an empirical "
                             "privacy audit of a run without privacy. Remove audit, or train "
                             "privately (privacy='dp').")
        return NonPrivateMode()
    return PrivateMode(privacy) if audit is None else AuditedMode(privacy, audit)


def _hyperparameters(**kwargs):
    return json.loads(json.dumps(kwargs, default=str))


def hyperparameters(config, dp_model):
    """The training settings a report records (JSON-safe), beside its privacy facts."""
    return _hyperparameters(
        dataset=config.data.dataset, train_split=config.data.train_split,
        augmentation=config.augmentation.augmentation, augmult=config.augmentation.augmult,
        accumulation_steps=config.optimization.accumulation_steps,
        ema_decay=config.optimization.ema_decay, augtest=config.augmentation.augtest,
        seed=config.runtime.seed,
        optimizer=keras.optimizers.serialize(dp_model.optimizer)["config"])


class PrivateMode:
    """DP-SGD: clipped per-example gradients, Gaussian noise once per logical batch, accounting.

    Args:
      privacy: the run's `tfdp.configs.PrivacyConfig`.
    """

    private = True
    report_files = (privacy_report.REPORT_JSON, privacy_report.REPORT_MD)

    def __init__(self, privacy):
        self.privacy = privacy

    def plan(self, config, strategy):
        """The `DPMechanism` (`tfdp.planning.plan_private`)."""
        return planning.plan_private(config, strategy)

    def prepare_train(self, train):
        """The training split as this mode trains on it (unchanged)."""
        return train

    def check_start(self, plan, *, workdir, chief, resuming):
        """Before the workdir is written: refuses what `start` would refuse, writing nothing.

        Raises:
          ValueError: as `start`.
        """
        if self.privacy.study_dir and chief:
            _record_in_study(self.privacy.study_dir, workdir, plan,
                             sampling_seed=self.privacy.sampling_seed, fresh=not resuming,
                             write=False)

    def start(self, plan, *, workdir, chief, resuming):
        """Before the first step: a study run enters the study's ledger at its planned steps.

        Called before the run's first release of private data: once
        checkpoint 0 exists, right before the first step, or, for a run with
        private data normalization, before that is released while the model
        is built. So a run that is stopped, or crashes, after its first
        release is still in the study's epsilon (its checkpoints and
        evaluations are functions of the private data), and a run refused or
        killed before it released anything leaves no line (the study counts
        nothing for it, and its rerun is a fresh run); at the end, `report`
        writes the same line again. The chief only; no-op without `study_dir`.

        Raises:
          ValueError: a fresh run (not `resuming`) whose workdir already has a
            line in the study (an earlier run there took a step, and its
            workdir was since removed: its line is kept, and this run is
            refused), or a study that this run's record cannot be composed
            with (the ledger is left as it was).
        """
        if self.privacy.study_dir and chief:
            _record_in_study(self.privacy.study_dir, workdir, plan,
                             sampling_seed=self.privacy.sampling_seed, fresh=not resuming)

    def check_resume(self, latest, plan):
        """`(steps, saved_config)` of checkpoint `latest`, refused if not of this mechanism."""
        return record_variables.check_privacy_record(
            latest, plan, sampling_seed=self.privacy.sampling_seed,
            noise_seed=self.privacy.noise_seed)

    def build_model(self, model, plan, optimization):
        """The `DPModel` around `model` (in the strategy's scope)."""
        return DPModel(model, plan, accumulation_steps=optimization.accumulation_steps,
                       noise_seed=self.privacy.noise_seed, ema_decay=optimization.ema_decay,
                       clipping=self.privacy.clipping)

    def make_checkpoint_record(self, plan, *, strategy, config_text, data, seed):
        """The checkpoint's privacy record, with the secret sampling seed (drawn by the chief)."""
        del seed  # public; never the batches' seed of a private run
        chosen = self.privacy.sampling_seed
        return record_variables.make_privacy_record(
            plan, noise_seed=self.privacy.noise_seed, config=config_text, data=data,
            sampling_seed=distribute.broadcast_from_chief(
                strategy, seeds.secret_seed() if chosen is None else chosen))

    def step_callback(self, plan):
        """The callback that puts the step (and epsilon) into each epoch's logs."""
        return callbacks_lib.PrivacyCallback(plan)

    def metrics_fields(self):
        """What every metrics.jsonl line of this mode also says."""
        return {"simulation": True} if self.privacy.simulation else {}

    def report(self, plan, *, config, dp_model, checkpoint_record, steps_done, workdir, chief):
        """The privacy report (`tfdp.export.privacy_report.build_privacy_report`).

        A study run appends its mechanism to the study ledger first (the chief
        only: one entry per run), and the report states the study's epsilon.
        """
        del checkpoint_record  # its seeds are secret: the report says only if they were fixed
        study = None
        if self.privacy.study_dir and chief:
            study = _record_in_study(self.privacy.study_dir, workdir, plan,
                                     sampling_seed=self.privacy.sampling_seed)
        simulation = self.privacy.simulation
        if simulation:
            logging.warning("This run SIMULATES %s; it is not private at the reference "
                            "epsilon.", simulation.get("reference", simulation))
        return privacy_report.build_privacy_report(
            plan, steps_completed=steps_done, hyperparameters=hyperparameters(config, dp_model),
            exported_parameters="ema" if config.optimization.ema_decay is not None else "last",
            simulation=simulation, study=study,
            clip_margin=precision.clip_margin_record(
                plan.l2_clip_norm, device=dp_model.traced_matmul_inputs))

    def write_report(self, report, folder):
        """Writes the report's two files into `folder`; returns their paths."""
        return privacy_report.write_privacy_report(report, folder)

    def finished_fields(self, report):
        """What FINISHED states of the guarantee."""
        return {"epsilon": report["epsilon"], "delta": report["delta"]}

    def say_done(self, report, export_dir):
        logging.info("Done: epsilon=%.4f at delta=%g after %d steps; SavedModel in %s.",
                     report["epsilon"], report["delta"], report["steps"], export_dir)


class AuditedMode(PrivateMode):
    """A private run with an empirical privacy audit's hooks (`tfdp.audit`).

    `audit.prepare_train(split)` may put canaries into the training split
    (before NUM_EXAMPLES is checked), `audit.build_dp_model(model, mechanism,
    **kwargs)` builds the DPModel, and `audit.result(dp_model, mechanism)`
    becomes the report's "audit" section. An audit draws new canaries, so it
    never resumes a checkpoint.
    """

    def __init__(self, privacy, audit):
        super().__init__(privacy)
        self.audit = audit

    def prepare_train(self, train):
        return self.audit.prepare_train(train)

    def check_resume(self, latest, plan):
        raise ValueError(f"An audit draws new canaries, so it cannot resume {latest}: use a "
                         "fresh workdir.")

    def build_model(self, model, plan, optimization):
        return self.audit.build_dp_model(
            model, plan, accumulation_steps=optimization.accumulation_steps,
            noise_seed=self.privacy.noise_seed, ema_decay=optimization.ema_decay,
            clipping=self.privacy.clipping)

    def report(self, plan, *, dp_model, **kwargs):
        report = super().report(plan, dp_model=dp_model, **kwargs)
        report["audit"] = self.audit.result(dp_model, plan)
        return report


# What has no non-private meaning and would change what the run does: refused, not listed.
_REFUSED_WITHOUT_PRIVACY = {
    "data_normalization": "Tramer & Boneh's private feature normalization (a noisy DP "
                          "release); for a non-private ScatterNet head use GroupNorm (e.g. "
                          "tfdp.models.build_scatternet_linear.groups = 27)",
    "study_dir": "a study ledger composes PRIVATE runs; a non-private run has no epsilon to "
                 "add, and if it trained on the study's private data the study has no "
                 "guarantee at all",
}


class NonPrivateMode:
    """Training WITHOUT privacy (docs/non_private.md): plain mean-loss steps, no accounting.

    Same data, sampler, model, augmentation, optimizer, EMA, evaluation,
    checkpoints and workdir protocol as a private run; `NOT_PRIVATE.{json,md}`
    stand where the privacy report would be, and metrics.jsonl lines say
    "privacy": "NOT PRIVATE". The batches are keyed by the public `seed`
    (`tfdp.configs.RuntimeConfig.seed`): nothing is secret. The privacy
    settings the config gives (bindings of `tfdp.configs.PrivacyConfig`) are
    not used: a warning lists them, and so does NOT_PRIVATE.json.
    """

    private = False
    report_files = (privacy_report.NOT_PRIVATE_JSON, privacy_report.NOT_PRIVATE_MD)

    def plan(self, config, strategy):
        """The `NonPrivatePlan`, after refusing what has no non-private meaning.

        Raises:
          ValueError: data_normalization or study_dir given; an unknown
            clipping; an invalid N, B, T, sampling or static_batch_size.
        """
        given = privacy_settings_given()
        for name, why in _REFUSED_WITHOUT_PRIVACY.items():
            if given.get(name):
                raise ValueError(f"privacy=None (NOT PRIVATE) does not take {name}: {why}. "
                                 f"Remove {name}, or train privately (privacy='dp').")
        if given.get("clipping", "auto") not in configs.CLIPPING_PATHS:
            raise ValueError(f"clipping={given['clipping']!r}: clipping must be one of "
                             f"{configs.CLIPPING_PATHS}.")
        unused = {name: value for name, value in given.items()
                  if name not in _REFUSED_WITHOUT_PRIVACY}
        return planning.plan_non_private(config, strategy, unused)

    def prepare_train(self, train):
        return train

    def check_start(self, plan, *, workdir, chief, resuming):
        del plan, workdir, chief, resuming

    def start(self, plan, *, workdir, chief, resuming):
        del plan, workdir, chief, resuming  # no study: plan() refuses study_dir without privacy

    def check_resume(self, latest, plan):
        return record_variables.check_non_private_record(latest, plan.num_steps)

    def build_model(self, model, plan, optimization):
        del plan  # nothing in a plain step depends on it
        return NonPrivateModel(model, accumulation_steps=optimization.accumulation_steps,
                               ema_decay=optimization.ema_decay)

    def make_checkpoint_record(self, plan, *, strategy, config_text, data, seed):
        del strategy  # the seed is public and the same on every worker
        return record_variables.make_non_private_record(plan.num_steps, config=config_text,
                                                        data=data, sampling_seed=seed)

    def step_callback(self, plan):
        return callbacks_lib.StepCallback(plan.num_steps)

    def metrics_fields(self):
        return {"privacy": NOT_PRIVATE}

    def report(self, plan, *, config, dp_model, checkpoint_record, steps_done, workdir, chief):
        """The NOT_PRIVATE statement (`privacy_report.build_not_private_report`).

        Its `sampling_seed` is the one the batches used: the checkpoint
        record's (a resumed checkpoint's record keeps the seed its first steps
        used).
        """
        del workdir, chief
        report = privacy_report.build_not_private_report(
            steps_completed=steps_done, planned_steps=plan.num_steps,
            num_examples=plan.num_examples, batch_size=plan.batch_size,
            sampling=plan.sampling,
            unused_privacy_settings=_hyperparameters(**plan.unused_privacy_settings),
            hyperparameters=hyperparameters(config, dp_model) | {
                "sampling_seed": int(checkpoint_record.sampling_seed.numpy())},
            exported_parameters="ema" if config.optimization.ema_decay is not None else "last")
        if plan.truncation is not None:
            report["truncation"] = dataclasses.asdict(plan.truncation)
        return report

    def write_report(self, report, folder):
        return privacy_report.write_not_private_report(report, folder)

    def finished_fields(self, report):
        return {"privacy": NOT_PRIVATE}

    def say_done(self, report, export_dir):
        logging.warning("Done: NOT PRIVATE (no clipping, no noise, no epsilon) after %d steps; "
                        "SavedModel in %s, with %s in its assets.", report["steps"], export_dir,
                        privacy_report.NOT_PRIVATE_MD)


def privacy_settings_given():
    """{name: value} of the `tfdp.PrivacyConfig` fields that the gin config binds."""
    try:
        bound = gin.get_bindings(configs.PrivacyConfig)
    except (ValueError, TypeError):
        return {}
    return dict(bound)


def study_run_name(workdir):
    """A run's name in its study's ledger: its workdir's real path (or its URL).

    One name per workdir, so that a rerun or resume replaces its own line and
    two runs never share one: with the workdir's last folder name, `a/run1`
    and `b/run1` of one study were one line, and the study's epsilon counted
    one of them.
    """
    return workdir if storage.is_url(workdir) else os.path.realpath(workdir)


def _record_in_study(study_dir, workdir, mechanism, *, sampling_seed, fresh=False,
                     write=True):
    """Records this run's mechanism in the study ledger; returns the study's epsilon.

    A `fresh` run is refused if its name is in the ledger already (replacing
    that line would forget an earlier run's privacy). If the study's epsilon
    cannot be computed with this run's line (runs sharing a fixed sampling
    seed with other batch sizes), the ledger is put back as it was. All of it
    holds the study's lock (`tfdp.accounting.ledger.study_lock`), so runs of
    one study may start and finish at once. With `write=False`, the same
    checks with nothing written: the refusals, before the workdir is touched.
    """
    name = study_run_name(workdir)
    ledger = accounting.ledger
    with ledger.study_lock(study_dir):  # the whole read-modify-write and its restore
        before = ledger.read_text(study_dir)
        if fresh and before is not None and any(
                record["run"] == name for record in accounting.read_runs(study_dir)):
            raise ValueError(
                f"The study {study_dir} already counts a run in {name}: an earlier run in "
                "this workdir took at least one step, and its workdir was since removed. Its "
                "privacy stays spent, and this run would replace its line in the study. Give "
                "this run a new workdir.")
        if not write:  # the study's epsilon with this run's line, nothing written
            epsilon, runs = ledger.study_epsilon(
                study_dir, delta=mechanism.delta, accountant=mechanism.accountant,
                adding=ledger.make_record(name, mechanism, sampling_seed))
            return {"dir": str(study_dir), "epsilon": epsilon, "delta": mechanism.delta,
                    "runs": dict(runs)}
        accounting.append_run(study_dir, run_name=name, mechanism=mechanism,
                              sampling_seed=sampling_seed)
        try:
            epsilon, runs = accounting.study_epsilon(study_dir, delta=mechanism.delta,
                                                     accountant=mechanism.accountant)
        except ValueError:
            ledger.write_text(study_dir, before)
            raise
    return {"dir": str(study_dir), "epsilon": epsilon, "delta": mechanism.delta,
            "runs": {name: eps for name, eps in runs}}
