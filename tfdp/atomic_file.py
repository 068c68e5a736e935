"""Atomic writes of local files: a reader sees the old content or the new, never a part.

Every file tfdp replaces on a local (or mounted) disk is written by
`replacing` (or `write_bytes`, `write_text`):

1. to a temporary file of a unique name in the target's folder
   (`NAME.tmp-XXXXXXXX`: the same file system, so the rename is atomic, and
   a name of its own, so two writers never share one), created with the
   permissions of the file it replaces (else the umask's);
2. flushed to disk (`os.fsync`);
3. renamed over the target (`os.replace`);
4. then the folder is flushed too, so that the rename itself survives a
   crash or a power loss.

On any error the temporary file is removed and the target is left as it
was. `move` renames a finished file into place the same way (steps 3 and 4).

Pure Python, with no TensorFlow and no other part of tfdp, so that
`tfdp.accounting` writes its ledger with it too. URLs (gs://, ram://) are
not handled here: `tfdp.storage` writes each as one object.
"""

import contextlib
import errno
import os
import secrets

# A temporary file is named `NAME + TEMPORARY_INFIX + 8 hex digits`, beside NAME.
TEMPORARY_INFIX = ".tmp-"
# The errors of a file system that cannot flush a folder (some network and FUSE mounts).
_NO_FOLDER_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES,
                   errno.EPERM, errno.EISDIR)


@contextlib.contextmanager
def replacing(path, mode="wb", encoding="utf-8"):
    """A file whose content replaces `path` whole once the block ends without an error.

    Args:
      path: the local file to create or replace (str or os.PathLike).
      mode: "wb" for bytes, "w" for text.
      encoding: the encoding of text (mode "w").

    Yields:
      The temporary file, open for writing.

    Raises:
      ValueError: `mode` is neither "w" nor "wb".
      OSError: the temporary file cannot be created, written, flushed or
        renamed over `path` (then `path` is unchanged and the temporary file
        removed). Whatever the block raises is raised again, after the same
        clean-up.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}.")
    path = os.fspath(path)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, mode, **({"encoding": encoding} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    sync_folder(os.path.dirname(path))


def write_bytes(path, data):
    """Replaces the file `path` with `data` atomically (see the module docstring).

    Args:
      path: the local file to create or replace.
      data: bytes (or any bytes-like object).

    Raises:
      OSError: as `replacing`; `path` is then unchanged.
    """
    with replacing(path, "wb") as f:
        f.write(data)


def write_text(path, text, encoding="utf-8"):
    """Replaces the file `path` with `text` atomically (see the module docstring).

    Args:
      path: the local file to create or replace.
      text: a str.
      encoding: its encoding in the file.

    Raises:
      OSError: as `replacing`; `path` is then unchanged.
    """
    with replacing(path, "w", encoding=encoding) as f:
        f.write(text)


def move(source, target):
    """Renames the local file `source` over `target` (atomic on one file system), durably.

    Args:
      source: a complete file, already flushed to disk.
      target: its new path, replaced if it exists.

    Raises:
      OSError: as `os.replace` (e.g. the two are on different file systems).
    """
    os.replace(source, target)
    sync_folder(os.path.dirname(os.fspath(target)))


def sync_folder(folder):
    """Flushes a folder's entries (a rename into it) to disk, where the file system can.

    Args:
      folder: a local folder ("" for the current one).

    Raises:
      OSError: an error other than the file system's refusal to flush a
        folder (which is ignored: the rename is done, only not yet durable).
    """
    try:
        fd = os.open(folder or os.curdir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        if e.errno in _NO_FOLDER_SYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_FOLDER_SYNC:
            raise
    finally:
        os.close(fd)


def _create_temporary(path):
    """`(fd, name)` of a new file beside `path`, with the permissions of `path` if it exists."""
    try:
        permissions = os.stat(path).st_mode & 0o777  # never setuid, setgid or sticky
    except OSError:
        permissions = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = f"{path}{TEMPORARY_INFIX}{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask applies
        except FileExistsError:
            continue
        if permissions is not None:
            with contextlib.suppress(OSError):  # a file system without modes (some mounts)
                os.fchmod(fd, permissions)
        return fd, tmp
    raise FileExistsError(errno.EEXIST, "No free temporary name beside the file", path)
