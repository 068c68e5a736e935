"""Atomic writes of local files (tfdp.atomic_file): whole, durable, nothing left on an error."""

import errno
import os
import stat

import pytest

from tfdp import atomic_file


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    atomic_file.write_text(path, "old")
    atomic_file.write_text(path, "new ✓")
    assert path.read_text(encoding="utf-8") == "new ✓"
    atomic_file.write_bytes(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    with pytest.raises(OSError, match="No space left"):
        with atomic_file.replacing(path, "w") as f:
            f.write("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.json"]


def test_the_temporary_is_unique_beside_the_file_and_synced_before_the_rename(
        tmp_path, monkeypatch):
    synced, path = [], tmp_path / "FINISHED"
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(
        f"/proc/self/fd/{fd}")) or real_fsync(fd))
    with atomic_file.replacing(path) as first, atomic_file.replacing(path) as second:
        names = [os.path.basename(os.readlink(f"/proc/self/fd/{f.fileno()}"))
                 for f in (first, second)]
        first.write(b"1")
        second.write(b"2")
    assert names[0] != names[1]
    assert all(n.startswith("FINISHED" + atomic_file.TEMPORARY_INFIX) for n in names)
    assert path.read_bytes() == b"1"  # the outer block ends last
    # Each file before its rename, and the folder after it.
    assert [os.path.basename(p) for p in synced] == [
        names[1], tmp_path.name, names[0], tmp_path.name]


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text("a")
    os.chmod(path, 0o640)
    atomic_file.write_text(path, "b")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def test_a_folder_that_cannot_be_synced_is_no_error(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_file.write_text(tmp_path / "a", "x")
    assert (tmp_path / "a").read_text() == "x"


def test_move_renames_into_place_and_other_modes_are_refused(tmp_path):
    (tmp_path / "src").write_text("report")
    atomic_file.move(tmp_path / "src", tmp_path / "dst")
    assert os.listdir(tmp_path) == ["dst"] and (tmp_path / "dst").read_text() == "report"
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"):
        with atomic_file.replacing(tmp_path / "dst", "a"):
            pass
