"""The file operations of a workdir, for local folders and object stores alike.

Every file operation on a run's workdir goes through these few helpers, so
a workdir may be a local (or mounted) folder or a `tf.io.gfile` URL: gs://
(Cloud Storage) on a TPU pod, ram:// (TensorFlow's in-memory file system)
in the tests. Local paths keep the POSIX operations they always had (atomic
rename, fsync: `tfdp.atomic_file`); URLs go through `tf.io.gfile`, imported only then, so the
CLI checks a local workdir without importing TensorFlow.

An object store has no atomic rename and no partial objects: an object
appears whole when its upload ends, or not at all. So `write_whole` writes a
file to a temporary name and renames it on a local disk, and writes one
object in one go on a URL; either way a reader sees the old content (or
none) or the new content, never a part.
"""

import contextlib
import glob as glob_lib
import os
import re
import shutil

from tfdp import atomic_file

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(path):
    """True for `scheme://...` (gs://, ram://, s3://), False for a local path."""
    return bool(_URL.match(os.fspath(path)))


def scheme(path):
    """"gs", "ram", ... for a URL; "" for a local path."""
    return os.fspath(path).split("://", 1)[0].lower() if is_url(path) else ""


def _gfile():
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    return tf.io.gfile


def join(path, *parts):
    """Joins with "/" (os.path.join on a local path)."""
    if is_url(path):
        return "/".join([os.fspath(path).rstrip("/"), *parts])
    return os.path.join(path, *parts)


def parent(path):
    """The folder that holds `path` (a URL stays a URL; a trailing "/" is ignored)."""
    path = os.fspath(path)
    if is_url(path):
        return path.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.normpath(path))


def exists(path):
    """True if a file, folder (or, locally, a dangling symlink) is at `path`."""
    return _gfile().exists(path) if is_url(path) else os.path.lexists(path)


def isdir(path):
    return _gfile().isdir(path) if is_url(path) else os.path.isdir(path)


def listdir(path):
    """The names in a folder, without trailing slashes."""
    if is_url(path):
        return [name.rstrip("/") for name in _gfile().listdir(path)]
    return os.listdir(path)


_write_guards = {}  # URL prefix -> a check that raises once this process may not write there


@contextlib.contextmanager
def writes_guarded(url, check):
    """While the context lasts, every write below the URL `url` first calls `check()`.

    The lease of a gs:// workdir (`tfdp.workdir.locked`): once another run
    has taken the workdir over, `check` raises, and no object under it is
    created, replaced or removed by this process from then on, whichever
    code path writes (an export's upload, a report, a feature cache).
    `check_writable` runs the same check without writing. Local paths are
    not guarded here (`tfdp.workdir.check_held` checks the folder's identity).
    """
    key = os.fspath(url).rstrip("/")
    _write_guards[key] = check
    try:
        yield
    finally:
        _write_guards.pop(key, None)


def check_writable(path):
    """Calls the guard of every guarded URL that `path` is, or is under (`writes_guarded`).

    Every write below a URL calls it; `tfdp.workdir.check_held` calls it for a
    URL workdir at each step. A no-op for a local path or an unguarded URL.

    Raises:
      whatever the guard raises (a lost lease: `tfdp.workdir.WorkdirLockedError`).
    """
    path = os.fspath(path).rstrip("/")
    if not _write_guards or not is_url(path):
        return
    for prefix, check in list(_write_guards.items()):
        if path == prefix or path.startswith(prefix + "/"):
            check()


def makedirs(path):
    if is_url(path):
        check_writable(path)
        _gfile().makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def glob(pattern_dir, pattern):
    """The paths in folder `pattern_dir` whose name matches the glob `pattern`."""
    if is_url(pattern_dir):
        return sorted(_gfile().glob(join(pattern_dir, pattern)))
    return sorted(glob_lib.glob(os.path.join(glob_lib.escape(pattern_dir), pattern)))


