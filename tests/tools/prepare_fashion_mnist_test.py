"""Tests of tools/prepare_fashion_mnist.py on damaged input and unwritable folders.

Synthetic IDX files (12 train and 5 test images) as in tests/data/fashion_mnist_test.py.
Most cases call `tfdp.data.prepare_fashion_mnist` in-process (the tool is a thin
layer over it that prints the error in one line); a read-only folder and a full disk
need a process of their own, so they run the tool as a subprocess (5 to 7 s each,
most of it TensorFlow's import).
"""

import errno
import gzip
import importlib.util
import os
import pathlib
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tensorflow_datasets.core.download import extractor

from tfdp import data
from tfdp.data import errors
from tfdp.data import fashion_mnist

_ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = _ROOT / "tools" / "prepare_fashion_mnist.py"

_spec = importlib.util.spec_from_file_location(
    "fashion_mnist_test", _ROOT / "tests" / "data" / "fashion_mnist_test.py")
_fashion_mnist_test = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fashion_mnist_test)
write_source_dir = _fashion_mnist_test._write_source_dir  # pylint: disable=protected-access


@pytest.fixture
def source_dir(tmp_path):
    folder = tmp_path / "idx"
    folder.mkdir()
    write_source_dir(folder, np.random.default_rng(0))
    return folder


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A data_dir holding the converted synthetic dataset, made once; copy it to damage it."""
    folder = tmp_path_factory.mktemp("idx")
    write_source_dir(folder, np.random.default_rng(1))
    return fashion_mnist.prepare_fashion_mnist(source_dir=folder,
                                               data_dir=tmp_path_factory.mktemp("tfds"))


def _run_tool(source_dir, data_dir, **popen_kwargs):
    start = time.monotonic()
    result = subprocess.run(
        [*popen_kwargs.pop("prefix", []), sys.executable, str(TOOL),
         f"--source_dir={source_dir}", f"--data_dir={data_dir}"],
        capture_output=True, text=True, timeout=120, check=False, **popen_kwargs)
    return result, time.monotonic() - start


def _error_line(result):
    """The one line the tool prints on stderr for an error, after TensorFlow's own logs."""
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    assert "Fashion-MNIST is in" not in result.stdout
    return lines[0]


@pytest.mark.parametrize("cut", [10, 5000])
def test_a_truncated_gz_is_refused_naming_the_file(source_dir, tmp_path, cut):
    # Before: TFDS's ExtractError "Compressed file ended before the end-of-stream marker
    # was reached", as a traceback, mid-conversion (10 bytes: gzip's EOFError).
    path = source_dir / fashion_mnist.TRAIN_IMAGES
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is damaged \(.*\): .*"
                                         r"apt-get install --reinstall dataset-fashion-mnist"):
        fashion_mnist.prepare_fashion_mnist(source_dir=source_dir, data_dir=tmp_path / "tfds")
    assert not (tmp_path / "tfds").exists()  # refused before writing anything


def test_an_idx_file_shorter_than_its_header_says_is_refused(source_dir, tmp_path):
    # A whole gzip stream of a cut IDX file: the header promises 12 images.
    path = source_dir / fashion_mnist.TRAIN_IMAGES
    _fashion_mnist_test._write_idx(  # pylint: disable=protected-access
        path, 0x00000803, np.zeros([12, 28, 28], np.uint8))
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-100]))
    with pytest.raises(ValueError, match=r"holds 9,308 bytes of images after its header, "
                                         r"which promises 12 images \(9,408 bytes\)"):
        fashion_mnist.prepare_fashion_mnist(source_dir=source_dir, data_dir=tmp_path / "tfds")


@pytest.mark.parametrize("where", ["data_dir", "dataset_folder", "parent"])
def test_a_data_dir_that_is_a_file_is_refused(source_dir, tmp_path, where):
    # Before: "NotADirectoryError: [Errno 20] Not a directory: '.../fashion_mnist'", as a
    # traceback, after the conversion had started.
    the_file = tmp_path / "a_file"
    data_dir = {"data_dir": the_file, "dataset_folder": tmp_path / "tfds",
                "parent": the_file / "tfds"}[where]
    if where == "dataset_folder":
        data_dir.mkdir()
        the_file = data_dir / "fashion_mnist"
    the_file.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=rf"^{re.escape(str(the_file))} is a file, not "
                                                 r"a folder: .* Pass --data_dir="):
        fashion_mnist.prepare_fashion_mnist(source_dir=source_dir, data_dir=data_dir)
    assert the_file.read_text() == "not a folder"


