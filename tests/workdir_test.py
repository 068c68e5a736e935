"""Reruns of a finished workdir: nothing an earlier run wrote is lost or misreported."""

import json
import logging
import os
import re
import shutil

import pytest

PARAMS = ["TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0"]
OUTPUTS = ("privacy_report.json", "privacy_report.md", "export/saved_model.pb",
           "metrics.jsonl")


def _snapshot(workdir):
    return {name: os.stat(workdir / name).st_mtime_ns for name in OUTPUTS}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, run_smoke_module):
    """A finished 2-step run (fashion_mnist.gin + smoke.gin on mock data)."""
    workdir = tmp_path_factory.mktemp("finished")
    report = run_smoke_module(workdir, ["fashion_mnist.gin"], PARAMS)
    return workdir, report


@pytest.fixture
def copy(finished, tmp_path):
    workdir = tmp_path / "wd"
    shutil.copytree(finished[0], workdir)
    return workdir


@pytest.mark.parametrize("params, message", [
    # Before: the removal of finished outputs ran before these checks, and deleted
    # privacy_report.{json,md} and export/.
    (["NUM_STEPS = 1"], "This workdir already holds 2 steps"),
    (["tfdp.OptimizationConfig.sampling = 'possion'"], "Unknown sampling scheme"),
    # Before: "Done" with the old report, although the settings were not the ones used.
    (["tfdp.training.build_optimizer.learning_rate = 0.5"],
     r"finished run of 2 steps with other settings.*\n.*- \S*build_optimizer"
     r".learning_rate = 4.0\n.*\+ \S*build_optimizer.learning_rate = 0.5"),
])
def test_a_failed_rerun_changes_nothing(copy, run_smoke, params, message):
    before = _snapshot(copy)
    with pytest.raises(ValueError, match=message):
        run_smoke(copy, ["fashion_mnist.gin"], [*PARAMS, *params])
    assert _snapshot(copy) == before


def test_the_same_command_again_returns_the_finished_report_untouched(copy, finished,
                                                                     run_smoke):
    before = _snapshot(copy)
    report = run_smoke(copy, ["fashion_mnist.gin"], PARAMS)
    assert report == json.loads(json.dumps(finished[1]))
    assert _snapshot(copy) == before


def test_a_relative_workdir_is_found_again_by_the_same_command(copy, finished, run_smoke,
                                                              monkeypatch):
    # README's command uses --workdir=workdirs/fashion_mnist. Before: TensorFlow's
    # checkpoint state joined the relative folder into the paths it returned, tfdp joined
    # it once more, found no checkpoint, and refused its own finished workdir as "used".
    monkeypatch.chdir(copy.parent)
    before = _snapshot(copy)
    report = run_smoke(copy.name, ["fashion_mnist.gin"], PARAMS)
    assert report == json.loads(json.dumps(finished[1]))
    assert _snapshot(copy) == before


def test_more_steps_extend_the_run(copy, run_smoke):
    report = run_smoke(copy, ["fashion_mnist.gin"], [*PARAMS, "NUM_STEPS = 4"])
    assert report["steps"] == 4
    assert json.loads((copy / "privacy_report.json").read_text())["steps"] == 4


# -- One workdir, one run, nothing lost -----------------------------------------


def _tree(workdir):
    """{relative path: (size, mtime)} of every file under `workdir`."""
    out = {}
    for root, _, files in os.walk(workdir):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, workdir)] = (os.path.getsize(path),
                                                   os.stat(path).st_mtime_ns)
    return out


@pytest.mark.parametrize("remove", ["checkpoints", "checkpoints/checkpoint"])
def test_a_finished_workdir_without_its_checkpoint_state_is_refused(copy, run_smoke, remove):
    # Before: the same command trained again from step 1 with fresh seeds, overwrote
    # export/ and appended a second run to metrics.jsonl, under a report of one run.
    target = copy / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    before = _tree(copy)
    with pytest.raises(ValueError, match=r"holds outputs of an earlier run \(.*export/.*"
                                         r"metrics\.jsonl.*privacy_report\.json.*\) but no "
                                         r"checkpoint that resumes it.*new workdir"):
        run_smoke(copy, ["fashion_mnist.gin"], PARAMS)
    assert _tree(copy) == before


