"""Real processes in one workdir (`python -m tfdp.main`): the lock, and a kill while exporting.

Two runs side by side on TFDS mock data, 2 steps each:

* A pauses after step 1; a second run B in the same workdir is refused
  (exit 2) and names A's pid; A is SIGKILLed, and the same command resumes
  and finishes (the kernel dropped the lock with A).
* E pauses inside the SavedModel write (the export's files are on disk, not
  yet renamed into place) and is SIGKILLed: the workdir must not look
  finished, and the same command again writes the export, the report and
  FINISHED without training again.
"""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tfdp import workdir as workdir_lib

_WRAPPER = r'''
import os, sys, time
pause = os.environ.get("TFDP_TEST_PAUSE")

def wait():
    open(os.environ["TFDP_TEST_PAUSED_FILE"], "w").close()
    time.sleep(600)

if pause == "step":  # right after step 1
    from tfdp.training import callbacks
    original = callbacks.ProgressLog.on_train_batch_end
    def on_train_batch_end(self, batch, logs=None):
        original(self, batch, logs)
        wait()
    callbacks.ProgressLog.on_train_batch_end = on_train_batch_end
elif pause == "export":  # the SavedModel written to its temporary folder
    import keras
    archive_class = type(keras.export.ExportArchive())
    original_write_out = archive_class.write_out
    def write_out(self, filepath, **kwargs):
        original_write_out(self, filepath, **kwargs)
        wait()
    archive_class.write_out = write_out
from tfdp import data
with data.mock_data(num_examples=64):
    from tfdp import main
    sys.argv = ["tfdp.main"] + sys.argv[1:]
    main.run()
'''

_PARAMS = ["NUM_EXAMPLES = 64", "BATCH_SIZE = 16", "TARGET_EPSILON = None",
           "NOISE_MULTIPLIER = 1.0"]


def _start(wrapper, workdir, **env):
    command = [sys.executable, str(wrapper), f"--workdir={workdir}",
               "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
               *[f"--gin_param={p}" for p in _PARAMS]]
    return subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(proc, paused):
    deadline = time.time() + 300
    while not paused.exists():
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.time() < deadline, "the run never reached its pause"
        time.sleep(0.2)


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _finish(proc):
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]


def _listing(workdir):
    return sorted(os.path.relpath(os.path.join(root, name), workdir)
                  for root, dirs, files in os.walk(workdir) for name in dirs + files)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    wrapper = root / "run_tfdp.py"
    wrapper.write_text(_WRAPPER)
    holder = _start(wrapper, root / "a", TFDP_TEST_PAUSE="step",
                    TFDP_TEST_PAUSED_FILE=str(root / "paused_a"))
    exporting = _start(wrapper, root / "e", TFDP_TEST_PAUSE="export",
                       TFDP_TEST_PAUSED_FILE=str(root / "paused_e"))
    result = {"holder_pid": holder.pid}
    _wait_for(holder, root / "paused_a")
    listing = _listing(root / "a")
    second = _start(wrapper, root / "a")
    result["second"] = (second.communicate(timeout=600), second.returncode)
    result["unchanged_by_second"] = _listing(root / "a") == listing
    # An editor saves the lock file again (a new file renamed over it): still one run.
    edited = root / "a" / ".tfdp.lock.swp"
    edited.write_text((root / "a" / ".tfdp.lock").read_text())
    os.replace(edited, root / "a" / ".tfdp.lock")
    third = _start(wrapper, root / "a")
    result["third"] = (third.communicate(timeout=600), third.returncode)
    _kill(holder)
    resumed = _start(wrapper, root / "a")
    _wait_for(exporting, root / "paused_e")
    _kill(exporting)
    result["killed_in_export"] = _listing(root / "e")
    finishing = _start(wrapper, root / "e")
    _finish(resumed)
    _finish(finishing)
    return root, result


