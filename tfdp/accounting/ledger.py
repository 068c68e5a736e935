"""A study ledger: the privacy cost of all runs of a hyper-parameter study.

How to DP-fy ML (Ponomareva et al. 2023, Sec. 5.4.2) asks that tuning on
private data be accounted for: every run of a study touches the same private
data, so the study as a whole is the composition of all its runs. A study
directory holds one file, `ledger.jsonl`, with one JSON object per line and
per run:

    {"run": "lr=2_sigma=3",                  # unique run name (str)
     "mechanism": {...},                      # DPMechanism.to_dict(), with
                                              # num_steps = the steps taken
     "sampling_coins": "secret",              # or "fixed:<fingerprint>"
     "timestamp": "2026-11-23T00:00:00+00:00"}  # UTC, ISO 8601

The mechanism is the run's `tfdp.accounting.DPMechanism`, so its event is
built the one way every tfdp event is (`DPMechanism.dp_event`), data
normalization and the shuffle/replace-one accounting included.

Runs whose sampling seeds were drawn from OS entropy ("secret") are
independent and compose as separate events. Runs that share a seed fixed by
the user train on the same batches at every step they share; they carry the
same fingerprint of that seed (a hash, not the seed), and
`mechanism.shared_sampling_seed_event` composes them jointly, or refuses when their
batches are correlated in another way (different N or B).

A run name is unique: appending a run whose name is already in the ledger
(e.g. after a training job was pre-empted and resumed) REPLACES its line
instead of counting the run twice.

Runs of a study often run at once (a search), so every read and every
read-modify-write of the ledger holds the study's lock (`study_lock`: a
`filelock.FileLock` on `ledger.jsonl.lock` beside it, an advisory `flock`
on local and NFS folders): no run's line is lost to another's rewrite, and
no reader sees half a line. The study directory is a local (or mounted)
folder; `ledger.jsonl` and its lock are refused when they are symbolic links.

Nothing here imports TensorFlow.
"""

import collections
import contextlib
import datetime
import hashlib
import json
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import dp_accounting
import filelock

from tfdp import atomic_file
from tfdp.accounting import accountant as accountant_lib
from tfdp.accounting import mechanism as mechanism_lib

LEDGER_FILENAME = "ledger.jsonl"
LOCK_FILENAME = LEDGER_FILENAME + ".lock"
SECRET_COINS = "secret"

_locks = {}  # real path of a lock file -> its FileLock (one per process: reentrant)
_locks_guard = threading.Lock()


def seed_fingerprint(seed: int) -> str:
    """"fixed:<16 hex digits>": identifies runs that share a user-fixed sampling seed.

    A hash, so the ledger does not spell the seed out; a small seed can still
    be found by trying them all, which is why fixed seeds are for debugging.
    """
    digest = hashlib.sha256(f"tfdp-sampling-seed:{int(seed)}".encode()).hexdigest()
    return "fixed:" + digest[:16]


def ledger_path(study_dir: str) -> str:
    """Returns the path of the ledger file of `study_dir`."""
    return os.path.join(os.fspath(study_dir), LEDGER_FILENAME)


def _refuse_links(study_dir: str) -> None:
    for name in (LEDGER_FILENAME, LOCK_FILENAME):
        path = os.path.join(os.fspath(study_dir), name)
        if os.path.islink(path):
            raise ValueError(
                f"{path} is a symbolic link: the study ledger writes only its own files, "
                "never through a link to another file. Remove the link, or give the runs "
                "another study_dir.")


def study_lock(study_dir: str) -> filelock.FileLock:
    """The study's lock: hold it around every read and read-modify-write of its ledger.

    Reentrant within a thread (one `FileLock` per lock file and process), so
    a caller that holds it may call `append_run` and `read_runs`.

    Args:
      study_dir: the study directory (created if needed).

    Returns:
      A `filelock.FileLock` on `study_dir/ledger.jsonl.lock` (a context manager).

    Raises:
      ValueError: the ledger or its lock file is a symbolic link.
    """
    os.makedirs(study_dir, exist_ok=True)
    _refuse_links(study_dir)
    path = os.path.realpath(os.path.join(os.fspath(study_dir), LOCK_FILENAME))
    with _locks_guard:  # one FileLock per file: two would block each other in one thread
        if path not in _locks:
            _locks[path] = filelock.FileLock(path)
        return _locks[path]


