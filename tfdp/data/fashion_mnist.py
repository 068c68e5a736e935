"""Local Fashion-MNIST IDX files -> the stock TFDS `fashion_mnist` dataset.

TFDS cannot download here, but Debian's `dataset-fashion-mnist` package installs
the original IDX files. `prepare_fashion_mnist` converts them ONCE, with the
stock TFDS builder's own reading and writing code, into `data_dir`, after which
`tfds.data_source("fashion_mnist", data_dir=data_dir, download=False)` (and so
`tfdp.data.TFDSSource`) reads them like any other prepared TFDS dataset, in the
ArrayRecord format. CIFAR-10 and ImageNet take the same reading path, prepared
elsewhere with `tfds build --file_format=array_record`.

How: `_LocalFashionMNIST` subclasses the stock
`tensorflow_datasets.image_classification.mnist.FashionMNIST` under the same
name and version, and gives the stock `_split_generators` a download manager
whose "download" of a URL is the local file with the same basename (then the
real `DownloadManager.extract` gunzips it). No code of the stock builder is
copied. The stock builder hardcodes 60000 / 10000 examples per split; we
replace those with the counts in the IDX headers, which equal them for the real
files and let the tests convert a few synthetic examples.
"""

import errno
import gzip
import os
import pathlib
import posixpath
import shutil
import struct
import tempfile
import urllib.parse
import zlib

from absl import logging
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.image_classification import mnist

from tfdp.data import preparation
from tfdp.data import tfds_source

DATASET_NAME = preparation.FASHION_MNIST
DEFAULT_SOURCE_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
INSTALL_COMMAND = preparation.INSTALL_COMMAND
REINSTALL_COMMAND = preparation.REINSTALL_COMMAND

# The four IDX files, named as in the Fashion-MNIST release (and the Debian
# package); the stock builder asks for the same basenames.
TRAIN_IMAGES = "train-images-idx3-ubyte.gz"
TRAIN_LABELS = "train-labels-idx1-ubyte.gz"
TEST_IMAGES = "t10k-images-idx3-ubyte.gz"
TEST_LABELS = "t10k-labels-idx1-ubyte.gz"
SOURCE_FILES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)

# IDX magic numbers: 0x0000 (two zero bytes), 0x08 (uint8 data), number of dims.
_IDX_IMAGES_MAGIC = 0x00000803  # uint8, 3 dims: [num_examples, rows, cols]
_IDX_LABELS_MAGIC = 0x00000801  # uint8, 1 dim: [num_examples]
_IMAGE_SIZE = 28
# Random access (tfdp.data.TFDSSource) needs ArrayRecord; TFDS's default is TFRecord.
FILE_FORMAT = "array_record"