@pytest.mark.slow  # real processes (tests/run_slow.sh); the unit tests below run by default
def test_a_second_run_in_a_locked_workdir_exits_2_and_names_the_holder(runs):
    # Before: both runs trained and exported, and metrics.jsonl mixed them.
    root, result = runs
    (_, stderr), returncode = result["second"]
    assert returncode == 2, stderr[-4000:]
    assert (f"is in use by another run (pid {result['holder_pid']} on {socket.gethostname()}"
            in stderr), stderr[-2000:]
    assert "Traceback" not in stderr
    assert result["unchanged_by_second"]


@pytest.mark.slow  # real processes (tests/run_slow.sh); the unit tests below run by default
def test_a_run_after_the_lock_file_was_saved_again_is_refused_too(runs):
    # Before: flock locked the old file's inode, so the third run locked the new file, and
    # both trained steps 2.. and exported into one workdir.
    _, result = runs
    (_, stderr), returncode = result["third"]
    assert returncode == 2, stderr[-4000:]
    assert "is in use by another run" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("how", ["saved_again", "deleted", "moved_away"])
def test_replacing_or_deleting_the_lock_file_keeps_the_lock(tmp_path, how):
    workdir = tmp_path / "wd"
    lock = workdir / ".tfdp.lock"
    with workdir_lib.locked(workdir):
        if how == "saved_again":  # vim, sed -i, IDEs: a new file renamed over the old
            (workdir / "x.tmp").write_text('{"edited": true}')
            os.replace(workdir / "x.tmp", lock)
        elif how == "deleted":
            lock.unlink()
        else:
            os.replace(lock, tmp_path / "elsewhere")
        with pytest.raises(workdir_lib.WorkdirLockedError, match="in use by another run"):
            with workdir_lib.locked(workdir):
                raise AssertionError("a second run got the lock")
        if how == "saved_again":
            assert lock.read_text() == '{"edited": true}'  # not this run's file: kept
    with workdir_lib.locked(workdir):  # released when the holder ends
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_the_lock_file_is_locked_too_for_network_file_systems_and_older_runs(
        tmp_path, monkeypatch):
    # On NFS a folder's flock is local to one host; the file's lock is what the server sees.
    import fcntl  # pylint: disable=g-import-not-at-top

    workdir = tmp_path / "wd"
    workdir.mkdir()
    with open(workdir / ".tfdp.lock", "w") as older:  # a run holding only the file's lock
        fcntl.flock(older, fcntl.LOCK_EX)
        with pytest.raises(workdir_lib.WorkdirLockedError, match="in use by another run"):
            with workdir_lib.locked(workdir):
                raise AssertionError("got the lock beside a holder of the lock file")
    real_flock = fcntl.flock

    def no_folder_locks(fd, operation):  # a file system that cannot flock a folder
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, operation)

    monkeypatch.setattr(workdir_lib.fcntl, "flock", no_folder_locks)
    with workdir_lib.locked(workdir):
        with pytest.raises(workdir_lib.WorkdirLockedError, match="in use by another run"):
            with workdir_lib.locked(workdir):
                raise AssertionError("a second run got the lock")
    with workdir_lib.locked(workdir):
        pass


def test_tf_paths_of_a_glob_named_workdir_without_folder_locks(tmp_path, monkeypatch):
    # Where a folder cannot be flocked (NFS), TensorFlow still gets a path it does not glob.
    import fcntl  # pylint: disable=g-import-not-at-top

    from tfdp import storage  # pylint: disable=g-import-not-at-top

    real_flock = fcntl.flock

    def no_folder_locks(fd, operation):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, operation)

    monkeypatch.setattr(workdir_lib.fcntl, "flock", no_folder_locks)
    workdir = tmp_path / "sweep[lr=0.5]"
    with workdir_lib.locked(workdir):
        checkpoints = storage.tf_path(str(workdir / "checkpoints"))
        assert checkpoints.startswith("/proc/self/fd/")
        os.makedirs(checkpoints)
        assert (workdir / "checkpoints").is_dir()
    assert storage.tf_path(str(workdir / "checkpoints")) == str(workdir / "checkpoints")


