"""The lock of an object-store workdir: a lease object (tfdp.lease, tfdp.workdir.locked).

On ram:// (TensorFlow's in-process file system) the preconditions of
`RamLeaseStore` are exact, so these tests exercise the lease protocol a
gs:// workdir relies on: created only if absent, naming its holder, renewed
while the run lives, taken over only after it expired, and a holder that
lost it stops. (Cloud Storage itself is not reachable from here; docs/design/workdir_protocol.md.)
"""

import json
import os
import re
import threading
import time
import uuid

import pytest
import tensorflow as tf

from tfdp import lease as lease_lib
from tfdp import workdir as workdir_lib


@pytest.fixture
def url():
    return f"ram://lease_test/{uuid.uuid4().hex}"


def _record(path):
    return json.loads(tf.io.gfile.GFile(path, "rb").read())


def test_the_store_s_preconditions():
    store, path = lease_lib.RamLeaseStore(), f"ram://store/{uuid.uuid4().hex}"
    first = store.create(path, b"a")
    assert first is not None and store.create(path, b"b") is None  # does-not-exist only
    assert store.read(path) == (b"a", first)
    assert store.replace(path, b"c", first + 1) is None  # a stale generation fails
    second = store.replace(path, b"c", first)
    assert second != first and store.read(path) == (b"c", second)
    assert not store.delete(path, first) and store.delete(path, second)
    assert store.read(path) is None


def test_a_second_run_is_refused_naming_the_holder_and_the_lease_is_released(url):
    with workdir_lib.locked(url):
        lock = f"{url}/{workdir_lib.LOCK_FILE}"
        holder = _record(lock)
        assert {"pid", "host", "started", "expires", "id"} <= set(holder)
        with pytest.raises(workdir_lib.WorkdirLockedError,
                           match=rf"{url} is in use by another run \(pid \d+ on .*, started "
                                 r".*; its lease expires at .*\)"):
            with workdir_lib.locked(url):
                pass
        assert _record(lock) == holder  # the refused run changed nothing
    assert not tf.io.gfile.exists(lock)
    with workdir_lib.locked(url):  # free again
        pass


def test_a_lease_is_renewed_while_the_run_lives(url, monkeypatch):
    lock = f"{url}/{workdir_lib.LOCK_FILE}"
    monkeypatch.setattr(lease_lib, "CLOCK_SKEW_SECONDS", 0.0)
    with workdir_lib.locked(url, lease_seconds=1.0, renew_every_seconds=0.2):
        first = _record(lock)["expires"]
        time.sleep(1.5)  # past the first expiry
        assert _record(lock)["expires"] > first + 1.0
        # Renewed, so still held: another run is refused even after the first expiry.
        with pytest.raises(workdir_lib.WorkdirLockedError):
            with workdir_lib.locked(url):
                pass


def test_an_expired_lease_is_taken_over_and_a_live_one_is_not(url, monkeypatch):
    store, lock = lease_lib.RamLeaseStore(), f"{url}/{workdir_lib.LOCK_FILE}"
    tf.io.gfile.makedirs(url)
    dead = {"id": "x", "pid": 1, "host": "h", "started": "s", "expires": time.time() + 40,
            "expires_utc": "soon"}
    store.create(lock, json.dumps(dead).encode())
    # 40 s left (beyond the 30 s allowed for clock skew): a live holder.
    with pytest.raises(workdir_lib.WorkdirLockedError, match=r"pid 1 on h, started s"):
        with workdir_lib.locked(url):
            pass
    # Once its expiry (plus the skew) has passed, the holder is dead: taken over.
    monkeypatch.setattr(lease_lib.time, "time", lambda: dead["expires"] + 31)
    with workdir_lib.locked(url, lease_seconds=3600, renew_every_seconds=3000):
        assert _record(lock)["id"] != "x"
    monkeypatch.undo()
    assert store.read(lock) is None


