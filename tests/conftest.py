"""Fixtures shared by the end-to-end and data tests."""

import contextlib
import ctypes
import ctypes.util
import fcntl
import gc
import logging
import os

import gin
import pytest

from tfdp import data
from tfdp import experiment
from tfdp import main

MOCK_EXAMPLES = 64


def _run_smoke(workdir, gin_files, extra_params=(), mock=True):
    """Parses `gin_files`, then smoke.gin (2 steps), and trains.

    On TFDS mock data (`tfdp.data.mock_data`) with N = MOCK_EXAMPLES and B = 16
    unless `extra_params` override them; with `mock=False`, on the dataset the
    parameters name (real files). Returns the privacy report of
    `tfdp.experiment.train_and_evaluate`.
    """
    gin.clear_config()
    params = [f"NUM_EXAMPLES = {MOCK_EXAMPLES}", "BATCH_SIZE = 16", *extra_params]
    main.parse_config([*gin_files, "smoke.gin"], params)
    try:
        with data.mock_data(num_examples=MOCK_EXAMPLES) if mock else contextlib.nullcontext():
            return experiment.train_and_evaluate(workdir=str(workdir))
    finally:
        gin.clear_config()


SLOW_BY_NODEID = pytest.StashKey[dict]()  # every collected test's id: whether it is marked slow


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Stashes every collected test's id and whether it is marked `slow`, before `-m` selects.

    For `tests/slow_cases_test.py`, which checks that the default suite keeps a case of each
    privacy, accounting and workdir rule: after `-m "not slow"` a test marked slow in every
    case is no longer among the session's items.
    """
    config.stash[SLOW_BY_NODEID] = {
        item.nodeid: item.get_closest_marker("slow") is not None for item in items}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a test file's last test: collects its cyclic garbage, then `gc.freeze()`s the rest.

    A worker's heap grows test by test (TensorFlow graphs, Keras models, caches),
    and each full collection Python starts on its own walks all of it: in the
    suite a single one took 10-60 s, mostly not CPU time, about 290 s of the
    workers' 1,600 s (2026-11-27, measured with `gc.callbacks`). Frozen objects
    are no longer walked; their memory is still freed when their reference count
    drops to zero, and only a cycle among them that dies later stays allocated.
    """
    yield
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        gc.freeze()
        _return_free_heap_to_the_os()


def _return_free_heap_to_the_os():
    """glibc's `malloc_trim(0)`: a worker's resident memory falls back after a heavy test file.

    Without it, a worker that ran the Keras applications' slow tests (7.6 GB at the peak)
    stayed at 3.8 GB; with it, 2.6 GB (2026-11-27). A no-op where libc has no malloc_trim.
    """
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@pytest.fixture(scope="session")
def once_per_session(tmp_path_factory):
    """`once_per_session(name, build)`: `build(folder)` run once, shared by the xdist workers.

    pytest-xdist gives a module's tests to both workers, and a module-scoped
    fixture then runs in each (a 2-step training run: 10-60 s a worker on the
    2-core host). The first worker to get here builds in the folder the workers
    share; the other waits on its lock, then reads what was built. Only for
    what the tests read and never change. It returns the folder (a pathlib.Path).
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent

    def once(name, build):
        out = root / name
        out.mkdir(exist_ok=True)
        with open(out / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "done").exists():
                build(out)
                (out / "done").write_text("")
        return out

    return once


@pytest.fixture(autouse=True)
def _op_determinism_left_as_found():
    """Turns TensorFlow's op determinism off again after a test that turned it on.

    `deterministic=True` runs call `tf.config.experimental.enable_op_determinism()`,
    which holds for the whole process: one run per process in real use, but a
    pytest-xdist worker runs hundreds of tests, and a later one then compiled its
    step under determinism ("GPU MaxPool gradient ops do not yet have a
    deterministic XLA implementation", on a CPU).
    """
    from tensorflow.python.framework import config as tf_config  # pylint: disable=g-import-not-at-top

    before = tf_config.is_op_determinism_enabled()
    yield
    if tf_config.is_op_determinism_enabled() and not before:
        tf_config.disable_op_determinism()


@pytest.fixture(autouse=True)
def _onednn_modes_left_as_found():
    """Forgets the oneDNN fpmath modes a test set, as a new process would.

    tfdp keeps every oneDNN mode it has seen for the life of the process
    (`tfdp.process_settings`: oneDNN keeps a mode it read), which is right in
    one run; a pytest-xdist worker runs hundreds of tests, and a mode one test
    set with monkeypatch would plan every later test's step for bf16.
    """
    from tfdp import process_settings  # pylint: disable=g-import-not-at-top

    before = {name: list(values) for name, values in
              process_settings._seen_since_import.items()}
    yield
    process_settings._seen_since_import.clear()
    process_settings._seen_since_import.update(before)


@pytest.fixture
def run_smoke():
    """`run_smoke(workdir, gin_files, extra_params=(), mock=True)`: a 2-step run."""
    return _run_smoke


@pytest.fixture(scope="module")
def run_smoke_module():
    """`run_smoke` for module-scoped fixtures (one run shared by several tests)."""
    return _run_smoke


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def tensorflow_warnings():
    """The list of warnings TensorFlow's Python logger emits during the test.

    pfor (`tf.vectorized_map`) logs "Conv2DBackpropFilter uses a while_loop.
    Fix that!" there when per-example conv gradients fall back to a
    sequential loop of batch-1 ops.
    """
    handler = _Messages()
    logging.getLogger("tensorflow").addHandler(handler)
    yield handler.messages
    logging.getLogger("tensorflow").removeHandler(handler)


# The local ImageNet-shaped dataset of the tests: JPEGs of varying sizes, as ImageNet's.
SYNTHETIC_IMAGENET = {"num_train": 40, "num_validation": 12, "image_size": (40, 80)}


@pytest.fixture(scope="session")
def synthetic_imagenet_dir(tmp_path_factory):
    """A TFDS data_dir holding a tiny `synthetic_imagenet` in ArrayRecord (about 1 s)."""
    return data.prepare_synthetic_imagenet(
        tmp_path_factory.mktemp("synthetic_imagenet"), **SYNTHETIC_IMAGENET)


@pytest.fixture(scope="session")
def synthetic_jpeg_dir(tmp_path_factory):
    """The same examples as ImageNet's JPEG-folder layout, indexed (a few seconds)."""
    return data.synthetic_imagenet.write_jpeg_folder(
        tmp_path_factory.mktemp("synthetic_jpeg") / "imagenet", **SYNTHETIC_IMAGENET)
