"""One workdir, one run: the lock, the refusal of a used workdir, checkpoint checks, FINISHED.

The trainer (`tfdp.experiment.train_and_evaluate`) keeps four promises about
its workdir, and this module holds the code of each:

1. **One run at a time** (`locked`): the chief holds an exclusive
   `fcntl.flock` on the workdir folder itself for the whole run. A second
   run in the same workdir is refused (exit 2) with the holder's pid, host
   and start time, which the holder writes into `WORKDIR/.tfdp.lock` and
   also flocks (network file systems lock a file across hosts, a folder
   only on one). On one machine the folder's lock holds even when an editor
   saves the file again (a new file renamed over it) or `rm` removes it.
   The kernel drops the locks when their process dies, even on SIGKILL, so
   a rerun after a kill resumes.
   On an object store (a gs:// workdir) the lock is a lease object
   (`tfdp.lease`): created only if absent, renewed while the run lives,
   taken over only once it has expired.
2. **No second run in a used workdir** (`earlier_run_outputs`): a workdir
   with outputs of an earlier run (metrics, report, export, TensorBoard
   events, checkpoint files) but no checkpoint that resumes it is refused:
   training again would train a second model on the same data with fresh
   seeds, while the report would count one run.
3. **Corrupt checkpoints are named** (`resume_checkpoint`): the checkpoint
   to resume is read in full before anything is built or written; a
   truncated `.index` or `.data` file is named, with what to do.
4. **Finished is one atomic fact** (`write_finished`, `finished`): the file
   `FINISHED` is written whole (to a temporary name, then renamed; on an
   object store, as one object) only after the SavedModel and the report are
   complete and read back. A workdir without it is not finished, whatever
   else it holds; a rerun whose checkpoint has every step but no FINISHED
   writes the export and the report again.

The workdir is a local (or mounted) folder, or a gs:// URL (ram:// in the
tests). Every file operation goes through `tfdp.storage`, which keeps the
POSIX operations on local paths and uses `tf.io.gfile` on URLs. Pure Python
on a local workdir except `resume_checkpoint` (which reads checkpoints with
TensorFlow, imported there), so the CLI can check the lock cheaply.
"""

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import socket

import filelock

from tfdp import lease as lease_lib
from tfdp import storage

LOCK_FILE = ".tfdp.lock"
FINISHED_FILE = "FINISHED"
CHECKPOINT_DIR = "checkpoints"
# Outputs only a run writes; any of them without a resumable checkpoint marks a used workdir.
# (data_normalization.json is not one: it is written before the first checkpoint, and a
# run killed in between reuses it rather than releasing the statistics again.)
RUN_OUTPUTS = ("metrics.jsonl", "privacy_report.json", "privacy_report.md", "export",
               "tensorboard", "operative_config.gin", FINISHED_FILE,
               "NOT_PRIVATE.json", "NOT_PRIVATE.md")  # the last two: a privacy=None run


class WorkdirError(ValueError):
    """A workdir that this run cannot use, or a run stopped by a failed write.

    A ValueError, as every error tfdp reports to the user: the CLI prints its
    message, without a traceback, and exits 2.
    """


class WorkdirLockedError(WorkdirError):
    """Another process holds the workdir's lock."""


_held = {}  # absolute path of a workdir this process holds -> (st_dev, st_ino) of its folder


def check_held(workdir):
    """Raises if this process no longer holds `workdir`: the run must stop before writing.

    A run writes by path: if its workdir was moved aside (`mv wd wd.old`),
    replaced or removed while it ran, a second run may already hold a new
    folder at the same path, and both would write into it. On an object
    store, another run may have taken the workdir's lease over (`tfdp.lease`:
    its renewal thread then sets the lease's `lost_event`). So the trainer
    checks this at every training step, at every evaluation batch and before
    each of its writes (the callbacks' writes, the export, FINISHED) and
    stops instead. A no-op for a path this process does not hold.

    Args:
      workdir: the workdir (a local path or a URL).

    Raises:
      WorkdirLockedError: the workdir is a URL whose lease this run has lost.
      WorkdirError: the local path names another folder, or none.
    """
    workdir = os.fspath(workdir)
    if storage.is_url(workdir):
        storage.check_writable(workdir)  # the lease's guard (`_leased`)
        return
    held = _held.get(os.path.abspath(workdir))
    if held is None:
        return
    try:
        here = os.stat(workdir)
        same = (here.st_dev, here.st_ino) == held
    except OSError:
        same = False
    if not same:
        raise WorkdirError(
            f"The workdir {workdir} no longer names the folder this run locked: it was moved, "
            "replaced or removed while the run trained. The run stops before writing "
            "anything more, so that two runs never write into one folder. Its checkpoints "
            "are in the folder where it was moved (if it was): move it back and run the same "
            "command to resume.")