def test_two_runs_taking_over_one_expired_lease_one_wins(url):
    store, lock = lease_lib.RamLeaseStore(), f"{url}/{workdir_lib.LOCK_FILE}"
    tf.io.gfile.makedirs(url)
    store.create(lock, json.dumps({"expires": 0.0}).encode())
    results, barrier = [], threading.Barrier(8)

    def contender():
        lease = lease_lib.Lease(lock, store, lease_seconds=60, renew_every_seconds=30)
        barrier.wait()
        try:
            lease.acquire()
            results.append(lease)
        except lease_lib.LeaseHeldError:
            results.append(None)

    threads = [threading.Thread(target=contender) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [r for r in results if r is not None]
    assert len(results) == 8 and len(winners) == 1
    winners[0].release()


def test_a_run_that_lost_its_lease_stops(url):
    store, lock = lease_lib.RamLeaseStore(), f"{url}/{workdir_lib.LOCK_FILE}"
    with pytest.raises(workdir_lib.WorkdirLockedError, match=r"lost its lease on the workdir"):
        with workdir_lib.locked(url, lease_seconds=2.0, renew_every_seconds=0.1):
            # Another run takes it over (as after a pause longer than the lease).
            _, generation = store.read(lock)
            store.replace(lock, json.dumps({"id": "thief", "expires": time.time() + 60}).encode(),
                          generation)
            deadline = time.time() + 10
            while time.time() < deadline:  # the run's steps, each checking its workdir
                workdir_lib.check_held(url)
                time.sleep(0.01)
            raise AssertionError("the run went on after losing its lease")
    assert _record(lock)["id"] == "thief"  # the loser does not delete the winner's lease


def test_after_a_lost_lease_no_write_under_the_workdir_happens(url):
    # An export's removal and upload, a report or a feature cache write between two checks
    # of the training loop: tfdp.storage refuses each once the lease is lost.
    from tfdp import storage  # pylint: disable=g-import-not-at-top

    store, lock = lease_lib.RamLeaseStore(), f"{url}/{workdir_lib.LOCK_FILE}"
    export = f"{url}/export"
    with pytest.raises(workdir_lib.WorkdirLockedError, match=r"lost its lease on the workdir"):
        with workdir_lib.locked(url, lease_seconds=2.0, renew_every_seconds=0.1):
            storage.write_whole(f"{export}/saved_model.pb", b"mine")
            _, generation = store.read(lock)
            store.replace(lock, json.dumps({"id": "thief", "expires": time.time() + 60}).encode(),
                          generation)
            deadline = time.time() + 10
            while time.time() < deadline and not _lost(url):
                time.sleep(0.01)
            storage.write_whole(f"{export}/saved_model.pb", b"theirs?")  # the guard refuses
    assert storage.read_bytes(f"{export}/saved_model.pb") == b"mine"
    for write in (lambda: storage.rmtree(export), lambda: storage.write_whole(f"{url}/x", b"")):
        write()  # no guard once the block has ended: the guard is the run's, not the path's
    assert not storage.exists(export)


def _lost(url):
    """Whether this process has lost the lease of the workdir `url` it holds (`check_held`)."""
    try:
        workdir_lib.check_held(url)
    except workdir_lib.WorkdirLockedError:
        return True
    return False


def test_a_lost_lease_stops_a_keras_fit_at_its_next_step(url):
    import keras  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top

    from tfdp.training import callbacks  # pylint: disable=g-import-not-at-top

    store, lock = lease_lib.RamLeaseStore(), f"{url}/{workdir_lib.LOCK_FILE}"
    seen = []  # per step: was the lease lost when the step ended?

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(_lost(url))
            if batch == 2:  # another run takes the workdir over
                _, generation = store.read(lock)
                store.replace(lock, json.dumps({"id": "thief", "expires": time.time() + 60}
                                               ).encode(), generation)
            time.sleep(0.02)  # a step of the run

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(workdir_lib.WorkdirLockedError, match=r"lost its lease on the workdir"):
        with workdir_lib.locked(url, lease_seconds=5.0, renew_every_seconds=0.1):
            # As the trainer orders them: the check, then what would write.
            model.fit(np.zeros((4000, 2)), np.zeros((4000, 1)), batch_size=1, epochs=1,
                      verbose=0, callbacks=[Steps(), callbacks.WorkdirHeld(url)])
    assert _record(lock)["id"] == "thief"  # lost: the WorkdirLockedError above
    # Stopped at the end of the step during which the flag was set: no step ends after it.
    assert seen.count(True) <= 1 and len(seen) < 200, (len(seen), seen.count(True))


@pytest.mark.parametrize("bad", [("s3://b/wd", r"s3://b/wd is a s3:// URL"),
                                 ("hdfs://n/wd", r"hdfs://n/wd is a hdfs:// URL")])
def test_a_store_without_leases_is_refused(bad):
    workdir, message = bad
    with pytest.raises(workdir_lib.WorkdirError, match=message):
        workdir_lib.check_lockable(workdir)
    workdir_lib.check_lockable("/tmp/local")  # local folders: flock
    workdir_lib.check_lockable("ram://x")


def test_gs_without_the_client_says_what_to_install(monkeypatch):
    import builtins  # pylint: disable=g-import-not-at-top

    real_import = builtins.__import__

    def no_google(name, *args, **kwargs):
        if name.startswith("google.cloud") or name.startswith("google.api_core"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_google)
    with pytest.raises(workdir_lib.WorkdirError, match=r"pip install -e \"\.\[tpu,gcs\]\""):
        workdir_lib.check_lockable("gs://bucket/runs/x")


# -- GCSLeaseStore against a local fake of google-cloud-storage's preconditions --------------


class _PreconditionFailed(Exception):
    pass


class _NotFound(Exception):
    pass


class _FakeBucket:
    """Objects with generations, as Cloud Storage keeps them (one lock: atomic calls)."""

    def __init__(self):
        self.objects, self.lock, self.counter = {}, threading.Lock(), 0

    def blob(self, name):
        return _FakeBlob(self, name)

    def get_blob(self, name):
        with self.lock:
            if name not in self.objects:
                return None
            blob = _FakeBlob(self, name)
            blob.generation = self.objects[name][1]
            return blob


class _FakeBlob:
    def __init__(self, bucket, name):
        self.bucket, self.name, self.generation = bucket, name, None

    def _check(self, if_generation_match):
        current = self.bucket.objects.get(self.name, (None, 0))[1]
        if if_generation_match is not None and current != if_generation_match:
            raise _PreconditionFailed(self.name)

    def upload_from_string(self, data, if_generation_match=None):
        with self.bucket.lock:
            self._check(if_generation_match)
            self.bucket.counter += 1
            self.bucket.objects[self.name] = (bytes(data), self.bucket.counter)
            self.generation = self.bucket.counter

    def download_as_bytes(self, if_generation_match=None):
        with self.bucket.lock:
            if self.name not in self.bucket.objects:
                raise _NotFound(self.name)
            self._check(if_generation_match)
            return self.bucket.objects[self.name][0]

    def delete(self, if_generation_match=None):
        with self.bucket.lock:
            if self.name not in self.bucket.objects:
                raise _NotFound(self.name)
            self._check(if_generation_match)
            del self.bucket.objects[self.name]


@pytest.fixture
def fake_gcs(monkeypatch):
    import sys  # pylint: disable=g-import-not-at-top
    import types  # pylint: disable=g-import-not-at-top

    bucket = _FakeBucket()
    storage = types.ModuleType("google.cloud.storage")
    storage.Client = lambda: types.SimpleNamespace(bucket=lambda name: bucket)
    exceptions = types.ModuleType("google.api_core.exceptions")
    exceptions.PreconditionFailed, exceptions.NotFound = _PreconditionFailed, _NotFound
    cloud = types.ModuleType("google.cloud")
    cloud.storage = storage
    api_core = types.ModuleType("google.api_core")
    api_core.exceptions = exceptions
    google = types.ModuleType("google")
    google.cloud, google.api_core = cloud, api_core
    for name, module in (("google", google), ("google.cloud", cloud),
                         ("google.cloud.storage", storage), ("google.api_core", api_core),
                         ("google.api_core.exceptions", exceptions)):
        monkeypatch.setitem(sys.modules, name, module)
    return bucket


def test_the_gcs_store_uses_generation_preconditions(fake_gcs):
    workdir_lib.check_lockable("gs://bucket/runs/x")  # the client is there: accepted
    store, path = lease_lib.store_for("gs://bucket/runs/x"), "gs://bucket/runs/x/.tfdp.lock"
    assert isinstance(store, lease_lib.GCSLeaseStore)
    first = store.create(path, b"a")
    assert first is not None and store.create(path, b"b") is None  # ifGenerationMatch=0
    assert store.read(path) == (b"a", first)
    assert fake_gcs.objects["runs/x/.tfdp.lock"][0] == b"a"
    assert store.replace(path, b"c", first + 100) is None
    second = store.replace(path, b"c", first)
    assert second is not None and store.read(path) == (b"c", second)
    assert not store.delete(path, first) and store.delete(path, second)
    assert store.read(path) is None and not fake_gcs.objects


def test_a_lease_on_the_fake_gcs_refuses_a_second_holder_and_is_released(fake_gcs):
    store, path = lease_lib.GCSLeaseStore(), "gs://bucket/wd/.tfdp.lock"
    first = lease_lib.Lease(path, store, lease_seconds=60, renew_every_seconds=0.1)
    first.acquire()
    try:
        time.sleep(0.5)  # a few renewals, each a conditional rewrite
        assert fake_gcs.objects["wd/.tfdp.lock"][1] > 1
        with pytest.raises(lease_lib.LeaseHeldError, match=r"pid \d+ on "):
            lease_lib.Lease(path, store).acquire()
    finally:
        first.release()
    assert not fake_gcs.objects and not first.lost


def test_gs_without_credentials_says_what_to_do(fake_gcs, monkeypatch):
    import sys  # pylint: disable=g-import-not-at-top

    def no_credentials():
        raise RuntimeError("Your default credentials were not found.")

    monkeypatch.setattr(sys.modules["google.cloud.storage"], "Client", no_credentials)
    with pytest.raises(workdir_lib.WorkdirError,
                       match=r"Cannot open Cloud Storage for the workdir's lease \(RuntimeError: "
                             r"Your default credentials were not found\.\).*application-default"):
        workdir_lib.check_lockable("gs://bucket/runs/x")


# -- A lost lease stops the run whatever its signal dispositions ----------------
# A run started as `cmd &` from a script ignores SIGINT: the stop is no signal but a flag that
# the run checks at every step, and the process exits if the run does not react in time.
_LOSER = r'''
import json, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a shell script
from tfdp import lease as lease_lib
from tfdp import workdir as workdir_lib
url, renew, work = sys.argv[1], float(sys.argv[2]), sys.argv[3]
store, lock = lease_lib.RamLeaseStore(), url + "/" + workdir_lib.LOCK_FILE
try:
    with workdir_lib.locked(url, lease_seconds=20 * renew, renew_every_seconds=renew):
        _, generation = store.read(lock)  # another run takes the workdir over
        store.replace(lock, json.dumps({"id": "thief", "expires": time.time() + 60}).encode(),
                      generation)
        taken = time.time()
        if work == "python":  # the run's steps, each checking its workdir (as WorkdirHeld)
            while time.time() < taken + 30:
                workdir_lib.check_held(url)
                sum(range(1000))
        elif work == "unchecked":  # a long stretch of Python work without a check
            while time.time() < taken + 30:
                sum(range(1000))
        else:  # stuck in one long native call
            time.sleep(30)
        print("STILL RUNNING"); sys.exit(1)
except workdir_lib.WorkdirLockedError as e:
    print(f"STOPPED after {time.time() - taken:.3f} s: {e}")
    assert json.loads(store.read(lock)[0])["id"] == "thief"  # the winner's lease stays
    sys.exit(2)
'''


@pytest.fixture
def busy_cpu():
    """A busy loop on a core beside the test, as on a loaded host.

    Under pytest-xdist the other workers already load the host (the suite keeps both
    cores busy): no spinner, whose core the suite's own tests would lose.
    """
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top

    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    spinner.kill()
    spinner.wait()


@pytest.mark.parametrize("work", ["python", pytest.param("unchecked", marks=pytest.mark.slow),
                                  "native"])
def test_a_run_that_ignores_sigint_stops_within_a_renewal_of_losing_its_lease(
        tmp_path, busy_cpu, work):
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top

    script = tmp_path / "loser.py"
    script.write_text(_LOSER)
    renew = 1.0
    started = time.time()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this tfdp, not another
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), f"ram://loser/{uuid.uuid4().hex}",
                           str(renew), work], capture_output=True, text=True, timeout=120,
                          env=env)
    assert "STILL RUNNING" not in proc.stdout, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if work == "python":
        # Stopped at the first step after the first renewal after the takeover (<= renew).
        assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
        elapsed = float(proc.stdout.split("STOPPED after ")[1].split(" s")[0])
        assert elapsed < renew + 1.0, proc.stdout
        assert "lost its lease on the workdir" in proc.stdout
    else:
        # Nothing checks the flag: the process exits one renewal later.
        assert proc.returncode == lease_lib.LOST_EXIT_STATUS, proc.stdout + proc.stderr[-3000:]
        assert "did not stop within 1 s of losing its workdir lease" in proc.stderr
        assert time.time() - started < 25  # not the 30 s sleep (the interpreter's start incl.)


