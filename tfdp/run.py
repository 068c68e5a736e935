"""This run's workdir as one object: opened once (lock, checks), finished once.

`Run.open` locks the workdir for the whole run (the chief; a lease on an
object store, `tfdp.workdir`), decides what it allows (resume a checkpoint
of this very mechanism, return a finished run's report, or start on a
workdir with no earlier output), and turns a failed write into a clear
`WorkdirError`. `Run.restore` restores the checkpoint (or writes the first,
with the secret seeds), and `Run.finish` writes the SavedModel, the report
and, last, FINISHED. The mode (`tfdp.modes`) supplies what differs: the
privacy record's check, the report's files, what FINISHED states.

The trainer hands over the workdir path once; nothing else passes it on.
"""

import contextlib
import json
import os
import re
import shutil
import tempfile

import gin
import tensorflow as tf
from absl import logging

from tfdp import data
from tfdp import resume_rule
from tfdp import storage
from tfdp import workdir as workdir_lib
from tfdp.accounting import checkpoint_record as checkpoint_record_lib
from tfdp.data import fingerprint
from tfdp.export import saved_model
from tfdp.training import distribute
from tfdp.training import record_variables

EXPORT_DIR = "export"
CHECKPOINT_DIR = workdir_lib.CHECKPOINT_DIR


class Run:
    """One training run's workdir: what it holds, its lock, its resume and its FINISHED.

    Attributes:
      workdir: the workdir (a local path or a gs:// URL).
      out_dir: where this process writes: the workdir on the chief, a
        temporary folder on other workers (removed by `finish`).
      latest: the checkpoint to resume, or None.
      finished_report: a finished run's report (the same command again), or
        None when there is work to do.
    """

    def __init__(self, workdir, mode, plan, strategy):
        self.workdir, self.mode, self.plan, self.strategy = workdir, mode, plan, strategy
        self.out_dir, self.latest, self.finished_report = None, None, None

    @classmethod
    @contextlib.contextmanager
    def open(cls, workdir, mode, plan, *, strategy, splits, data_fingerprint):
        """Locks and checks `workdir` for this run; yields the `Run`.

        Args:
          workdir: the run's workdir.
          mode: the `tfdp.modes` mode; plan: its plan (`DPMechanism` or
            `NonPrivatePlan`).
          strategy: the tf.distribute strategy (only its chief locks and writes).
          splits: `{"train": source, "test": source}`, the opened splits;
            data_fingerprint: their fingerprints (`tfdp.data.fingerprint`).

        Raises:
          tfdp.workdir.WorkdirError: a workdir that cannot be locked, is in
            use, holds an earlier run's outputs, a corrupt checkpoint or a
            changed finished run; a failed write during the run.
          ValueError: a checkpoint this run may not resume (`_check_workdir`).
        """
        workdir_lib.check_lockable(workdir)
        run = cls(workdir, mode, plan, strategy)
        with contextlib.ExitStack() as stack:
            if distribute.is_chief(strategy):
                stack.enter_context(workdir_lib.locked(workdir))
            else:  # reads the chief's checkpoints: a workdir named `a[b]` too (storage.tf_path)
                stack.enter_context(storage.folder_aliased(workdir))
            run.latest, run.finished_report = _check_workdir(workdir, mode, plan, splits,
                                                             data_fingerprint)
            if run.finished_report is None:
                run.out_dir = distribute.output_dir(workdir, strategy)
                workdir_lib.clear_finished(run.out_dir)  # not finished until this run says so
                stack.enter_context(_stops_cleanly(run.out_dir))
            yield run

    @property
    def chief(self):
        return distribute.is_chief(self.strategy)

    def restore(self, dp_model, checkpoint_record):
        """Restores `latest`, or saves checkpoint 0 with the fresh seeds: `(manager, start_step)`."""
        workdir_lib.check_held(self.out_dir)
        storage.makedirs(self.out_dir)
        return _restore(dp_model, checkpoint_record, self.out_dir, self.latest)

    def finish(self, report, dp_model, export_model, *, image_shape):
        """The SavedModel, the report and FINISHED (`_finish`); removes a worker's temp folder."""
        _finish(self.mode, report, dp_model, export_model, self.out_dir,
                image_shape=image_shape)
        if self.out_dir != self.workdir:
            shutil.rmtree(self.out_dir, ignore_errors=True)

    @property
    def export_dir(self):
        return os.path.join(self.workdir, EXPORT_DIR)