@pytest.mark.parametrize("garbage", [b"garbage{", b"\xff\xfe\x00 binary", b"[]"])
def test_a_garbage_dataset_info_json_is_refused_naming_it(prepared, tmp_path, garbage):
    # Before: google.protobuf's ParseError "Failed to load JSON: Expecting value" (or a
    # RuntimeError, or an AssertionError on the version), as a traceback, from the tool
    # and from every run on that data_dir (python -m tfdp.main --gin_file=fashion_mnist.gin).
    data_dir = tmp_path / "tfds"
    shutil.copytree(prepared, data_dir)
    info = data_dir / "fashion_mnist" / "3.0.1" / "dataset_info.json"
    info.write_bytes(garbage)
    message = (rf"^{re.escape(str(info))} is not a valid TFDS dataset_info\.json \(.+\): the "
               rf"dataset in {re.escape(str(info.parent))} is damaged\. Delete that folder and "
               rf"run python tools/prepare_fashion_mnist\.py --data_dir={re.escape(str(data_dir))}"
               r" again\.$")
    with pytest.raises(errors.DatasetNotFoundError, match=message):
        fashion_mnist.prepare_fashion_mnist(source_dir="/nonexistent", data_dir=data_dir)
    with pytest.raises(errors.DatasetNotFoundError, match=message):  # what a run reads
        data.TFDSSource("fashion_mnist", "train", data_dir=data_dir)
    assert info.read_bytes() == garbage  # nothing deleted


def _drop_root_privileges():
    """A command prefix under which root obeys file permissions (no CAP_DAC_OVERRIDE)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only folder cannot be made")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


@pytest.mark.slow
def test_a_read_only_data_dir_is_refused_in_one_line(source_dir, tmp_path):
    # Before: "PermissionError: [Errno 13] Permission denied: '.../fashion_mnist'", as a
    # traceback.
    data_dir = tmp_path / "read_only"
    data_dir.mkdir()
    data_dir.chmod(0o555)
    try:
        result, seconds = _run_tool(source_dir, data_dir, prefix=_drop_root_privileges())
    finally:
        data_dir.chmod(0o755)
    line = _error_line(result)
    assert re.search(rf"^error: Cannot write Fashion-MNIST into {re.escape(str(data_dir))}: "
                     r"it is not writable by this user \(permission denied\)\. Pass "
                     r"--data_dir=<a folder you can write>", line), line
    assert os.listdir(data_dir) == [] and seconds < 60


def _file_size_limit(limit):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_full_disk_is_one_line_and_leaves_nothing_behind(source_dir, tmp_path):
    # Before: 'RuntimeError: Failed to finalize writing of split "train": write() failed:
    # File too large', as a traceback, with an empty fashion_mnist folder left behind.
    # `ulimit -f 12` lets the IDX files be gunzipped (9.4 kB) but not the shards be written.
    data_dir = tmp_path / "tfds"
    result, seconds = _run_tool(source_dir, data_dir, preexec_fn=_file_size_limit(12 * 1024))
    line = _error_line(result)
    assert re.search(rf"^error: Could not write Fashion-MNIST into {re.escape(str(data_dir))}: "
                     r".*File too large.*\. This run's partial files were removed\. Free "
                     r"space .* or pass --data_dir=", line), line
    assert not data_dir.exists() and seconds < 60


def test_no_space_left_leaves_an_existing_data_dir_as_it_was(source_dir, tmp_path, monkeypatch):
    # ENOSPC where TFDS gunzips the IDX files; the data_dir the user made, and what it
    # holds, stay.
    data_dir = tmp_path / "tfds"
    (data_dir / "other_dataset").mkdir(parents=True)

    def no_space(unused_data, dest_path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dest_path)

    monkeypatch.setattr(extractor, "_copy", no_space)  # TFDS's write of a gunzipped file
    with pytest.raises(OSError, match=r"Could not write Fashion-MNIST into .*: No space left "
                                      r"on device \(.*/extracted/.*\)\. This run's partial files "
                                      r"were removed\. Free space"):
        fashion_mnist.prepare_fashion_mnist(source_dir=source_dir, data_dir=data_dir)
    assert sorted(os.listdir(data_dir)) == ["other_dataset"]