def check_lockable(workdir):
    """Refuses a workdir that tfdp cannot lock: a URL of an unsupported store, or no client.

    A local (or mounted) folder is locked with `fcntl.flock`; gs:// (and
    ram://, in the tests) with a lease object (`tfdp.lease`). Running without
    a lock would let two runs mix their outputs, so any other scheme (s3://,
    hdfs://, ...) is refused before anything is written, and so is gs://
    without its client library.

    Raises:
      WorkdirError: for the file system's root; for a URL whose scheme has no
        lease store, or whose store cannot be opened (the message says what
        to install).
    """
    if not storage.is_url(workdir):
        if os.path.realpath(workdir) == os.path.realpath(os.sep):
            raise WorkdirError(
                f"--workdir={workdir} is the file system's root: a run writes checkpoints/, "
                "export/ and FINISHED into its workdir. Give it a folder of its own "
                "(e.g. --workdir=workdirs/NAME).")
        return
    if storage.scheme(workdir) not in lease_lib.STORES:
        raise WorkdirError(
            f"--workdir={workdir} is a {storage.scheme(workdir)}:// URL; tfdp locks its workdir "
            "(one run at a time) with fcntl on a local or mounted folder, and with a lease "
            f"object on {', '.join(s + '://' for s in sorted(lease_lib.STORES))} only. Use a "
            "gs:// or local workdir, or mount the bucket (e.g. with gcsfuse).")
    try:
        lease_lib.store_for(workdir)
    except ValueError as e:
        raise WorkdirError(str(e)) from None