def prepare_fashion_mnist(source_dir=DEFAULT_SOURCE_DIR, data_dir=None):
    """Converts the local Fashion-MNIST IDX files into the TFDS `fashion_mnist`.

    Writes `<data_dir>/fashion_mnist/<version>/` (ArrayRecord shards and
    `dataset_info.json`) exactly as `tfds build fashion_mnist
    --file_format=array_record` would, with the splits `train` and `test`.
    ArrayRecord is the format TFDS reads by index (`tfds.data_source`), which
    is how tfdp reads every dataset. Idempotent: if the dataset is already
    prepared in `data_dir` as ArrayRecord, with every shard whole, nothing is
    written (the source files are not needed); a folder with a shard missing
    or cut short is refused (delete it and run again); a copy prepared by an older tfdp as TFRecord
    only is deleted and rewritten as ArrayRecord.
    Every source file is read whole before anything is written (a gzip stream cut
    short, or fewer bytes than its header promises, is refused), and so is a
    `data_dir` that is a file or cannot be written. The write is atomic (TFDS
    writes to a temporary folder and renames it), so an interrupted conversion
    leaves nothing half-written; a failed one (a full disk) also removes the
    empty folders it created, and never what was there before. Gunzipped copies
    of the IDX files go to a temporary folder that is deleted afterwards. The
    real dataset (70000 images) takes about 20 s on 2 CPU cores and 38 MB of disk.

    Args:
      source_dir: folder holding the four gzipped IDX files
        `train-images-idx3-ubyte.gz`, `train-labels-idx1-ubyte.gz`,
        `t10k-images-idx3-ubyte.gz`, `t10k-labels-idx1-ubyte.gz` (uint8 28x28
        images and uint8 labels 0..9). Defaults to where the Debian package
        `dataset-fashion-mnist` installs them.
      data_dir: TFDS data directory to write into; None means the TFDS default
        (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`).

    Returns:
      The TFDS data directory (pathlib.Path) holding the dataset: pass it as
      `data_dir` to `tfds.data_source` / `tfdp.data.TFDSSource`.

    Raises:
      tfdp.data.DatasetNotFoundError: the folder is already there but a
        shard is missing or corrupt, or its dataset_info.json is not one; the
        message names the file and says to delete the folder and run again.
      FileNotFoundError: a source file is missing; the message names it and says
        to run `apt-get update && apt-get install dataset-fashion-mnist` or to
        pass `--source_dir`.
      ValueError: a source file is not a valid Fashion-MNIST IDX file (wrong magic
        number, image size other than 28x28, image and label counts differ, a
        gzip stream cut short or corrupt, or fewer bytes than its header says).
      NotADirectoryError: `data_dir`, a folder above it or its `fashion_mnist`
        folder is a file.
      PermissionError: `data_dir` cannot be written (permissions, or a read-only
        file system), found before anything is converted.
      OSError: a write failed during the conversion (no space left, a file size
        limit); this run's partial files are removed first.
    """

    builder = tfds_source.open_builder(  # as on disk; a garbage dataset_info.json: refused
        lambda: _LocalFashionMNIST(source_dir=source_dir, data_dir=data_dir), DATASET_NAME,
        data_dir)
    root = pathlib.Path(builder.data_dir_root)
    dataset_dir = root / DATASET_NAME
    _check_folders(dataset_dir)
    if builder.is_prepared() and _has_array_record(builder):
        for split in builder.info.splits:  # a shard missing or cut short: refused, named
            tfds_source.check_split_files(builder, split)
        return root
    source_dir = pathlib.Path(source_dir)
    missing = [name for name in SOURCE_FILES if not (source_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST source file(s) {', '.join(missing)} not found in "
            f"{source_dir}. Install them with `{INSTALL_COMMAND}` (they go to "
            f"{DEFAULT_SOURCE_DIR}), or pass --source_dir (source_dir=) pointing "
            f"to a folder with the files {', '.join(SOURCE_FILES)}."
        )
    for images_name, labels_name in ((TRAIN_IMAGES, TRAIN_LABELS), (TEST_IMAGES, TEST_LABELS)):
        num_images = _check_idx_file(source_dir / images_name, _IDX_IMAGES_MAGIC)
        num_labels = _check_idx_file(source_dir / labels_name, _IDX_LABELS_MAGIC)
        if num_images != num_labels:
            raise ValueError(
                f"{source_dir / images_name} holds {num_images} images but "
                f"{source_dir / labels_name} holds {num_labels} labels; the two files "
                "must come from the same Fashion-MNIST split. Reinstall with "
                f"`{INSTALL_COMMAND}`."
            )
    _check_writable(dataset_dir)
    if builder.is_prepared():  # an older conversion, TFRecord only: rewrite it
        logging.warning("Rewriting %s as ArrayRecord (tfdp reads examples by index).",
                        builder.data_dir)
        shutil.rmtree(builder.data_dir)
    builder = _LocalFashionMNIST(source_dir=source_dir, data_dir=data_dir, file_format=FILE_FORMAT)
    created = [folder for folder in (dataset_dir, *dataset_dir.parents) if not folder.exists()]
    before = set(os.listdir(dataset_dir)) if dataset_dir.is_dir() else set()
    try:
        with tempfile.TemporaryDirectory(prefix="tfdp_fashion_mnist_") as download_dir:
            builder.download_and_prepare(
                download_dir=download_dir,
                download_config=tfds.download.DownloadConfig(try_download_gcs=False),
            )
    except Exception as e:  # pylint: disable=broad-except  (re-raised unless a write failed)
        failure = _write_failure(e)
        _remove_partial_files(dataset_dir, before, created)
        if failure is None:
            raise
        reason, no_space = failure
        hint = (f"Free space (the real dataset takes 38 MB there, and 55 MB of gunzipped "
                f"copies in {tempfile.gettempdir()} while it runs), or pass --data_dir=<a "
                "folder on a disk with room>." if no_space else
                "Pass --data_dir=<a folder you can write>, or make it writable.")
        raise OSError(f"Could not write Fashion-MNIST into {root}: {reason}. This run's "
                      f"partial files were removed. {hint}") from None
    return root


def _check_folders(dataset_dir):
    """Refuses a file where `dataset_dir` or a folder above it should be.

    Raises:
      NotADirectoryError: the first existing path on the way is a file; the message
        names it.
    """
    for path in (dataset_dir, *dataset_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise NotADirectoryError(
                    f"{path} is a file, not a folder: Fashion-MNIST goes into "
                    f"{dataset_dir}. Pass --data_dir=<a folder> (data_dir=; it is created if "
                    f"missing), or move {path} away.")
            return


def _check_writable(dataset_dir):
    """Refuses, before any conversion, a `dataset_dir` that cannot be created or written.

    Raises:
      PermissionError: the nearest existing folder of `dataset_dir` is not writable
        (permissions, or a read-only file system); the message says which.
    """
    folder = next(path for path in (dataset_dir, *dataset_dir.parents) if path.exists())
    if os.access(folder, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = ("on a read-only file system" if read_only else
           "not writable by this user (permission denied)")
    where = "it" if folder == dataset_dir.parent else folder
    raise PermissionError(
        f"Cannot write Fashion-MNIST into {dataset_dir.parent}: {where} is {why}. Pass "
        "--data_dir=<a folder you can write> (data_dir=; e.g. ~/tensorflow_datasets), or "
        "make it writable.")


# Errors of a write that the disk or the file system refused.
_WRITE_ERRNOS = {errno.ENOSPC: True, errno.EFBIG: True, errno.EDQUOT: True,
                 errno.EROFS: False, errno.EACCES: False, errno.EPERM: False}


def _write_failure(error):
    """(reason, no_space) if `error` is a refused write, else None.

    TFDS wraps the OSError of a gunzip in an ExtractError, and ArrayRecord's C++ writer
    raises a RuntimeError whose text holds the system's message ("write() failed: No
    space left on device").
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS:
            where = f" ({error.filename})" if error.filename else ""
            return f"{os.strerror(error.errno)}{where}", _WRITE_ERRNOS[error.errno]
        if isinstance(error, RuntimeError):
            for code, no_space in _WRITE_ERRNOS.items():
                if os.strerror(code) in str(error):
                    return " ".join(str(error).split()), no_space
        error = error.__cause__ or error.__context__
    return None


def _remove_partial_files(dataset_dir, before, created):
    """Removes what a failed conversion left: its `incomplete.*` folders, then the empty
    folders it created (`created`, deepest first). Nothing that was there `before` goes."""
    if dataset_dir.is_dir():
        for entry in dataset_dir.iterdir():
            if entry.name not in before and entry.name.startswith("incomplete."):
                shutil.rmtree(entry, ignore_errors=True)
    for folder in created:
        try:
            folder.rmdir()  # only if empty
        except OSError:
            pass


def _has_array_record(builder):
    return tfds.core.file_adapters.FileFormat.ARRAY_RECORD in (
        builder.info.available_file_formats())


_NUM_CLASSES = 10


def _check_idx_file(path, magic):
    """The example count in an IDX file's header, once the whole file is read and checked.

    The real train images take about 0.3 s (26 MB gzipped, 47 MB raw).

    Raises:
      ValueError: a gzip stream cut short or corrupt, a header as in
        `_read_idx_num_examples`, fewer or more bytes than the header promises,
        or a label outside 0-9 (named, with its example: no data is printed);
        the message names the file and says to reinstall it.
    """
    path = pathlib.Path(path)
    reinstall = f"Reinstall the files with `{REINSTALL_COMMAND}` (or copy the file again)."
    try:
        num_examples = _read_idx_num_examples(path, magic)
        with open(path, "rb") as f:
            is_gzip = f.read(2) == b"\x1f\x8b"
        size, labels = 0, b""
        with (gzip.open if is_gzip else open)(path, "rb") as f:
            while chunk := f.read(1 << 20):
                if magic == _IDX_LABELS_MAGIC:  # one byte a label (60,000 at most: small)
                    labels += chunk
                size += len(chunk)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"{path} is damaged ({e}): its gzip stream is cut short or corrupt. "
                         f"{reinstall}") from None
    kind, example_size = (("images", _IMAGE_SIZE * _IMAGE_SIZE) if magic == _IDX_IMAGES_MAGIC
                          else ("labels", 1))
    body = size - 4 * (1 + (magic & 0xFF))
    if body != num_examples * example_size:
        raise ValueError(
            f"{path} holds {body:,} bytes of {kind} after its header, which promises "
            f"{num_examples:,} {kind} ({num_examples * example_size:,} bytes): the file is cut "
            f"short or damaged. {reinstall}")
    labels = labels[8:]  # after the header: magic and count
    bad = next((i for i, label in enumerate(labels) if label >= _NUM_CLASSES), None)
    if bad is not None:
        raise ValueError(
            f"{path}: label {labels[bad]} of example {bad:,} is not a Fashion-MNIST class "
            f"(0 to {_NUM_CLASSES - 1}). {reinstall}")
    return num_examples


def _read_idx_num_examples(path, magic):
    """Returns the example count in an IDX file's header, checking the header.

    Args:
      path: a gzipped or raw IDX file (told apart by the gzip magic bytes, since
        TFDS names its gunzipped copies `GZIP.<name>.gz`).
      magic: the expected magic number (`_IDX_IMAGES_MAGIC` or `_IDX_LABELS_MAGIC`).

    Returns:
      num_examples (int), the first dimension in the header.

    Raises:
      ValueError: wrong magic number, or images that are not 28x28.
    """
    path = pathlib.Path(path)
    with open(path, "rb") as f:
        is_gzip = f.read(2) == b"\x1f\x8b"
    with (gzip.open if is_gzip else open)(path, "rb") as f:
        num_dims = magic & 0xFF
        header = f.read(4 * (1 + num_dims))
    if len(header) != 4 * (1 + num_dims):
        raise ValueError(f"{path} is too short to hold an IDX header.")
    found_magic, *dims = struct.unpack(f">{1 + num_dims}I", header)
    if found_magic != magic:
        raise ValueError(
            f"{path} has IDX magic number {found_magic:#010x}, expected {magic:#010x} "
            f"({'images' if magic == _IDX_IMAGES_MAGIC else 'labels'}); check that "
            "the file is the right Fashion-MNIST file."
        )
    if magic == _IDX_IMAGES_MAGIC and dims[1:] != [_IMAGE_SIZE, _IMAGE_SIZE]:
        raise ValueError(
            f"{path} holds {dims[1]}x{dims[2]} images; Fashion-MNIST images are "
            f"{_IMAGE_SIZE}x{_IMAGE_SIZE}."
        )
    return dims[0]


class _LocalDownloadManager:
    """Stands in for the DownloadManager: a URL "downloads" to the local file.

    Only `download_and_extract` (the one method the stock MNIST builders call) is
    provided; it never touches the network.
    """

    def __init__(self, dl_manager, source_dir):
        self._dl_manager = dl_manager
        self._source_dir = pathlib.Path(source_dir)

    def download_and_extract(self, url_or_urls):
        def local_path(url):
            name = posixpath.basename(urllib.parse.urlparse(url).path)
            path = self._source_dir / name
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found (asked for {url}). Install the files with "
                    f"`{INSTALL_COMMAND}` or pass --source_dir."
                )
            return path

        return self._dl_manager.extract(tf.nest.map_structure(local_path, url_or_urls))


class _LocalFashionMNIST(mnist.FashionMNIST, skip_registration=True):
    """The stock `fashion_mnist` builder, reading local IDX files.

    Same name, version and features as the registered builder, so the stock
    builder reads what this one writes.
    """

    name = DATASET_NAME

    def __init__(self, *, source_dir=DEFAULT_SOURCE_DIR, **kwargs):
        self._source_dir = pathlib.Path(source_dir)
        super().__init__(**kwargs)

    def _split_generators(self, dl_manager):
        split_generators = super()._split_generators(
            _LocalDownloadManager(dl_manager, self._source_dir)
        )
        # The stock builder hardcodes 60000 / 10000; use the count in the header.
        for split_generator in split_generators:
            split_generator.gen_kwargs["num_examples"] = _read_idx_num_examples(
                os.fspath(split_generator.gen_kwargs["data_path"]), _IDX_IMAGES_MAGIC
            )
        return split_generators