def _check_workdir(workdir, mode, mechanism, splits, data_fingerprint):
    """What the workdir allows this run to do; read only (the chief holds the lock).

    A workdir without a checkpoint to resume must hold no output of an
    earlier run (`tfdp.workdir.earlier_run_outputs`). A checkpoint (read in
    full: a corrupt one is named, `tfdp.workdir.resume_checkpoint`) must hold
    this mechanism and no more steps than planned (`check_privacy_record`).
    A finished run (all steps and FINISHED, `tfdp.workdir.finished`) is not
    redone: the same settings return its report untouched, once every file
    FINISHED vouches for is checked against the digests it recorded
    (`tfdp.workdir.changed_since_finished`); a changed file is named and
    refused. A run with all its steps but no FINISHED (killed, or a full
    disk, while exporting) goes on to write its export and report. A resume
    follows `tfdp.resume_rule`: a setting that changes training (optimizer,
    learning rate, model, augmentation, ...) and differs from the
    checkpoint's is refused by name, before anything is built, so that a run
    never prints a setting that the restored checkpoint overrides; settings
    that change neither the model nor its metrics (more steps, evaluation
    interval, devices, ...) may change, and are logged. A private run's
    checkpoint is never resumed by a non-private run (`mechanism` a
    `NonPrivatePlan`), nor the other way round (`mode.check_resume`:
    `check_non_private_record`, `check_privacy_record`). Nor is it resumed, or its finished report
    returned, on other data: the fingerprints of `splits` (`{"train": ...,
    "test": ...}`, the opened splits, whose `data_fingerprint` this run has
    computed; `tfdp.data.fingerprint`) must equal the ones its record holds.

    Returns:
      `(latest, report)`: the checkpoint to resume (or None), and the
      finished run's report (or None when there is work left to do).

    Raises:
      tfdp.workdir.WorkdirError: outputs of an earlier run without a
        checkpoint, a corrupt checkpoint, or a finished workdir whose files
        differ from what FINISHED recorded.
      ValueError: from `mode.check_resume` (another mechanism or mode, an
        audit asked to resume), or
        settings that a resume cannot change (`tfdp.resume_rule`).
    """
    latest = workdir_lib.resume_checkpoint(os.path.join(workdir, CHECKPOINT_DIR))
    if not latest:
        found = workdir_lib.earlier_run_outputs(workdir)
        if found:
            workdir_lib.refuse_used_workdir(workdir, found)
        return None, None
    # The mode's record check: another mechanism, the other mode, or an audit is refused.
    steps, saved_config = mode.check_resume(latest, mechanism)
    changes = resume_rule.changed_settings(saved_config, gin.config_str())
    refused = [change for change in changes if not change.resumable]
    if not refused:  # (a changed split, dataset or source is refused below, by its name)
        _check_same_data(workdir, latest, steps, splits, data_fingerprint,
                         resuming=steps < mechanism.num_steps)
    harmless = "\n  ".join(line for change in changes if change.resumable
                           for line in change.lines())
    finished = workdir_lib.finished(workdir)
    if steps == mechanism.num_steps:
        if refused:
            what = ("a finished run" if finished else
                    "a run trained for all its steps (its export is not finished)")
            raise ValueError(
                f"{workdir} holds {what} of {steps} steps with other settings; "
                "nothing was changed. What differs (- that run, + this one):\n  "
                + "\n  ".join(line for change in refused for line in change.lines())
                + "\nUse a new workdir for the new settings.")
        if finished:
            changed = workdir_lib.changed_since_finished(workdir, finished)
            if changed:
                raise workdir_lib.WorkdirError(
                    f"{workdir} is finished ({workdir_lib.FINISHED_FILE}, {steps} steps), but "
                    f"files it vouches for changed since it was written:\n  "
                    + "\n  ".join(changed) + "\nIts report and export may not be this "
                    "run's, so they are not called unchanged; nothing was changed. Put the "
                    "original files back; or, to write this run's export and report again "
                    f"from its checkpoint, remove {workdir_lib.FINISHED_FILE}, {EXPORT_DIR}/ "
                    "and the report files and run the same command again.")
            if changed is not None:
                logging.info("%s already holds this finished run (%d steps; see %s); %s "
                             "(checked against the digests in %s).%s", workdir, steps,
                             workdir_lib.FINISHED_FILE, _what_was_checked(finished),
                             workdir_lib.FINISHED_FILE,
                             f" Settings that do not change it differ:\n  {harmless}"
                             if harmless else "")
                return latest, json.loads(storage.read_text(
                    os.path.join(workdir, mode.report_files[0])))
            logging.warning("%s has a %s without file digests (an older tfdp), so its export "
                            "and report cannot be checked: writing them again from the "
                            "checkpoint.", workdir, workdir_lib.FINISHED_FILE)
        else:
            logging.warning("%s holds all %d steps of this run but no finished export and "
                            "report (no %s): writing them now.", workdir, steps,
                            workdir_lib.FINISHED_FILE)
    elif refused:
        raise ValueError(resume_rule.refusal(workdir, steps, changes))
    elif harmless:
        logging.warning("Resuming %s at step %d with changed settings that change neither the "
                        "model nor its metrics (- before, + now):\n  %s", workdir, steps,
                        harmless)
    return latest, None