def read_bytes(path):
    if is_url(path):
        with _gfile().GFile(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def read_chunks(path, chunk_bytes=1 << 20):
    """The bytes of the file at `path`, in chunks of at most `chunk_bytes` (a generator)."""
    opener = _gfile().GFile if is_url(path) else open
    with opener(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            if not chunk:
                return
            yield chunk


def stat_length(path):
    """The size of the file at `path`, in bytes."""
    return _gfile().stat(path).length if is_url(path) else os.stat(path).st_size


def read_range(path, offset, length):
    """At most `length` bytes of the file at `path` from byte `offset`."""
    opener = _gfile().GFile if is_url(path) else open
    with opener(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def walk_files(path):
    """Every file under the folder `path`, as `(full path, path relative to it)`, sorted.

    Locally, a symbolic link to a folder is listed as an entry itself (it is
    not followed: it could loop), so that nothing under `path` goes unlisted.
    """
    if is_url(path):
        walked = ((root, files) for root, _, files in _gfile().walk(path))
    else:
        walked = ((root, files + [d for d in dirs if os.path.islink(os.path.join(root, d))])
                  for root, dirs, files in os.walk(path))
    found = []
    base = os.fspath(path).rstrip("/")
    for root, files in walked:
        for name in files:
            full = join(root, name.rstrip("/"))
            found.append((full, os.fspath(full)[len(base):].lstrip("/")))
    return sorted(found)


def read_text(path):
    return read_bytes(path).decode("utf-8")


def write_whole(path, content):
    """Writes `content` (str or bytes) to `path` so that no reader sees a part of it.

    Local: `tfdp.atomic_file` (a temporary file beside `path`, flushed to
    disk, renamed over `path`). URL: one object, uploaded in one write.
    """
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    _write_with(path, lambda f: f.write(data))


def _write_with(path, write):
    """`write(f)` into a binary file object that replaces `path` whole (see `write_whole`)."""
    if is_url(path):
        check_writable(path)
        if scheme(path) == "ram" and _gfile().exists(path):
            # TensorFlow's ram:// appends to an existing file instead of replacing it
            # (measured with TF 2.21); an object store replaces the object.
            _gfile().remove(path)
        with _gfile().GFile(path, "wb") as f:
            write(f)
        return
    with atomic_file.replacing(path) as f:
        write(f)


def write_array(path, array):
    """Writes a NumPy array as a .npy file so that no reader sees a part of it.

    As `write_whole`, without a second copy of the array in memory: locally
    through `tfdp.atomic_file`; on a URL, one object.
    """
    import numpy as np  # pylint: disable=g-import-not-at-top

    _write_with(path, lambda f: np.save(f, array, allow_pickle=False))


def read_array(path):
    """The NumPy array of a .npy file written by `write_array` (no pickled objects)."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    opener = _gfile().GFile if is_url(path) else open
    with opener(path, "rb") as f:
        return np.load(f, allow_pickle=False)


def append_text(path, text):
    """Appends a line (or more) to a text file. On an object store the object is rewritten."""
    if is_url(path):
        check_writable(path)
        with _gfile().GFile(path, "a") as f:
            f.write(text)
        return
    with open(path, "a") as f:
        f.write(text)


def copy(source, target):
    """Copies a file (a local one into a URL, or any pair), replacing `target`."""
    if is_url(source) or is_url(target):
        check_writable(target)
        if scheme(target) == "ram" and _gfile().exists(target):
            _gfile().remove(target)  # ram:// would append (see write_whole)
        _gfile().copy(source, target, overwrite=True)
    else:
        shutil.copy(source, target)


def move(source, target):
    """Moves a local file to `target`: an atomic rename locally, one whole object on a URL."""
    if is_url(target):
        copy(source, target)
        os.unlink(source)
    else:
        atomic_file.move(source, target)


def remove(path):
    """Removes a file; nothing if it is not there. Raises OSError otherwise."""
    if is_url(path):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        check_writable(path)
        with contextlib.suppress(tf.errors.NotFoundError):
            _gfile().remove(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def rmtree(path):
    """Removes a folder and everything in it; errors are ignored (best effort)."""
    if is_url(path):
        check_writable(path)
        with contextlib.suppress(Exception):  # pylint: disable=broad-except
            _gfile().rmtree(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def remove_any(path):
    """Removes a file or a folder tree, ignoring errors (not a guard's: `writes_guarded`)."""
    check_writable(path)
    if isdir(path):
        rmtree(path)
    else:
        with contextlib.suppress(Exception):  # pylint: disable=broad-except
            remove(path)


def rmdir_if_empty(path):
    """Removes an empty folder (on an object store, its placeholder); else nothing."""
    check_writable(path)
    with contextlib.suppress(Exception):  # pylint: disable=broad-except
        if is_url(path):
            if isdir(path) and not listdir(path):
                _gfile().rmtree(path)
        else:
            os.rmdir(path)


# TensorFlow reads a checkpoint prefix as a glob pattern (TensorSliceReader,
# latest_checkpoint), so a workdir named `sweep[lr=0.5]` would hold checkpoints it cannot find.
_GLOB_CHARACTERS = re.compile(r"[\[\]*?{}]")
_aliases = {}  # absolute path of a folder this process holds -> /proc/self/fd/N naming it


def has_glob_characters(path):
    """Whether TensorFlow would read `path` as a glob pattern: `[`, `]`, `*`, `?`, `{`, `}`."""
    return bool(_GLOB_CHARACTERS.search(os.fspath(path)))


def user_path(text):
    """`text` with each `tf_path` alias named by its folder's path again (for messages)."""
    for folder, alias in _aliases.items():
        text = text.replace(alias, folder)
    return text


def tf_path(path):
    """`path` as TensorFlow's checkpoint code must get it: without glob metacharacters.

    A local path holding `[`, `]`, `*`, `?`, `{` or `}` inside a folder this
    process holds (`folder_aliased`: the run's locked workdir) is named through
    the folder's open descriptor (`/proc/self/fd/N/...`), which is the same
    folder and has none; any other path is returned as it is.
    """
    path = os.fspath(path)
    if is_url(path) or not _GLOB_CHARACTERS.search(path):
        return path
    absolute = os.path.abspath(path)
    for folder, alias in _aliases.items():
        if absolute == folder or absolute.startswith(folder + os.sep):
            named = alias + absolute[len(folder):]
            if not _GLOB_CHARACTERS.search(named):
                return named
    return path


@contextlib.contextmanager
def folder_aliased(path, folder_fd=None):
    """While the context lasts, `tf_path` names paths in the local folder `path` through it.

    A local folder whose path holds `[`, `]`, `*`, `?`, `{` or `}` is named
    through an open descriptor of it until the context ends: `folder_fd`
    (the run's locked workdir, `tfdp.workdir.locked`), or one opened here
    (a backbone's workdir, the chief's workdir on another worker, a workdir
    whose folder no lock holds). Any other path, or a folder already
    aliased, is left as it is.

    Args:
      path: a local folder, or a URL (left as it is).
      folder_fd: an open descriptor of the folder, or None to open one; the
        caller keeps and closes its own.
    """
    path = os.fspath(path)
    key = os.path.abspath(path)
    if (is_url(path) or not _GLOB_CHARACTERS.search(path) or not os.path.isdir(path)
            or key in _aliases):
        yield
        return
    folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY) if folder_fd is None else folder_fd
    try:
        _aliases[key] = f"/proc/self/fd/{folder}"
        yield
    finally:
        _aliases.pop(key, None)
        if folder_fd is None:
            os.close(folder)


def checkpoint_reader(prefix):
    """A `tf.train.CheckpointReader` of the checkpoint `prefix` (e.g. WORKDIR/checkpoints/ckpt-4).

    What `tf.train.load_checkpoint(prefix)` returns, without its first step
    (which asks whether `prefix` is a folder, and TensorFlow's ram:// calls
    every path prefix a folder: measured with TF 2.21).

    Raises:
      tf.errors.OpError, ValueError: the checkpoint cannot be read.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    return tf.compat.v1.train.NewCheckpointReader(tf_path(prefix))