@pytest.mark.parametrize("name", ["export/saved_model.pb", "privacy_report.json",
                                  "metrics.jsonl", "tensorboard/events.out.tfevents.1"])
def test_a_folder_with_someone_s_outputs_is_refused(tmp_path, run_smoke, name):
    workdir = tmp_path / "theirs"
    (workdir / name).parent.mkdir(parents=True, exist_ok=True)
    (workdir / name).write_text("their file")
    with pytest.raises(ValueError, match=rf"holds outputs of an earlier run \({name.split('/')[0]}"):
        run_smoke(workdir, ["fashion_mnist.gin"], PARAMS)
    assert sorted(p.name for p in workdir.rglob("*")) == sorted(
        p.name for p in [workdir / name, (workdir / name).parent] if p != workdir)
    assert (workdir / name).read_text() == "their file"


@pytest.mark.slow
def test_a_folder_with_unrelated_files_is_used_and_they_stay(tmp_path, run_smoke):
    workdir = tmp_path / "mine"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("mine")
    run_smoke(workdir, ["fashion_mnist.gin"], PARAMS)
    assert (workdir / "notes.txt").read_text() == "mine"
    assert (workdir / "FINISHED").exists() and not (workdir / ".tfdp.lock").exists()


@pytest.mark.slow
def test_a_missing_export_is_written_again_never_called_unchanged(copy, run_smoke, caplog):
    # Before: "already holds this finished run; its report and export are unchanged",
    # with no export/ there.
    shutil.rmtree(copy / "export")
    metrics = (copy / "metrics.jsonl").read_text()
    report = run_smoke(copy, ["fashion_mnist.gin"], PARAMS)
    assert "unchanged" not in caplog.text
    assert (copy / "export" / "saved_model.pb").exists()
    assert json.loads((copy / "FINISHED").read_text())["steps"] == report["steps"] == 2
    assert (copy / "metrics.jsonl").read_text() == metrics  # nothing trained again


def _export_fault(monkeypatch, error):
    """Makes the SavedModel write fail half-way (the files are there, then `error`)."""
    import keras  # pylint: disable=g-import-not-at-top

    archive_class = type(keras.export.ExportArchive())  # the backend's subclass
    original = archive_class.write_out

    def write_out(self, filepath, **kwargs):
        original(self, filepath, **kwargs)
        raise error

    monkeypatch.setattr(archive_class, "write_out", write_out)