def _what_was_checked(record):
    """What a rerun's check of a finished workdir covered, in words, for its message."""
    if EXPORT_DIR in record.get("files", []):
        return "its report and export are unchanged (every file under export/)"
    return (f"the {len(record.get('digests', {}))} files its {workdir_lib.FINISHED_FILE} lists "
            f"are unchanged (written by an older tfdp: other files under {EXPORT_DIR}/ are "
            "not covered)")


def _check_same_data(workdir, latest, steps, splits, data_fingerprint, *, resuming):
    """Refuses a workdir whose checkpoint was trained on other data than this run reads.

    A checkpoint without fingerprints (an older tfdp) cannot be checked: its
    resume is refused; its finished report is returned with a warning.

    Raises:
      ValueError: naming each split whose fingerprint differs.
    """
    saved = record_variables.saved_data_fingerprint(latest)
    if saved is None:
        if resuming:
            raise ValueError(
                f"{workdir} holds a run stopped at step {steps} whose checkpoint does not "
                "record which data it was trained on (written by an older tfdp), so a resume "
                "cannot check that it trains on the same examples: the accountant counts "
                "one dataset. Nothing was changed. Use a new workdir.")
        logging.warning("%s: its checkpoint does not record which data it was trained on (an "
                        "older tfdp); its data cannot be compared with this run's.", workdir)
        return
    changed = fingerprint.compare(saved, splits, data_fingerprint)
    if changed:
        raise ValueError(
            f"{workdir} holds a run of {steps} steps trained on other data than this command "
            "reads (the checkpoint's -> this command's):\n  " + "\n  ".join(changed)
            + "\nA resume must train on the examples its first steps were taken on: the "
            "accountant composes every step on one dataset, and the report's metrics are of "
            "one test set. Nothing was changed. Point data_dir (or $TFDS_DATA_DIR) at the data "
            "the run started on, or use a new workdir for this data. (The same dataset "
            "prepared again by another TFDS or array_record version can differ in its bytes: "
            "then too, use the files the run started on.)")


@contextlib.contextmanager
def _stops_cleanly(out_dir):
    """Turns a failed write (full disk, read-only folder) into a WorkdirError; tidies up.

    What a failed checkpoint save left (`ckpt-N_temp/`, part of `ckpt-N.*`)
    is removed, so nothing looks like progress that is not; checkpoints
    already saved stay, and the same command resumes from them.
    """
    checkpoint_dir = os.path.join(out_dir, CHECKPOINT_DIR)
    before = set(storage.listdir(checkpoint_dir)) if storage.isdir(checkpoint_dir) else set()
    try:
        yield
    except (OSError, tf.errors.OpError) as e:
        if not _is_failed_write(e):
            raise
        workdir_lib.remove_partial_checkpoints(checkpoint_dir, before)
        kept = tf.train.latest_checkpoint(storage.tf_path(checkpoint_dir))
        kept = kept and os.path.join(checkpoint_dir, os.path.basename(kept))  # the user's path
        cause = ("fix the cause (free disk space, raise the file size limit `ulimit -f`, make "
                 "the workdir writable)")
        progress = (f"The checkpoint {kept} is kept; {cause} and run the same command again "
                    "to resume from it." if kept else
                    f"No checkpoint was kept; {cause} and run the same command again.")
        message = storage.user_path(" ".join((getattr(e, "message", None) or str(e)).split()))
        message = message[:500]
        raise workdir_lib.WorkdirError(
            f"The run stopped on a failed write or read in {out_dir}: {type(e).__name__}: "
            f"{message}. {progress} The workdir is not finished (no "
            f"{workdir_lib.FINISHED_FILE}).") from e


# TensorFlow's ops that write files, and the errno texts of a failed write or read.
_WRITE_OPS = re.compile(r"\[Op:(SaveV2|MergeV2Checkpoints|WriteFile|Save|SaveSlices)\]")
_IO_ERRORS = re.compile(r"File too large|No space left|Disk quota exceeded|Read-only file "
                        r"system|Permission denied|Input/output error|Too many open files")


def _is_failed_write(error):
    """Whether `error` is a failed write or read of the workdir (any errno), not a bug.

    Python's OSError (any errno: ENOSPC, EFBIG, EROFS, EDQUOT, EIO, ...); TensorFlow's
    ResourceExhaustedError and PermissionDeniedError (a full disk, a read-only folder); and
    any other TensorFlow error raised by an op that writes files (SaveV2 reports EFBIG,
    "File too large", as OutOfRangeError) or that quotes an I/O errno.
    """
    if isinstance(error, data.DatasetNotFoundError):  # the data's fault, not the workdir's
        return False
    if isinstance(error, (OSError, tf.errors.ResourceExhaustedError,
                          tf.errors.PermissionDeniedError)):
        return True
    message = getattr(error, "message", None) or str(error)
    return bool(_WRITE_OPS.search(message) or _IO_ERRORS.search(message))