def read_runs(study_dir: str) -> List[Dict[str, Any]]:
    """Returns the run records of a study, in ledger order.

    Args:
      study_dir: the study directory holding `ledger.jsonl`.

    Returns:
      A list of dicts, one per run (the schema is in the module docstring).

    Raises:
      FileNotFoundError: if `study_dir/ledger.jsonl` does not exist.
      ValueError: if a line is not valid JSON, misses a key, or was written
        in the older schema without a mechanism.
    """
    path = ledger_path(study_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"No ledger at {path}: a study directory gets one when its first run "
            f"calls tfdp.accounting.ledger.append_run."
        )
    # A study no one can write (archived, read-only) is read without its lock.
    writable = os.access(os.fspath(study_dir), os.W_OK)
    with study_lock(study_dir) if writable else contextlib.nullcontext():
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    records = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{line_number} is not valid JSON ({e}); fix or delete that line."
            ) from None
        if "mechanism" not in record and "noise_multiplier" in record:
            raise ValueError(
                f"{path}:{line_number} was written by an older tfdp without the run's "
                "mechanism (N, B, C, sampling, data normalization); its epsilon cannot be "
                "recomputed exactly. Start a new study directory.")
        missing = [k for k in ("run", "mechanism", "sampling_coins") if k not in record]
        if missing:
            raise ValueError(
                f"{path}:{line_number} misses the keys {missing}; every run needs run, "
                "mechanism and sampling_coins.")
        try:
            record["mechanism"] = mechanism_lib.DPMechanism.from_dict(record["mechanism"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}:{line_number}: invalid mechanism: {e}") from None
        records.append(record)
    return records


def append_run(
    study_dir: str,
    *,
    run_name: str,
    mechanism: mechanism_lib.DPMechanism,
    sampling_seed: Optional[int] = None,
) -> None:
    """Records one DP-SGD run of a study in `study_dir/ledger.jsonl`.

    Creates `study_dir` if needed. If `run_name` is already in the ledger, its
    line is replaced (rewritten atomically), so calling this again for a resumed
    run does not count that run twice; otherwise one line is appended. Holds
    the study's lock (`study_lock`) throughout, so that concurrent runs lose
    no line.

    Args:
      study_dir: the study directory.
      run_name: unique, non-empty name of the run.
      mechanism: the run's `DPMechanism`, with `num_steps` = the optimizer
        updates actually taken.
      sampling_seed: the sampling seed when the user fixed it (only its
        fingerprint is written), or None for a secret one.

    Raises:
      ValueError: if run_name is empty, mechanism is not a DPMechanism, or the
        ledger or its lock file is a symbolic link.
    """
    if not isinstance(run_name, str) or not run_name:
        raise ValueError(f"run_name must be a non-empty string, got {run_name!r}.")
    if not isinstance(mechanism, mechanism_lib.DPMechanism):
        raise ValueError(f"mechanism must be a DPMechanism, got {type(mechanism).__name__}.")
    record = make_record(run_name, mechanism, sampling_seed)
    record["mechanism"] = mechanism.to_dict()
    line = json.dumps(record) + "\n"
    path = ledger_path(study_dir)
    with study_lock(study_dir):
        existing = read_text(study_dir)
        lines = existing.splitlines(keepends=True) if existing else []
        if not any(json.loads(l).get("run") == run_name for l in lines if l.strip()):
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            return
        write_text(study_dir, "".join(
            line if l.strip() and json.loads(l).get("run") == run_name else l for l in lines))


def make_record(run_name: str, mechanism: mechanism_lib.DPMechanism,
                sampling_seed: Optional[int] = None) -> Dict[str, Any]:
    """One run's record, as `read_runs` returns it (the mechanism a `DPMechanism`)."""
    return {
        "run": run_name,
        "mechanism": mechanism,
        "sampling_coins": SECRET_COINS if sampling_seed is None else seed_fingerprint(
            sampling_seed),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def read_text(study_dir: str) -> Optional[str]:
    """The ledger file's text, or None if it does not exist; hold `study_lock` around it."""
    path = ledger_path(study_dir)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def write_text(study_dir: str, text: Optional[str]) -> None:
    """Replaces the ledger with `text` atomically (`tfdp.atomic_file`); hold `study_lock`.

    Args:
      study_dir: the study directory.
      text: the ledger's new content, or None to remove the ledger.

    Raises:
      OSError: the ledger cannot be written or removed; a failed write leaves
        it as it was.
    """
    path = ledger_path(study_dir)
    if text is None:
        if os.path.exists(path):
            os.remove(path)
        return
    atomic_file.write_text(path, text)


def run_event(record: Dict[str, Any]) -> dp_accounting.DpEvent:
    """Returns the DpEvent of one ledger record (its mechanism's `dp_event()`)."""
    return record["mechanism"].dp_event()


def _study_event(records) -> dp_accounting.DpEvent:
    """Independent runs compose; Poisson runs sharing fixed seeds compose jointly."""
    shared = collections.defaultdict(list)
    events = []
    for record in records:
        coins, mech = record["sampling_coins"], record["mechanism"]
        if coins != SECRET_COINS and mech.sampling == "poisson":
            shared[coins].append(mech)
        else:
            events.append(mech.dp_event())
    for mechanisms in shared.values():
        events.append(mechanism_lib.shared_sampling_seed_event(mechanisms))
    return dp_accounting.ComposedDpEvent(events)


def study_event(study_dir: str) -> dp_accounting.ComposedDpEvent:
    """Returns the ComposedDpEvent of all runs in `study_dir/ledger.jsonl`.

    Raises:
      FileNotFoundError: if the ledger does not exist.
      ValueError: if the ledger is malformed, or runs share a fixed sampling
        seed in a way that cannot be composed (`shared_sampling_seed_event`).
    """
    return _study_event(read_runs(study_dir))


def study_epsilon(
    study_dir: str, *, delta: float, accountant: str = "rdp",
    adding: Optional[Dict[str, Any]] = None,
) -> Tuple[float, List[Tuple[str, float]]]:
    """Returns the epsilon of the whole study and of each of its runs.

    How to DP-fy ML, Sec. 5.4.2: report the final run's epsilon and the
    (weaker) epsilon of the whole study, which accounts for tuning on private
    data by composing all runs (a tighter bound than adding the runs' epsilons).

    Args:
      study_dir: the study directory holding `ledger.jsonl`.
      delta: the delta of (epsilon, delta)-DP, in (0, 1).
      accountant: "rdp" or "pld".
      adding: None, or a record (`make_record`) to count as if it were
        appended (replacing a line of the same run name): the study's epsilon
        with a run that has not started yet, nothing written. A missing
        ledger is then an empty one.

    Returns:
      (study_epsilon, [(run_name, run_epsilon), ...]) in ledger order.

    Raises:
      FileNotFoundError: if the ledger does not exist.
      ValueError: if delta or the accountant is invalid, the ledger is
        malformed, or runs share fixed seeds that cannot be composed.
    """
    if adding is None:
        records = read_runs(study_dir)
    else:
        try:
            records = [r for r in read_runs(study_dir) if r["run"] != adding["run"]]
        except FileNotFoundError:
            records = []
        records.append(adding)
    per_run = [
        (r["run"], accountant_lib.epsilon_of_event(run_event(r), delta=delta,
                                                   accountant=accountant))
        for r in records
    ]
    total = accountant_lib.epsilon_of_event(_study_event(records), delta=delta,
                                            accountant=accountant)
    return total, per_run