def _leftovers(workdir):
    return sorted(p.name for p in workdir.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_a_full_disk_during_export_leaves_an_unfinished_workdir_that_a_rerun_finishes(
        tmp_path, run_smoke, monkeypatch):
    # Before: privacy_report.json was written before the SavedModel, a raw OSError
    # escaped, and every rerun said "finished ... unchanged" without an export.
    workdir = tmp_path / "wd"
    _export_fault(monkeypatch, OSError(28, "No space left on device"))
    with pytest.raises(ValueError, match=r"No space left on device.*ckpt-2 is kept.*run the "
                                         r"same command again.*not finished \(no FINISHED\)"):
        run_smoke(workdir, ["fashion_mnist.gin"], PARAMS)
    assert not (workdir / "FINISHED").exists()
    assert not (workdir / "privacy_report.json").exists() and not (workdir / "export").exists()
    assert _leftovers(workdir) == []
    monkeypatch.undo()
    report = run_smoke(workdir, ["fashion_mnist.gin"], PARAMS)
    assert report["steps"] == 2 and (workdir / "export" / "saved_model.pb").exists()
    assert json.loads((workdir / "privacy_report.json").read_text())["steps"] == 2
    assert json.loads((workdir / "FINISHED").read_text())["steps"] == 2
    assert [json.loads(line)["step"] for line in
            (workdir / "metrics.jsonl").read_text().splitlines()] == [2]  # trained once


def _fail_checkpoint_saves(monkeypatch, error):
    """Every checkpoint save leaves a partial ckpt-N_temp/ behind and raises `error(partial)`."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    def save(self, checkpoint_number=None, **kwargs):
        partial = os.path.join(self.directory, f"ckpt-{checkpoint_number}_temp")
        os.makedirs(partial)
        with open(os.path.join(partial, "part-00000-of-00001.data-00000-of-00001"), "w") as f:
            f.write("partial")
        raise error(partial)

    monkeypatch.setattr(tf.train.CheckpointManager, "save", save)


def test_a_full_disk_at_the_first_checkpoint_leaves_nothing_like_progress(
        tmp_path, run_smoke, monkeypatch):
    # Before: a raw ResourceExhaustedError traceback, and checkpoints/ckpt-0_temp left.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    _fail_checkpoint_saves(monkeypatch, lambda partial: tf.errors.ResourceExhaustedError(
        None, None, "No space left on device"))
    workdir = tmp_path / "wd"
    with pytest.raises(ValueError, match=r"ResourceExhaustedError: No space left on device\. "
                                         r"No checkpoint was kept"):
        run_smoke(workdir, ["fashion_mnist.gin"], PARAMS)
    assert not workdir.exists()  # created by the run, and nothing of it stays


def test_a_workdir_that_cannot_be_created_is_refused_before_training(tmp_path, run_smoke):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"Cannot write into the workdir .*a_file/wd.*"
                                         r"Choose a writable workdir"):
        run_smoke(tmp_path / "a_file" / "wd", ["fashion_mnist.gin"], PARAMS)


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs (needs the right to mount; skipped without it)."""
    import subprocess  # pylint: disable=g-import-not-at-top

    path = tmp_path / "ro"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    yield path
    subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_workdir_is_refused_before_training(read_only_dir, run_smoke):
    # Before: a raw PermissionDeniedError traceback once the first checkpoint was saved.
    with pytest.raises(ValueError, match=r"Cannot write into the workdir .*Read-only file "
                                         r"system.*Choose a writable workdir"):
        run_smoke(read_only_dir / "wd", ["fashion_mnist.gin"], PARAMS)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("suffix, named", [(".data-00000-of-00001", "data"),
                                           (".index", "index")])
def test_a_corrupt_checkpoint_is_named_and_the_intact_earlier_one_offered(
        copy, run_smoke, suffix, named):
    # Before: a 50-line traceback ("Read less bytes than requested", or "file is too short
    # to be an sstable") that named no file.
    _truncate(copy / "checkpoints" / f"ckpt-2{suffix}")
    before = _tree(copy)
    with pytest.raises(ValueError) as error:
        run_smoke(copy, ["fashion_mnist.gin"], PARAMS)
    message = str(error.value)
    assert f"checkpoints/ckpt-2{suffix} cannot be read" in message, message
    assert "a truncated file?" in message and "Traceback" not in message
    assert re.search(r"The earlier checkpoint \S*checkpoints/ckpt-0 is intact\. To resume "
                     r"from it, move the files of ckpt-2 .*run the same command again", message)
    assert _tree(copy) == before
    if named == "index":
        return  # with ckpt-2's files moved aside, which of them was cut no longer matters
    # Doing as told resumes from ckpt-0: the same seeds replay steps 1-2.
    (copy / "aside").mkdir()
    for path in (copy / "checkpoints").glob("ckpt-2.*"):
        path.rename(copy / "aside" / path.name)
    report = run_smoke(copy, ["fashion_mnist.gin"], PARAMS)
    assert report["steps"] == 2 and (copy / "FINISHED").exists()


def test_a_corrupt_only_checkpoint_says_the_run_cannot_be_resumed(copy, run_smoke):
    for path in (copy / "checkpoints").glob("ckpt-0.*"):
        path.unlink()
    _truncate(copy / "checkpoints" / "ckpt-2.data-00000-of-00001")
    with pytest.raises(ValueError, match=r"ckpt-2 is corrupt: .*cannot be read.*No earlier "
                                         r"checkpoint is intact.*new workdir"):
        run_smoke(copy, ["fashion_mnist.gin"], PARAMS)


def test_a_url_workdir_is_refused_rather_than_run_without_a_lock(run_smoke):
    # gs:// (and ram://) workdirs are locked by a lease object (tests/lease_test.py); a store
    # without one is refused before anything is written.
    with pytest.raises(ValueError, match=r"s3://bucket/wd is a s3:// URL; tfdp locks its "
                                         r"workdir .* lease object on gs://, ram:// only"):
        run_smoke("s3://bucket/wd", ["fashion_mnist.gin"], PARAMS)


# -- A resume never prints a setting that the checkpoint overrides ------


@pytest.mark.parametrize("param, named", [
    # Before: exit 0, "Resuming ... with changed settings: + learning_rate = 0.01", while
    # the restored optimizer kept training at 4.0 (and the report said 4.0).
    ("tfdp.training.build_optimizer.learning_rate = 0.01", "learning_rate"),
    # Before: Keras's raw "incompatible tensor with shape" once the optimizer restored.
    ("tfdp.training.build_optimizer.name = 'adam'", "name"),
    ("tfdp.OptimizationConfig.ema_decay = 0.9", "ema_decay"),
    ("L2_CLIP_NORM = 0.5", None),  # the privacy record's own check names it
])
def test_a_resume_that_would_change_training_is_refused_by_name(copy, run_smoke, param,
                                                               named):
    before = _tree(copy)
    with pytest.raises(ValueError) as error:
        run_smoke(copy, ["fashion_mnist.gin"], [*PARAMS, "NUM_STEPS = 4", param])
    message = str(error.value)
    if named:
        assert re.search(rf"stopped at step 2, trained with other values of {named} than "
                         r"this command's", message), message
        assert f"+ tfdp.training.build_optimizer.{named} =" in message or (
            f"+ tfdp.OptimizationConfig.{named} =" in message), message
        assert "would be printed but not used" in message and "Nothing was changed" in message
        # num_steps may grow on resume: it is not among the refused settings.
        assert "num_steps" not in message.split("A resume may change only")[0], message
    else:
        assert "l2_clip_norm" in message, message
    assert _tree(copy) == before


@pytest.mark.slow
def test_a_resume_may_change_what_does_not_change_training_and_the_rerun_is_unchanged(
        copy, run_smoke, caplog):
    # Before: the extended run kept the first run's settings in its checkpoint, so the same
    # command again was refused as a "finished run ... with other settings".
    params = [*PARAMS, "NUM_STEPS = 4", "tfdp.EvaluationConfig.eval_batch_size = 50"]
    report = run_smoke(copy, ["fashion_mnist.gin"], params)
    assert report["steps"] == 4
    assert re.search(r"Resuming .* at step 2 with changed settings that change neither the "
                     r"model nor its metrics.*\n.*- \S*eval_batch_size = 100\n.*\+ "
                     r"\S*eval_batch_size = 50", caplog.text)
    caplog.clear()
    before = _tree(copy)
    with caplog.at_level(logging.INFO, logger="absl"):
        assert run_smoke(copy, ["fashion_mnist.gin"], params) == report
    assert "its report and export are unchanged" in caplog.text
    assert _tree(copy) == before


def test_settings_are_compared_as_values_not_as_text():
    from tfdp import resume_rule  # pylint: disable=g-import-not-at-top

    saved = ("LR = 4.0\nbuild_optimizer.learning_rate = %LR\n"
             "tfdp.OptimizationConfig.num_steps = 6\n")
    # The same value through another name and no macro: no change at all.
    assert resume_rule.changed_settings(
        saved, "tfdp.training.build_optimizer.learning_rate = 4.0\n"
               "tfdp.OptimizationConfig.num_steps = 6\n") == []
    # A macro's new value is a change of the binding that uses it.
    changes = resume_rule.changed_settings(saved, saved.replace("LR = 4.0", "LR = 0.5"))
    assert [(c.name, c.before, c.after, c.resumable) for c in changes] == [
        ("tfdp.training.build_optimizer.learning_rate", "4.0", "0.5", False)]
    # Binding an argument to its default is no change; more steps are resumable.
    changes = resume_rule.changed_settings(
        saved, saved.replace("= 6", "= 8") + "tfdp.OptimizationConfig.ema_decay = None\n")
    assert [(c.name, c.resumable) for c in changes] == [
        ("tfdp.OptimizationConfig.num_steps", True)]


@pytest.mark.parametrize("now, same", [
    ("4", True), ("4.00", True), ("4e0", True),  # before: 4 against 4.0 was a change
    ("4.000001", False), ("True", False), ("'4.0'", False), ("(4.0,)", False)])
def test_a_number_is_compared_by_value_whatever_its_spelling(now, same):
    from tfdp import resume_rule  # pylint: disable=g-import-not-at-top

    saved = "tfdp.training.build_optimizer.learning_rate = 4.0\n"
    changes = resume_rule.changed_settings(saved, saved.replace("4.0", now))
    assert (changes == []) == same, changes


@pytest.mark.parametrize("a, b, same", [
    (4, 4.0, True), (float("nan"), float("nan"), True), (True, 1, False), (0, False, False),
    ((1, 2.0), (1.0, 2), True), ((1, 2), [1, 2], False), ({"a": 1}, {"a": 1.0}, True),
    ({"a": 1}, {"b": 1}, False), ("x", "x", True), (None, None, True), (None, 0, False)])
def test_same_value_is_numeric_equality_inside_containers_and_nothing_looser(a, b, same):
    from tfdp import resume_rule  # pylint: disable=g-import-not-at-top

    assert resume_rule.same_value(a, b) is same and resume_rule.same_value(b, a) is same


def test_a_finished_run_is_returned_when_its_learning_rate_is_spelt_as_an_int(
        copy, finished, run_smoke):
    # fashion_mnist.gin says 4.0. Before: "finished run of 2 steps with other settings".
    before = _snapshot(copy)
    report = run_smoke(copy, ["fashion_mnist.gin"],
                       [*PARAMS, "tfdp.training.build_optimizer.learning_rate = 4"])
    assert report == json.loads(json.dumps(finished[1]))
    assert _snapshot(copy) == before


# -- "Unchanged" only after checking what FINISHED vouches for ----------


@pytest.fixture(scope="module")
def other_finished(tmp_path_factory, run_smoke_module):
    """Another finished 2-step run, at another noise multiplier (another epsilon)."""
    workdir = tmp_path_factory.mktemp("other")
    report = run_smoke_module(workdir, ["fashion_mnist.gin"],
                              ["TARGET_EPSILON = None", "NOISE_MULTIPLIER = 2.0"])
    return workdir, report


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("swap, named", [
    # Before: "already holds this finished run ... its report and export are unchanged".
    ("export", "export/"),
    ("privacy_report.json", "privacy_report.json"),
    ("flip:export/variables/variables.data-00000-of-00001",
     "export/variables/variables.data-00000-of-00001: same size, other contents"),
    ("flip:export/saved_model.pb", "export/saved_model.pb: same size, other contents"),
    # FINISHED lists every file under export/, so these are not "unchanged".
    ("flip:export/fingerprint.pb", "export/fingerprint.pb: same size, other contents"),
    ("plant:export/assets/labels.txt", "export/assets/labels.txt: not there when FINISHED"),
    ("plant:export/extra/notes.md", "export/extra/notes.md: not there when FINISHED"),
    ("link:export/assets/more", "export/assets/more: not there when FINISHED"),
])
def test_a_finished_workdir_with_changed_files_is_named_not_called_unchanged(
        copy, other_finished, finished, run_smoke, swap, named, caplog):
    assert other_finished[1]["epsilon"] != finished[1]["epsilon"]
    if swap.startswith("flip:"):
        _flip_a_byte(copy / swap[len("flip:"):])
    elif swap.startswith("link:"):  # a symbolic link to a folder elsewhere
        (copy.parent / "elsewhere").mkdir(exist_ok=True)
        (copy.parent / "elsewhere" / "x.txt").write_text("planted\n")
        os.symlink(copy.parent / "elsewhere", copy / swap[len("link:"):])
    elif swap.startswith("plant:"):
        planted = copy / swap[len("plant:"):]
        planted.parent.mkdir(exist_ok=True)
        planted.write_text("planted\n")
    elif (copy / swap).is_dir():
        shutil.rmtree(copy / swap)
        shutil.copytree(other_finished[0] / swap, copy / swap)
    else:
        shutil.copy(other_finished[0] / swap, copy / swap)
    before = _tree(copy)
    with pytest.raises(ValueError) as error:
        run_smoke(copy, ["fashion_mnist.gin"], PARAMS)
    message = str(error.value)
    assert re.search(r"is finished \(FINISHED, 2 steps\), but files it vouches for changed "
                     r"since it was written:\n  ", message), message
    assert named in message, message
    assert "not called unchanged; nothing was changed" in message
    assert "unchanged" not in caplog.text.replace("not called unchanged", "")
    assert _tree(copy) == before


def test_finished_records_a_digest_of_every_file_it_vouches_for(finished):
    from tfdp import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

    record = json.loads((finished[0] / "FINISHED").read_text())
    names = set(record["digests"])
    assert {"privacy_report.json", "privacy_report.md", "export/saved_model.pb",
            "export/variables/variables.index", "export/assets/privacy_report.json",
            "export/assets/privacy_report.md"} <= names
    assert any(name.startswith("export/variables/variables.data-") for name in names)
    # The whole export, every file under it: fingerprint.pb too.
    export = finished[0] / "export"
    assert {f"export/{path.relative_to(export)}" for path in export.rglob("*")
            if path.is_file()} <= names
    assert "export" in record["files"]
    for name, digest in record["digests"].items():
        assert digest == workdir_lib.file_digest(finished[0] / name), name
    assert workdir_lib.changed_since_finished(str(finished[0]), record) == []


@pytest.mark.parametrize("garbage", [b"garbage\n", b"\x00\xffnot a checkpoint state{{", b""])
def test_an_unreadable_checkpoint_state_is_named_with_the_fix(copy, run_smoke, garbage):
    # Before: "holds outputs of an earlier run ... but no checkpoint that resumes it".
    (copy / "checkpoints" / "checkpoint").write_bytes(garbage)
    before = _tree(copy)
    with pytest.raises(ValueError) as error:
        run_smoke(copy, ["fashion_mnist.gin"], PARAMS)
    message = str(error.value)
    assert re.search(r"The checkpoint state \S*checkpoints/checkpoint cannot be read: it is "
                     r"not the text TensorFlow writes there", message), message
    assert "holds the checkpoints ckpt-0, ckpt-2. To resume from the newest" in message
    assert _tree(copy) == before
    # Doing as told: the finished run is found again, unchanged.
    (copy / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-2"\n')
    assert run_smoke(copy, ["fashion_mnist.gin"], PARAMS)["steps"] == 2


def test_a_file_size_limit_at_the_first_checkpoint_is_a_failed_write_like_a_full_disk(
        tmp_path, run_smoke, monkeypatch):
    # Before: a raw "OutOfRangeError ... File too large [Op:SaveV2]" traceback, and
    # checkpoints/ckpt-0_temp/ left behind.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    _fail_checkpoint_saves(monkeypatch, lambda partial: tf.errors.OutOfRangeError(
        None, None, f"{partial}/part-00000-of-00001.data-00000-of-00001.tempstate1; File "
        "too large [Op:SaveV2]"))
    workdir = tmp_path / "wd"
    with pytest.raises(ValueError, match=r"failed write or read in .*OutOfRangeError: .*File "
                                         r"too large \[Op:SaveV2\]\. No checkpoint was kept; "
                                         r"fix the cause \(.*ulimit -f"):
        run_smoke(workdir, ["fashion_mnist.gin"], PARAMS)
    assert not workdir.exists()  # created by the run, and nothing of it stays