def _restore(dp_model, checkpoint_record, out_dir, latest):
    """Restores `latest`, or saves checkpoint 0 with the fresh seeds.

    Returns:
      `(manager, start_step)`.
    """
    parts = {"model": dp_model, "optimizer": dp_model.optimizer,
             checkpoint_record_lib.CHECKPOINT_NAME: checkpoint_record}
    if hasattr(dp_model, "noise_generator"):  # a NonPrivateModel has none
        parts["noise_generator"] = dp_model.noise_generator
    checkpoint = tf.train.Checkpoint(**parts)
    # Every worker saves (saving may run collectives); only the chief's copy is kept.
    manager = tf.train.CheckpointManager(  # storage.tf_path: a workdir named `a[b]` too
        checkpoint, storage.tf_path(os.path.join(out_dir, CHECKPOINT_DIR)), max_to_keep=2
    )
    if latest:
        checkpoint.restore(storage.tf_path(latest)).expect_partial()
        # The settings now in force (the resume rule let only harmless ones change): the
        # next checkpoints record them, for the next rerun's comparison.
        checkpoint_record.config.assign(gin.config_str())
        logging.info("Resumed from %s.", latest)
    start_step = int(dp_model.optimizer.iterations.numpy())
    recorded = int(checkpoint_record.steps.numpy())
    if recorded != start_step:
        raise ValueError(
            f"The checkpoint's privacy record states {recorded} steps but its "
            f"optimizer has taken {start_step}; the checkpoint is inconsistent. Use a fresh "
            "workdir."
        )
    if not latest:
        # A restart before the first interval then continues the same sample
        # and noise streams instead of drawing new secret seeds.
        record_variables.save_checkpoint(manager, checkpoint_record, 0)
    return manager, start_step


def _finish(mode, report, dp_model, export_model, out_dir, *, image_shape):
    """The SavedModel (EMA parameters when EMA is on), the report, then FINISHED.

    `export_model` takes images: the trained model, or a frozen feature
    extractor composed with the trained head (sharing its variables).

    The report is first written to a temporary folder and copied into the
    SavedModel's assets; the SavedModel goes to `export/` atomically
    (`tfdp.export.saved_model`); the report files are then renamed into the
    workdir, read back and compared with the export's copy, and only then is
    `FINISHED` written (atomically, `tfdp.workdir.write_finished`). A kill or
    a full disk at any point leaves a workdir without FINISHED, which a rerun
    finishes. Temporaries of an earlier, killed finish (`.export.tmp-*`,
    `.export.old-*`, `.report.tmp-*`) are removed first: under the lock,
    nothing else writes them.

    The chief writes them once; other workers export too (the save may run
    collectives) into their temp dir, which the caller deletes.

    A non-private run's `report` (`"privacy": "NOT PRIVATE"`) is written as
    `NOT_PRIVATE.{json,md}` instead, by the same steps, and FINISHED says
    "privacy": "NOT PRIVATE" instead of epsilon and delta.
    """
    workdir_lib.check_held(out_dir)
    workdir_lib.remove_stale_temporaries(out_dir)
    files = list(mode.report_files)
    # Beside the outputs on a local disk (renamed into place); in a local temp folder for a
    # URL workdir (each file then uploaded as one object).
    tmp = tempfile.mkdtemp(prefix=".report.tmp-",
                           dir=None if storage.is_url(out_dir) else out_dir)
    try:
        paths = mode.write_report(report, tmp)
        with dp_model.use_ema_parameters():
            saved_model.export_saved_model(
                export_model, os.path.join(out_dir, EXPORT_DIR), image_shape=image_shape,
                asset_paths=paths, overwrite=True,
            )
        for path in paths:
            storage.move(path, os.path.join(out_dir, os.path.basename(path)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name in files:
        if storage.read_bytes(os.path.join(out_dir, name)) != storage.read_bytes(
                os.path.join(out_dir, EXPORT_DIR, "assets", name)):
            raise RuntimeError(f"{name} differs from the export's copy; not finished.")
    if json.loads(storage.read_text(os.path.join(out_dir, files[0])))["steps"] != report["steps"]:
        raise RuntimeError("The privacy report read back is not this run's; not finished.")
    workdir_lib.write_finished(out_dir, {
        "steps": report["steps"],
        **mode.finished_fields(report),
        # The report and the whole export (every file under it: the SavedModel's graph,
        # fingerprint, variables and assets, the report's copies); FINISHED records the
        # size and SHA-256 of each file, and a rerun checks them and any file added since.
        "files": [*files, EXPORT_DIR],
    })
