"""One run per workdir on an object store: a lease object instead of a flock.

A local workdir is locked with `fcntl.flock` (`tfdp.workdir.locked`), which
the kernel drops when its process dies. An object store (Cloud Storage) has
no lock and no atomic rename, so a workdir there is locked by a **lease**:
the object `WORKDIR/.tfdp.lock`, holding the holder's id, pid, host, start
time and an expiry time.

- **Taken** by creating the object with a does-not-exist precondition (GCS:
  `ifGenerationMatch=0`): of two runs that start together, exactly one
  creates it; the other reads the holder and is refused.
- **Renewed** while the run lives: a background thread rewrites the expiry
  every `renew_every_seconds` (default 60 s) with a precondition on the
  generation it last wrote, so it never overwrites another holder's lease.
- **Taken over only after expiry**: a lease whose expiry (plus
  `CLOCK_SKEW_SECONDS` for the hosts' clocks) has passed belongs to a run
  that died (killed, preempted); a new run replaces it with a precondition
  on the generation it read, so of two runs taking over, one wins.
- **Lost**: if a renewal finds another generation (someone took over after
  this run failed to renew in time: a host paused longer than the lease),
  or cannot renew before the expiry, the holder stops. The renewal thread
  sets the flag `Lease.lost_event`; the run checks it at every training
  step, at every evaluation batch and before each of its writes
  (`tfdp.workdir.check_held`), and stops with a WorkdirLockedError. A flag,
  not a signal: a run started as `cmd &` from a script ignores SIGINT, and
  a run must stop whatever its signal dispositions. If the run has not let
  go of the lease within `renew_every_seconds` of the loss (stuck in a long
  native call, or in a stretch of work without a check), the process exits
  at once with status `LOST_EXIT_STATUS`. A run stops at the first renewal
  after its lease was taken over; what it wrote between the takeover and
  that renewal (a host paused for minutes resumes before its renewal thread
  wakes) is bounded by one renewal period, not prevented.
- **Released** at the end: the object is deleted (precondition: our
  generation).

A kill leaves the lease in place until it expires (`lease_seconds`, default
300 s, counted from its last renewal, so 240-300 s after a kill with the
default renewal every 60 s), and a new run takes it over only
`CLOCK_SKEW_SECONDS` (30 s) later: 270-330 s after a kill with the
defaults. The message of a refused rerun gives that time.

Stores: `RamLeaseStore` for ram:// (TensorFlow's in-process file system,
which the tests use: its preconditions are exact, under a process lock) and
`GCSLeaseStore` for gs:// (google-cloud-storage's generation preconditions;
NOT tested against real Cloud Storage: docs/design/workdir_protocol.md).
"""

import dataclasses
import datetime
import json
import os
import socket
import threading
import time
import uuid

LEASE_SECONDS = 300.0
RENEW_EVERY_SECONDS = 60.0
CLOCK_SKEW_SECONDS = 30.0
# The exit status of a process that lost its lease and did not stop within a renewal period.
LOST_EXIT_STATUS = 75
# An expiry after this (the year 5138) is not a time a run wrote: the record is unreadable.
LATEST_EXPIRY = 1e11


class LeaseHeldError(Exception):
    """Another live run holds the lease; `holder` describes it."""

    def __init__(self, holder):
        super().__init__(holder)
        self.holder = holder


class RamLeaseStore:
    """Objects with generation preconditions on ram:// (exact: ram:// is in this process).

    Each object is a ram:// file (so it shows in the workdir like any
    object); its generation is kept beside it, and every operation holds one
    process-wide lock, so check-and-write is atomic.
    """

    _lock = threading.Lock()
    _generations = {}

    def create(self, path, data):
        """Writes `data` if nothing is at `path`; its generation, or None if something is."""
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        with self._lock:
            if path in self._generations and tf.io.gfile.exists(path):
                return None
            return self._write(path, data)

    def read(self, path):
        """`(data, generation)`, or None if nothing is at `path`."""
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        with self._lock:
            if path not in self._generations or not tf.io.gfile.exists(path):
                return None
            with tf.io.gfile.GFile(path, "rb") as f:
                return f.read(), self._generations[path]

    def replace(self, path, data, generation):
        """Writes `data` if `path` is at `generation`; the new generation, or None."""
        with self._lock:
            if self._generations.get(path) != generation:
                return None
            return self._write(path, data)

    def delete(self, path, generation):
        """Deletes `path` if it is at `generation`; True if it did."""
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        with self._lock:
            if self._generations.get(path) != generation:
                return False
            del self._generations[path]
            tf.io.gfile.remove(path)
            return True

    def _write(self, path, data):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        if tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)  # ram:// appends to an existing file instead of replacing it
        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(data)
        generation = self._generations.get(path, 0) + 1
        self._generations[path] = generation
        return generation