_LIMITED = r'''
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from tfdp import data
with data.mock_data(num_examples=64):
    from tfdp import main
    sys.argv = ["tfdp.main"] + sys.argv[1:]
    main.run()
'''


@pytest.mark.slow  # a whole CLI start; the monkeypatched test above runs by default
def test_a_real_file_size_limit_stops_the_cli_cleanly(tmp_path):
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top

    wrapper = tmp_path / "limited.py"
    wrapper.write_text(_LIMITED)
    workdir = tmp_path / "wd"
    proc = subprocess.run(
        [sys.executable, str(wrapper), "50000", f"--workdir={workdir}",
         "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
         *[f"--gin_param={p}" for p in (*PARAMS, "NUM_EXAMPLES = 64", "BATCH_SIZE = 16")]],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"tfdp: error: The run stopped on a failed write or read in .*File too "
                     r"large", proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not workdir.exists() or not list((workdir / "checkpoints").glob("*_temp"))


def test_a_run_whose_workdir_is_moved_stops_before_its_next_write(tmp_path, run_smoke,
                                                                   monkeypatch):
    # While the run trains, its workdir is moved aside and a new folder takes the path (a
    # second run's): the first run must write nothing into the new folder.
    from tfdp import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    from tfdp.training import callbacks  # pylint: disable=g-import-not-at-top

    wd, moved = tmp_path / "wd", tmp_path / "wd.old"
    original = callbacks.ProgressLog.on_train_batch_end

    def move_at_step_1(self, batch, logs=None):
        original(self, batch, logs)
        if not moved.exists():
            os.rename(wd, moved)
            wd.mkdir()

    monkeypatch.setattr(callbacks.ProgressLog, "on_train_batch_end", move_at_step_1)
    with pytest.raises(workdir_lib.WorkdirError, match="no longer names the folder"):
        run_smoke(wd, ["fashion_mnist.gin"])
    assert os.listdir(wd) == []  # nothing of the first run in the new folder
    assert (moved / "checkpoints").is_dir()  # its checkpoint 0, where it was moved


@pytest.mark.slow
def test_a_workdir_named_like_a_glob_pattern_trains_resumes_and_extends(tmp_path, run_smoke):
    # `sweep[lr=0.5]`: TensorFlow read the checkpoint prefix as a glob pattern, called the
    # checkpoint corrupt and refused to resume ("Use a new workdir").
    wd = tmp_path / "sweep[lr=0.5] {a,b}*?"
    fixed = ["TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0"]
    run_smoke(wd, ["fashion_mnist.gin"], fixed)
    report = run_smoke(wd, ["fashion_mnist.gin"], fixed + ["NUM_STEPS = 3"])
    assert report["steps"] == 3
    state = (wd / "checkpoints" / "checkpoint").read_text()
    assert 'model_checkpoint_path: "ckpt-3"' in state  # relative: no descriptor path kept


def test_tf_paths_go_through_the_held_folder(tmp_path):
    from tfdp import storage  # pylint: disable=g-import-not-at-top
    from tfdp import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

    wd = tmp_path / "a[b]"
    plain = tmp_path / "plain" / "checkpoints"
    assert storage.tf_path(str(plain)) == str(plain)
    assert storage.tf_path(str(wd / "checkpoints")) == str(wd / "checkpoints")  # not held
    with workdir_lib.locked(str(wd)):
        aliased = storage.tf_path(str(wd / "checkpoints" / "ckpt-1"))
        assert aliased.startswith("/proc/self/fd/") and aliased.endswith("/checkpoints/ckpt-1")
        (wd / "probe").write_text("x")
        folder = os.path.dirname(os.path.dirname(aliased))  # /proc/self/fd/N: the held folder
        assert open(os.path.join(folder, "probe")).read() == "x"
    assert storage.tf_path(str(wd / "checkpoints")) == str(wd / "checkpoints")