@contextlib.contextmanager
def locked(workdir, *, lease_seconds=lease_lib.LEASE_SECONDS,
           renew_every_seconds=lease_lib.RENEW_EVERY_SECONDS):
    """Holds an exclusive lock on `workdir` for the block; creates the workdir.

    A local workdir is locked with `fcntl.flock` on the folder (an open file
    description of the directory), so replacing or deleting any file in it
    does not release the lock, and with a `filelock.FileLock` of the file
    `.tfdp.lock`, which holds the holder's pid, host and start time, and
    which network file systems lock across hosts (`_acquire`). The file is deleted when the block ends,
    unless something else replaced it. If the block fails and
    the workdir was created here and holds nothing else, the workdir is
    removed again, so that a refused run leaves nothing behind. On a URL the
    lock is a lease object of the same name (`tfdp.lease`; `lease_seconds`
    and `renew_every_seconds` are its lifetime and renewal period).

    Raises:
      WorkdirLockedError: another process holds the lock; the message names it.
        Also raised when this run loses its lease: from inside the block by
        `check_held` (at the run's next step or write), else as the block ends.
      WorkdirError: the workdir cannot be created or written (read-only, full,
        a file in the way, no permission), or is a URL tfdp cannot lock.
    """
    workdir = os.fspath(workdir)
    if storage.is_url(workdir):
        with _leased(workdir, lease_seconds, renew_every_seconds):
            yield workdir
        return
    created = not os.path.isdir(workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
        folder_fd, file_lock, file_inode = _acquire(workdir)
    except WorkdirLockedError:
        raise
    except OSError as e:
        raise WorkdirError(
            f"Cannot write into the workdir {workdir}: {e.strerror or e} "
            f"({type(e).__name__}). Choose a writable workdir (--workdir), or free space "
            "on its disk.") from None
    path = os.path.join(workdir, LOCK_FILE)
    mine = os.fstat(folder_fd) if folder_fd is not None else os.stat(workdir)
    key = os.path.abspath(workdir)
    _held[key] = (mine.st_dev, mine.st_ino)
    try:
        # TensorFlow's checkpoints (`storage.tf_path`): through the locked folder's descriptor,
        # or one of its own where no folder lock was taken (NFS).
        with storage.folder_aliased(workdir, folder_fd):
            yield workdir
    finally:
        _held.pop(key, None)
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == file_inode:  # not a file put in its place
                os.unlink(path)  # while still holding it: see _lock_file
        if created:
            with contextlib.suppress(OSError):
                if (os.stat(workdir).st_dev, os.stat(workdir).st_ino) == (mine.st_dev,
                                                                          mine.st_ino):
                    os.rmdir(workdir)  # ours, and empty; before unlocking (see _acquire)
        file_lock.release()
        if folder_fd is not None:
            os.close(folder_fd)


@contextlib.contextmanager
def _leased(workdir, lease_seconds, renew_every_seconds):
    """`locked` on an object store: the lease object WORKDIR/.tfdp.lock (`tfdp.lease`)."""
    check_lockable(workdir)
    created = not storage.isdir(workdir)
    lease = lease_lib.Lease(storage.join(workdir, LOCK_FILE), lease_lib.store_for(workdir),
                            lease_seconds=lease_seconds,
                            renew_every_seconds=renew_every_seconds)
    try:
        storage.makedirs(workdir)
        lease.acquire()
    except lease_lib.LeaseHeldError as e:
        raise WorkdirLockedError(
            f"The workdir {workdir} is in use by another run ({e.holder}). One workdir holds "
            "one run: wait for that run to end, or use another workdir. (A killed run's "
            f"lease is taken over {lease_lib.CLOCK_SKEW_SECONDS:g} s after it has expired.)"
            ) from None
    except Exception as e:  # pylint: disable=broad-except  (gfile and client errors)
        raise WorkdirError(
            f"Cannot write into the workdir {workdir}: {_first_line(e)} "
            f"({type(e).__name__}). Check the URL and your write access to it.") from None
    def guard():
        if lease.lost:
            raise _lost_lease(workdir)  # the message of `locked`, word for word

    try:
        # Every write under the workdir through tfdp.storage checks the lease first, and so
        # does `check_held`: one check.
        with storage.writes_guarded(workdir, guard):
            yield
    except KeyboardInterrupt:
        _release(lease, workdir, created)
        if lease.lost:
            raise _lost_lease(workdir) from None
        raise
    except BaseException:
        _release(lease, workdir, created)
        raise
    _release(lease, workdir, created)
    if lease.lost:  # lost after the block's last check: its writes may be mixed with another's
        raise _lost_lease(workdir)


def _lost_lease(workdir):
    return WorkdirLockedError(
        f"This run lost its lease on the workdir {workdir} (another run took it over after it "
        "expired, or it could not be renewed) and stopped, so that two runs never write one "
        "workdir. Run the same command again once the other run has ended; it resumes from "
        "the last checkpoint.")


def _release(lease, workdir, created):
    """Releases `lease`; removes the workdir if this run created it and it is empty."""
    lease.release()
    if created:
        storage.rmdir_if_empty(workdir)


def _acquire(workdir):
    """Locks the workdir twice: its folder (an flock), and the file `.tfdp.lock` (a FileLock).

    * The folder's lock (an open file description of the directory) holds
      whatever happens to the files in it: an editor that saves `.tfdp.lock`
      again (a new file renamed over it) or an `rm` of it does not release it.
      After locking, the path must still name the locked folder (a run that
      removed the folder it created, or a workdir moved aside, is retried).
      `filelock` cannot take it: it opens a file for writing, never a folder.
    * The file's lock (`filelock.FileLock`, an flock of `.tfdp.lock`) is the
      one NFS (and other network file systems) pass to the server, so it
      holds across hosts: a folder's flock there is local to one machine. It
      also excludes runs of an older tfdp, which locked only the file.

    Both are dropped by the kernel when the process dies, even on SIGKILL.

    Returns:
      `(folder_fd, file_lock, file_inode)`: folder_fd None where the file
      system cannot flock a folder; file_lock the held `filelock.FileLock`
      and the inode number of the file it locked.

    Raises:
      WorkdirLockedError: another run holds either lock; the message names
        the holder from its `.tfdp.lock`.
      OSError: the folder or the file cannot be opened or written.
    """
    while True:
        folder_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(folder_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(folder_fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _in_use(workdir) from None
            folder_fd = None  # no flock of a folder here: the file's lock alone
            break
        try:
            here = os.stat(workdir)
        except FileNotFoundError:
            here = None
        mine = os.fstat(folder_fd)
        if here is not None and (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(folder_fd)  # the folder was removed or replaced meanwhile: lock the new one
        os.makedirs(workdir, exist_ok=True)
    try:
        return (folder_fd, *_lock_file(os.path.join(workdir, LOCK_FILE), workdir))
    except BaseException:
        if folder_fd is not None:
            os.close(folder_fd)
        raise


def _lock_file(path, workdir):
    """Takes `path`'s FileLock (0.1 s of retries at most); writes the holder into the file.

    `filelock` opens the file without following a link and without
    truncating it (the holder's record stays readable for the refusal), and
    takes no lock on a file that was deleted meanwhile (a holder deletes it
    before it unlocks: `locked`). Where the file system has no flock at all,
    it raises instead of falling back to a marker file, which a killed run
    would leave behind.

    Returns:
      `(lock, inode)`: the held `filelock.FileLock`, and the inode number of
      the file it locked.

    Raises:
      WorkdirLockedError: another process holds the file's lock.
      WorkdirError: `path` is a symbolic link.
      OSError: the file cannot be opened or written, or has no flock.
    """
    written = []

    def write_holder(fd):
        written.append(os.fstat(fd).st_ino)
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().astimezone().isoformat(
                      timespec="seconds")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        os.fsync(fd)

    # thread_local=False: the run may end (release) on another thread than it began. A
    # tenth of a second of retries: a file its holder deleted and unlocked just as this
    # process locked it is tried again (at the path's new file), not called in use.
    lock = filelock.FileLock(path, timeout=0.1, poll_interval=0.02, thread_local=False,
                             fallback_to_soft=False, on_acquired=write_holder)
    try:
        lock.acquire()
    except filelock.Timeout:  # an OSError: caught first
        raise _in_use(workdir) from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise WorkdirError(
            f"{path} is a symbolic link: tfdp writes its lock only into a file of its "
            "own, never through a link into another file. Remove the link (the file it "
            "points to is untouched), or use another workdir.") from None
    return lock, written[-1]


def _in_use(workdir):
    return WorkdirLockedError(
        f"The workdir {workdir} is in use by another run "
        f"({_holder(os.path.join(workdir, LOCK_FILE))}). One workdir holds one run: wait "
        "for that run to end, or use another workdir. (The lock is released when that "
        "process ends, even if it is killed.)")


def _holder(path):
    try:
        with open(path) as f:
            holder = json.load(f)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return (f"a process whose {LOCK_FILE} is not yet written, or was replaced or deleted "
                "since")


def earlier_run_outputs(workdir):
    """Outputs of an earlier run found in `workdir` (sorted names), ignoring its lock.

    Any of `RUN_OUTPUTS` (an empty `tensorboard/` or `export/` folder too) and
    any file in `checkpoints/` other than an interrupted save's `*_temp`
    folder.
    """
    if not storage.isdir(workdir):
        return []
    found = [name + ("/" if storage.isdir(storage.join(workdir, name)) else "")
             for name in RUN_OUTPUTS if storage.exists(storage.join(workdir, name))]
    checkpoints = storage.join(workdir, CHECKPOINT_DIR)
    if storage.isdir(checkpoints):
        found += [f"{CHECKPOINT_DIR}/{name}" for name in sorted(storage.listdir(checkpoints))
                  if not name.endswith("_temp")]
    return sorted(found)


def refuse_used_workdir(workdir, found):
    """Raises WorkdirError naming `found` (from `earlier_run_outputs`)."""
    hint = ""
    if any(name.startswith(f"{CHECKPOINT_DIR}/") for name in found):
        hint = (f" Its {CHECKPOINT_DIR}/ holds files but no checkpoint state to resume "
                f"({CHECKPOINT_DIR}/checkpoint names the latest one); if you moved it, put it "
                "back to resume that run.")
    raise WorkdirError(
        f"The workdir {workdir} holds outputs of an earlier run ({', '.join(found)}) but no "
        "checkpoint that resumes it. Training again here would train a second model on the "
        "same data with new secret seeds, while the report would count only one run. Use a "
        f"new workdir for a new run; nothing was changed.{hint}")


def checkpoint_files(prefix):
    """The files of the checkpoint `prefix` (e.g. `.../ckpt-4`): its .index and .data shards."""
    folder, name = prefix.rsplit("/", 1) if storage.is_url(prefix) else os.path.split(prefix)
    return sorted(storage.glob(folder, _escape(name) + ".index")
                  + storage.glob(folder, _escape(name) + ".data-*"))


def _escape(name):
    """A file name with glob's special characters escaped (glob.escape, for any path)."""
    return re.sub(r"([*?[])", r"[\1]", name)


def resume_checkpoint(checkpoint_dir):
    """The checkpoint to resume: the newest listed one whose files exist, read in full.

    The checkpoint state (`checkpoints/checkpoint`) lists the kept
    checkpoints. A listed checkpoint whose files are all gone (the user moved
    them aside, as a corrupt-checkpoint error suggests) is skipped, with a
    warning, for the next older one. The chosen checkpoint is read in full
    (its index and every tensor), so a truncated file is found here, before
    anything is built or written, and named.

    Why resuming from an older checkpoint is not an extra release: the
    checkpoint holds the secret sampling seed and the noise generator's state,
    and the batches of step t are a function of (seed, t) only
    (`tfdp.data.train_batches`), so the replayed steps draw the same batches
    and the same noise as the first time. This is what happens after every
    kill between two checkpoints (tests/resume_test.py checks that the replay
    ends with identical weights, privacy record and noise state). The privacy
    record in the checkpoint counts the steps of the one stream, and the report's
    epsilon covers them once.

    Args:
      checkpoint_dir: the workdir's `checkpoints/`.

    Returns:
      The checkpoint prefix (str), or None if there is no checkpoint state.

    Raises:
      WorkdirError: the state file cannot be read, or the newest existing
        checkpoint is corrupt; the message names the file, any older intact
        checkpoint, and what to do.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    # Absolute: get_checkpoint_state joins a relative folder into the paths it returns,
    # which would then be joined twice below (README's --workdir is relative).
    if not storage.is_url(checkpoint_dir):
        checkpoint_dir = os.path.abspath(checkpoint_dir)
    state_file = storage.join(checkpoint_dir, "checkpoint")
    if not storage.exists(state_file):
        return None
    try:
        state = tf.train.get_checkpoint_state(checkpoint_dir)
    except Exception as e:  # pylint: disable=broad-except  (text-proto parse errors)
        _unreadable_state(state_file, checkpoint_dir, _first_line(e))
    if state is None or not state.model_checkpoint_path:
        # TensorFlow logs a parse error and returns None for a file that is not its text
        # proto (garbage text, an empty file): this run would not know what to resume.
        _unreadable_state(state_file, checkpoint_dir)
    listed = list(state.all_model_checkpoint_paths) if state else []
    if state and state.model_checkpoint_path and state.model_checkpoint_path not in listed:
        listed.append(state.model_checkpoint_path)
    listed = [p if os.path.isabs(p) or storage.is_url(p) else storage.join(checkpoint_dir, p)
              for p in listed]
    existing = [p for p in listed if checkpoint_files(p)]
    if not existing:
        return None
    newest = existing[-1]
    for skipped in listed[listed.index(newest) + 1:]:
        _warn(f"Checkpoint {skipped} is listed in {state_file} but its files are gone; "
              f"resuming from {newest}.")
    problem = checkpoint_problem(newest)
    if problem is None:
        return newest
    older = next((p for p in reversed(existing[:-1]) if checkpoint_problem(p) is None), None)
    files = " ".join(checkpoint_files(newest))
    if older:
        what = (
            f"The earlier checkpoint {older} is intact. To resume from it, move the files of "
            f"{os.path.basename(newest)} out of the workdir (mv {files} SOMEWHERE/) and run "
            "the same command again: the steps after it are replayed with the same secret "
            "batches and noise, so nothing is released twice. Or use a new workdir.")
    else:
        what = ("No earlier checkpoint is intact: this run cannot be resumed. Use a new "
                "workdir.")
    raise WorkdirError(f"The checkpoint {newest} is corrupt: {problem}. {what}")


def _unreadable_state(state_file, checkpoint_dir, reason=None):
    """Raises WorkdirError for a checkpoint state file that names no checkpoint."""
    prefixes = sorted((int(m.group(1)), name[:-len(".index")])
                      for name in os.listdir(checkpoint_dir)
                      for m in [re.fullmatch(r"ckpt-(\d+)\.index", name)] if m)
    if prefixes:
        newest = prefixes[-1][1]
        what = (f"The folder holds the checkpoints {', '.join(p for _, p in prefixes)}. To "
                f"resume from the newest, write its name into the state file, e.g. printf "
                f"'model_checkpoint_path: \"{newest}\"\\n' > {state_file}, and run the same "
                "command again (a corrupt checkpoint is then named). Or use a new workdir.")
    else:
        what = "The folder holds no checkpoint files either: use a new workdir."
    raise WorkdirError(
        f"The checkpoint state {state_file} cannot be read: it is not the text TensorFlow "
        "writes there (model_checkpoint_path: \"ckpt-N\", ...)"
        + (f" ({reason})" if reason else "") + ", so this run cannot tell which checkpoint "
        f"to resume. Nothing was changed. {what}") from None


def checkpoint_problem(prefix):
    """None if every tensor of the checkpoint `prefix` reads back, else what is wrong."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    index = prefix + ".index"
    if not storage.exists(index):
        return f"{index} is missing"
    try:
        reader = storage.checkpoint_reader(prefix)
    except (tf.errors.OpError, ValueError, IndexError, RuntimeError) as e:
        return f"{index} cannot be read ({_first_line(e)}; a truncated file?)"
    try:
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except (tf.errors.OpError, ValueError, IndexError, RuntimeError) as e:
        data = ", ".join(p for p in checkpoint_files(prefix) if ".data-" in p) or (
            prefix + ".data-*")
        return f"{data} cannot be read ({_first_line(e)}; a truncated file?)"
    return None


def _first_line(error):
    message = getattr(error, "message", None) or str(error)
    return " ".join(message.strip().splitlines()[0].split())[:300]


def _warn(message):
    from absl import logging  # pylint: disable=g-import-not-at-top

    logging.warning("%s", message)


def remove_partial_checkpoints(checkpoint_dir, before):
    """After a failed save: removes what this run wrote that no checkpoint state lists.

    A save that fails (a full disk, a read-only folder) leaves `ckpt-N_temp/`
    and maybe part of `ckpt-N.*`, which would look like progress. Only
    entries that were not in `checkpoint_dir` when the run started (`before`)
    are removed, and only those of checkpoints the state does not list.
    """
    if not storage.isdir(checkpoint_dir):
        return
    listed = set()
    state_file = storage.join(checkpoint_dir, "checkpoint")
    if storage.exists(state_file):
        with contextlib.suppress(Exception):  # pylint: disable=broad-except
            listed = set(re.findall(r'"(?:[^"]*/)?(ckpt-\d+)"', storage.read_text(state_file)))
    for name in sorted(set(storage.listdir(checkpoint_dir)) - set(before)):
        base = re.match(r"(ckpt-\d+)", name)
        if name == "checkpoint" or (base and base.group(1) in listed and
                                    not name.endswith("_temp")):
            continue
        storage.remove_any(storage.join(checkpoint_dir, name))
    storage.rmdir_if_empty(checkpoint_dir)  # only if it is empty now


def finished(workdir):
    """The FINISHED record if the workdir holds a finished run, else None.

    Finished means: `FINISHED` exists and every file it lists is there.
    Whether those files are still the ones it vouches for is
    `changed_since_finished`'s question.
    """
    path = storage.join(workdir, FINISHED_FILE)
    try:
        record = json.loads(storage.read_text(path))
    except Exception:  # pylint: disable=broad-except  (missing or unreadable: not finished)
        return None
    files = record.get("files", []) if isinstance(record, dict) else []
    if not files or not all(storage.exists(storage.join(workdir, name)) for name in files):
        return None
    return record


def write_finished(workdir, record):
    """Writes `FINISHED` (a JSON `record` that lists its `files`) atomically, last.

    The record gets `digests`: the size and SHA-256 of every listed file
    (`vouched_digests`), read after they were written, so a later rerun can
    tell whether the workdir still holds them (`changed_since_finished`).
    Written whole (`tfdp.storage.write_whole`: locally to a temporary name,
    flushed to disk and renamed; on an object store as one object), so
    FINISHED is either absent or complete.
    """
    record = {**record, "digests": vouched_digests(workdir, record["files"])}
    check_held(workdir)  # never FINISHED into a folder another run holds
    storage.write_whole(storage.join(workdir, FINISHED_FILE), json.dumps(record, indent=1))


# -- What FINISHED vouches for: sizes and SHA-256 digests ----------------------------------
# Files are read through `tfdp.storage` (POSIX locally, tf.io.gfile on gs:// workdirs).
DIGEST = "sha256"


def file_digest(path):
    """`{"bytes": size, "sha256": hex digest}` of the file at `path`."""
    digest, size = hashlib.sha256(), 0
    for chunk in storage.read_chunks(path):
        digest.update(chunk)
        size += len(chunk)
    return {"bytes": size, DIGEST: digest.hexdigest()}


def vouched_digests(workdir, names):
    """`{name: file_digest}` of the files `names` (relative to `workdir`) FINISHED lists.

    A listed folder (e.g. `export/variables`) stands for every file under it,
    each recorded under its own relative name.
    """
    digests = {}
    for name in names:
        path = storage.join(workdir, name)
        if storage.isdir(path):
            for full, relative in storage.walk_files(path):
                digests[f"{name}/{relative}"] = file_digest(full)
        else:
            digests[name] = file_digest(path)
    return digests


def changed_since_finished(workdir, record):
    """The files FINISHED vouches for that are no longer what it recorded, as readable lines.

    Every file in the record's `digests` is read again and compared (size,
    then SHA-256): a swapped `export/` or `privacy_report.json`, an edited
    report, a replaced `variables/` shard. A file under a vouched folder that
    FINISHED did not record (e.g. a second `variables.data-*` shard from
    another export) is listed too.

    Args:
      workdir: the workdir.
      record: the FINISHED record (`finished`).

    Returns:
      A list of lines, one per changed, missing or added file (empty: all
      unchanged), or None when the record holds no digests, which cannot be
      checked.
    """
    recorded = record.get("digests") if isinstance(record, dict) else None
    if not isinstance(recorded, dict) or not recorded:
        return None
    problems = []
    for name, expected in sorted(recorded.items()):
        path = storage.join(workdir, name)
        try:
            found = file_digest(path)
        except (OSError, tf_errors().OpError) as e:
            problems.append(f"{name}: cannot be read ({getattr(e, 'strerror', None) or e})")
            continue
        if found["bytes"] != expected.get("bytes"):
            problems.append(f"{name}: {found['bytes']} bytes, {expected.get('bytes')} when "
                            "FINISHED was written")
        elif found[DIGEST] != expected.get(DIGEST):
            problems.append(f"{name}: same size, other contents ({DIGEST} {found[DIGEST][:12]}"
                            f"..., {expected.get(DIGEST, '?')[:12]}... when FINISHED was "
                            "written)")
    folders = {name for name in record.get("files", [])
               if storage.isdir(storage.join(workdir, name))}
    for folder in sorted(folders):
        for _, relative in storage.walk_files(storage.join(workdir, folder)):
            name = f"{folder}/{relative}"
            if name not in recorded:
                problems.append(f"{name}: not there when FINISHED was written")
    return problems


def tf_errors():
    """`tf.errors` (a missing object on gs:// raises NotFoundError, not an OSError)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    return tf.errors


def remove_stale_temporaries(workdir):
    """Removes what a killed finish left: `.export.tmp-*`, `.export.old-*`, `.report.tmp-*`.

    Called under the lock, so no other process is writing them.
    """
    for pattern in (".export.tmp-*", ".export.old-*", ".report.tmp-*", FINISHED_FILE + ".tmp-*"):
        for path in storage.glob(workdir, pattern):
            storage.remove_any(path)


def clear_finished(workdir):
    """Removes FINISHED, before a run changes what it certified (more steps, a re-export)."""
    storage.remove(storage.join(workdir, FINISHED_FILE))