class GCSLeaseStore:
    """Objects with generation preconditions on Cloud Storage (google-cloud-storage).

    NOT tested against Cloud Storage (docs/design/workdir_protocol.md): each call
    is the client library's documented precondition (`if_generation_match`;
    0 means "does not exist").
    """

    def __init__(self):
        try:
            from google.cloud import storage  # pylint: disable=g-import-not-at-top
            from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
        except ImportError:
            raise ValueError(
                "A gs:// workdir is locked by a lease object, which needs the "
                "google-cloud-storage client: pip install -e \".[tpu,gcs]\" (or pip install "
                "google-cloud-storage).") from None
        try:
            self._client = storage.Client()
        except Exception as e:  # pylint: disable=broad-except  (google.auth's errors)
            raise ValueError(
                f"Cannot open Cloud Storage for the workdir's lease ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:300]}). On a TPU VM the VM's service account is "
                "used; elsewhere run `gcloud auth application-default login`.") from None
        self._failed = (exceptions.PreconditionFailed, exceptions.NotFound)

    def _blob(self, path):
        bucket, _, name = path[len("gs://"):].partition("/")
        return self._client.bucket(bucket).blob(name)

    def create(self, path, data):
        blob = self._blob(path)
        try:
            blob.upload_from_string(data, if_generation_match=0)
        except self._failed:
            return None
        return blob.generation

    def read(self, path):
        bucket, _, name = path[len("gs://"):].partition("/")
        blob = self._client.bucket(bucket).get_blob(name)
        if blob is None:
            return None
        try:
            return blob.download_as_bytes(if_generation_match=blob.generation), blob.generation
        except self._failed:
            return None

    def replace(self, path, data, generation):
        blob = self._blob(path)
        try:
            blob.upload_from_string(data, if_generation_match=generation)
        except self._failed:
            return None
        return blob.generation

    def delete(self, path, generation):
        try:
            self._blob(path).delete(if_generation_match=generation)
        except self._failed:
            return False
        return True


STORES = {"ram": RamLeaseStore, "gs": GCSLeaseStore}


def store_for(url):
    """The lease store of a workdir URL's scheme.

    Raises:
      ValueError: a scheme without one (the message lists those supported).
    """
    scheme = url.split("://", 1)[0].lower()
    if scheme not in STORES:
        raise ValueError(
            f"{url}: tfdp locks a workdir on an object store with a lease object, which it "
            f"implements for {', '.join(s + '://' for s in sorted(STORES))} only. Use a gs:// "
            "workdir, or a local or mounted folder.")
    return STORES[scheme]()


