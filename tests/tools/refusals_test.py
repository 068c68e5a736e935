"""Tools refuse what they cannot do in one line, before any work."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tool, args, message", [
    # Ran out of memory (each image is held whole).
    ("make_synthetic_imagenet.py", ["--image_size=100000"], "--image_size=100000: give 1 to 4096"),
    # Exited 0 and printed nothing.
    ("index_jpeg_folder.py", ["--split="], "names no split folder"),
])
def test_a_tool_refuses_in_one_line(tmp_path, tool, args, message):
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", tool), f"--data_dir={tmp_path}", *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []  # nothing written