@pytest.mark.parametrize("expires", ["soon", None, [1], True, float("nan"), 1e300, 1e18, -5])
def test_a_lease_with_a_non_numeric_expiry_is_refused_by_name_not_with_a_type_error(
        url, expires):
    store, lock = lease_lib.RamLeaseStore(), f"{url}/{workdir_lib.LOCK_FILE}"
    tf.io.gfile.makedirs(url)
    store.create(lock, json.dumps({"id": "x", "pid": 7, "expires": expires}).encode())
    with pytest.raises(workdir_lib.WorkdirLockedError,
                       match=r"cannot be read or has no numeric expiry: it is never taken "
                             r"over; delete it if no run uses this workdir") as refused:
        with workdir_lib.locked(url):
            pass
    assert not isinstance(refused.value, TypeError)


def test_the_refusal_gives_the_time_of_the_takeover_expiry_plus_the_clock_skew(url):
    store, lock = lease_lib.RamLeaseStore(), f"{url}/{workdir_lib.LOCK_FILE}"
    tf.io.gfile.makedirs(url)
    expires = time.time() + 100
    store.create(lock, json.dumps({"id": "x", "pid": 7, "host": "h", "started": "s",
                                   "expires": expires,
                                   "expires_utc": lease_lib._utc(expires)}).encode())
    takeover = lease_lib._utc(expires + lease_lib.CLOCK_SKEW_SECONDS)
    with pytest.raises(workdir_lib.WorkdirLockedError,
                       match=re.escape(f"can be taken over from {takeover})")):
        with workdir_lib.locked(url):
            pass