@dataclasses.dataclass
class Lease:
    """The lease of one run on one workdir (see the module docstring).

    Attributes:
      path: the lease object, e.g. gs://BUCKET/runs/x/.tfdp.lock.
      store: a `RamLeaseStore` or `GCSLeaseStore`.
      lease_seconds: how long a lease lives without renewal.
      renew_every_seconds: the renewal period (< lease_seconds).
      lost_event: a `threading.Event`, set when a renewal finds the lease
        taken over, or cannot renew in time; the run checks it (`lost`).
    """

    path: str
    store: object
    lease_seconds: float = LEASE_SECONDS
    renew_every_seconds: float = RENEW_EVERY_SECONDS

    def __post_init__(self):
        if not 0 < self.renew_every_seconds < self.lease_seconds:
            raise ValueError(f"renew_every_seconds={self.renew_every_seconds} must be in "
                             f"(0, lease_seconds={self.lease_seconds}).")
        self._holder = {"id": uuid.uuid4().hex, "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "started": datetime.datetime.now().astimezone().isoformat(
                            timespec="seconds")}
        self._generation = None
        self._expires = 0.0
        self.lost_event = threading.Event()
        self._stop = threading.Event()
        self._stopping = threading.Lock()  # never lost once release() has begun
        self._thread = None

    @property
    def lost(self):
        """True once this run has lost the lease (`lost_event` is set)."""
        return self.lost_event.is_set()

    def acquire(self):
        """Takes the lease, or takes over an expired one; then renews it in the background.

        Raises:
          LeaseHeldError: a live run holds it (its `holder` says who, and until when).
        """
        data = self._record()
        generation = self.store.create(self.path, data)
        while generation is None:
            current = self.store.read(self.path)
            if current is None:  # released meanwhile: try to create it again
                generation = self.store.create(self.path, data)
                continue
            content, seen = current
            record = _parse(content)
            if time.time() <= _expiry(record) + CLOCK_SKEW_SECONDS:
                raise LeaseHeldError(_describe(record))
            # Expired: its holder died. Take it over, unless another run does first.
            generation = self.store.replace(self.path, data, seen)
            if generation is None:
                continue  # someone else took it over or renewed: read again
        self._generation = generation
        self._thread = threading.Thread(target=self._renew_loop, name="tfdp-lease",
                                        daemon=True)
        self._thread.start()

    def release(self):
        """Stops renewing and deletes the lease if it is still this run's.

        Also tells the watchdog of a lost lease that the run has stopped.
        """
        with self._stopping:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._generation is not None and not self.lost:
            self.store.delete(self.path, self._generation)

    def describe(self):
        return _describe(json.loads(self._record()))

    def _record(self):
        self._expires = time.time() + self.lease_seconds
        return json.dumps({**self._holder, "expires": self._expires,
                           "expires_utc": _utc(self._expires)}).encode()

    def _renew_loop(self):
        while not self._stop.wait(self.renew_every_seconds):
            expires = self._expires
            try:
                generation = self.store.replace(self.path, self._record(), self._generation)
            except Exception as e:  # pylint: disable=broad-except  (a transient store error)
                _log_warning(f"Could not renew the workdir lease {self.path} ({e}); retrying.")
                self._expires = expires
                if time.time() < expires - self.renew_every_seconds:
                    continue
                generation = None
            if generation is None:
                self._stop_the_run()
                return
            self._generation = generation

    def _stop_the_run(self):
        """Lost: sets `lost_event` for the run to see; exits the process if it does not stop.

        The run checks the flag at its next step or write and releases the
        lease on its way out; one that has not within `renew_every_seconds`
        (a long native call, a stretch of work without a check) is ended
        with `os._exit(LOST_EXIT_STATUS)`.
        """
        with self._stopping:
            if self._stop.is_set():  # released meanwhile: the run has already stopped
                return
            self.lost_event.set()
            _log_error(f"This run lost its workdir lease {self.path} (taken over, or not "
                       "renewed in time); it stops so that two runs never write one workdir.")
        if not self._stop.wait(self.renew_every_seconds):
            _log_error(f"The run did not stop within {self.renew_every_seconds:g} s of losing "
                       f"its workdir lease {self.path}; exiting now (status "
                       f"{LOST_EXIT_STATUS}).")
            os._exit(LOST_EXIT_STATUS)  # pylint: disable=protected-access


def _parse(content):
    """The lease record as a dict ({} when it is not a JSON object with a numeric expiry)."""
    try:
        record = json.loads(content)
    except ValueError:
        return {}
    if not isinstance(record, dict) or _expiry(record) == float("inf"):
        return {}
    return record


def _expiry(record):
    """The record's expiry (seconds since the epoch); inf unless it is a finite number."""
    expires = record.get("expires")
    if isinstance(expires, bool) or not isinstance(expires, (int, float)):
        return float("inf")
    if not 0 <= expires <= LATEST_EXPIRY:  # NaN, negative, or past any date a clock shows
        return float("inf")
    return float(expires)


def _describe(record):
    if not record:
        return ("a holder whose lease object cannot be read or has no numeric expiry: it is "
                "never taken over; delete it if no run uses this workdir")
    return (f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')}; "
            f"its lease expires at {record.get('expires_utc')} unless that run renews it, "
            f"and can be taken over from {_utc(_expiry(record) + CLOCK_SKEW_SECONDS)}")


def _utc(seconds):
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
        timespec="seconds")


def _log_warning(message):
    from absl import logging  # pylint: disable=g-import-not-at-top

    logging.warning("%s", message)


def _log_error(message):
    from absl import logging  # pylint: disable=g-import-not-at-top

    logging.error("%s", message)