def test_the_lock_holds_across_processes(tmp_path):
    workdir = tmp_path / "wd"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom tfdp import workdir\n"
         "with workdir.locked(sys.argv[1]):\n    print('held', flush=True)\n"
         "    time.sleep(60)", str(workdir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.replace(workdir / ".tfdp.lock", tmp_path / "gone")
        with pytest.raises(workdir_lib.WorkdirLockedError,
                           match=r"is in use by another run \(a process whose .tfdp.lock is "
                                 r"not yet written, or was replaced or deleted since\)"):
            with workdir_lib.locked(workdir):
                pass
    finally:
        holder.kill()
        holder.wait()
    with workdir_lib.locked(workdir):  # the kernel dropped the killed holder's lock
        pass


@pytest.mark.slow  # real processes (tests/run_slow.sh); the unit tests below run by default
def test_a_killed_holder_leaves_no_lock_and_the_same_command_resumes(runs):
    root, _ = runs
    report = json.loads((root / "a" / "privacy_report.json").read_text())
    assert report["steps"] == 2
    assert json.loads((root / "a" / "FINISHED").read_text())["steps"] == 2
    assert not (root / "a" / ".tfdp.lock").exists()
    steps = [json.loads(line)["step"]
             for line in (root / "a" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2]  # one run, not two mixed


@pytest.mark.slow  # real processes (tests/run_slow.sh); the unit tests below run by default
def test_a_kill_while_exporting_leaves_an_unfinished_workdir_that_the_rerun_finishes(runs):
    # Before: the report was written before the SavedModel, so the killed workdir had
    # privacy_report.json without export/, and every rerun said "unchanged".
    root, result = runs
    killed = result["killed_in_export"]
    assert "FINISHED" not in killed and "privacy_report.json" not in killed
    assert "export" not in killed
    assert "checkpoints/ckpt-2.index" in killed
    assert any(name.startswith(".export.tmp-") for name in killed)  # the unfinished write
    workdir = root / "e"
    assert (workdir / "export" / "saved_model.pb").exists()
    assert json.loads((workdir / "FINISHED").read_text())["steps"] == 2
    assert json.loads((workdir / "privacy_report.json").read_text())["steps"] == 2
    assert not [name for name in os.listdir(workdir) if ".tmp-" in name or ".old-" in name]
    steps = [json.loads(line)["step"] for line in
             (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2]  # not trained again


def test_a_moved_workdir_stops_the_run_that_held_it(tmp_path):
    # `mv wd wd.old` while run A trained, then run B started in a new `wd`: A kept writing
    # into B's folder by path, and metrics.jsonl had every step twice.
    wd = tmp_path / "wd"
    with workdir_lib.locked(str(wd)):
        workdir_lib.check_held(str(wd))
        os.rename(wd, tmp_path / "wd.old")
        with pytest.raises(workdir_lib.WorkdirError, match="no longer names the folder"):
            workdir_lib.check_held(str(wd))
        with workdir_lib.locked(str(wd)):  # a second run takes the path: a folder of its own
            workdir_lib.check_held(str(wd))
    workdir_lib.check_held(str(wd))  # released: nothing held, nothing checked


def test_the_lock_file_never_writes_through_a_link(tmp_path):
    user_file = tmp_path / "notes.txt"
    user_file.write_text("mine")
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / workdir_lib.LOCK_FILE).symlink_to(user_file)
    with pytest.raises(workdir_lib.WorkdirError, match="symbolic link"):
        with workdir_lib.locked(str(wd)):
            pass
    assert user_file.read_text() == "mine"


def test_the_root_is_no_workdir():
    with pytest.raises(workdir_lib.WorkdirError, match="file system's root"):
        workdir_lib.check_lockable("/")
    with pytest.raises(workdir_lib.WorkdirError, match="file system's root"):
        workdir_lib.check_lockable("/tmp/..")
