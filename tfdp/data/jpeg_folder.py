"""A folder of JPEG files (ImageNet's `train/<synset>/*.JPEG` layout), read by index in the graph.

ImageNet as distributed (ILSVRC2012_img_train.tar, extracted) is one file per
example, under one folder per class (its WordNet id, the synset). This module
reads such a folder without Python at training time: an index table (one
small file per split, written once by `tools/index_jpeg_folder.py`) lists
every file and its label; `JPEGFolderSource.read` gathers the paths of a
batch's indices from the table (a tf.Variable on the host CPU), reads each
file with `tf.io.read_file`, and decodes and resizes it in the graph. With the
in-graph sampler (`tfdp.data.graph_sampling`) the whole input is TensorFlow
ops, as a TPU pod's per-host input must be. Paths may be local or any
`tf.io.gfile` URL (gs://).

Layout:

    DATA_DIR/train/<class>/<file>.JPEG      one folder per class, any file names
    DATA_DIR/validation/<class>/<file>.JPEG the same classes (ImageNet's val/ must
                                            first be sorted into class folders)
    DATA_DIR/train.tfdp_index.tsv           written by tools/index_jpeg_folder.py
    DATA_DIR/validation.tfdp_index.tsv

Labels are the positions of the class folder names in sorted order (for
ImageNet: the sorted synsets, the label order of TFDS's imagenet2012); every
split must have the same class folders (an empty one is allowed, and listed
in the table's header). The
table lists the examples in a fixed pseudorandom order (a public permutation
of the sorted paths, seeded by `TABLE_ORDER_SEED`), so that a slice such as
`train[10000:]` leaves out a uniformly random 10,000 images, not the first
classes.

The table file is a small ASCII text file: a first line `# tfdp-jpeg-index
{json header}` (format version, class names, number of examples), then one
line per example, `"relative/path"<TAB>label<TAB>size in bytes`. The path is a
JSON string with every non-ASCII or control character escaped (`\t`, `\n`,
`\u00e9`), so that any file or class name (a TAB, a newline, U+2028, any
script) keeps its row on one line, and `json.loads` of the first field gives
the name back. About 40 bytes an example: 50 MB for ImageNet's 1.28M.

Indexing reads and decodes every file (about 2,000 images a second per core,
spread over the host's cores), so that no bad file surfaces mid-training: a
file that is empty, not a JPEG or PNG, truncated or otherwise undecodable, a
dangling symbolic link or a folder named like an image is refused, by name.
So is an image listed twice (the same file, e.g. through a symbolic link to a
class folder, or identical bytes): it would be two examples of one person,
which doubles that person's sensitivity under DP. The index refuses it for
every run, private or not: it is written before any run and cannot know
which kind will read it. A file changed after indexing is named by the
batch that reads it (its size no longer matches the table's).
"""

import collections
import hashlib
import json
import os
import posixpath
import re

import numpy as np
import tensorflow as tf

from tfdp import storage
from tfdp.data import errors

INDEX_SUFFIX = ".tfdp_index.tsv"
INDEX_FORMAT = "tfdp-jpeg-index"
# 2: paths JSON-quoted; every file decoded and duplicates refused when indexed. A version 1
# table (unquoted paths, only magic numbers checked) is refused: index the folder again.
INDEX_VERSION = 2
TABLE_ORDER_SEED = 20221125  # public: the order of the table, not of any training batch
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")  # case-insensitive (ImageNet: .JPEG; one PNG)
_JPEG_MAGIC, _PNG_MAGIC = b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n"
# Files read in one batch of the index's decode pass (only for its Python loop's overhead).
_SCAN_BATCH = 1024
# Images decoded concurrently inside one batch (tf.map_fn in the tf.data graph).
DECODE_PARALLELISM = 16
# Files whose existence and size `JPEGFolderSource` checks when it opens (a cheap
# guard; each read checks its files' sizes too, and `tools/index_jpeg_folder.py --check`
# reads every file).
_SPOT_CHECKS = 32
_SPLIT = re.compile(r"^([A-Za-z0-9_-]+)(\[[^\]]*\])?$")


def index_path(data_dir, split_name):
    """Where the index table of `split_name` ("train") lives: DATA_DIR/train.tfdp_index.tsv."""
    return _join(data_dir, split_name + INDEX_SUFFIX)


class DuplicateImagesError(ValueError):
    """One image listed more than once in a split (the same file, or identical bytes).

    Raised by `build_index`: each copy would be its own example, so one
    person's image would count twice (under two labels when the classes
    differ), doubling their sensitivity in a private run.

    Attributes:
      groups: list of tuples of relative paths ("class/file"), the paths of
        one image each, sorted.
    """

    def __init__(self, message, groups):
        super().__init__(message)
        self.groups = groups


def build_index(data_dir, split_name, *, allow_duplicates=False):
    """Lists DATA_DIR/split_name/<class>/* into an index table (rows in table order).

    Every file named like an image (.jpeg, .jpg, .png, any case) is read and
    decoded (`tf.io.decode_image`, 3 channels: what `JPEGFolderSource.read`
    does), in one parallel tf.data pass: about 2,000 images a second per core.

    Args:
      data_dir: the folder holding `split_name/` (local or a gfile URL).
      split_name: a plain split name, e.g. "train" or "validation".
      allow_duplicates: write the table even if an image is listed twice,
        with the groups in the header's `duplicates`, for non-private runs
        only: a private run refuses such a table (`JPEGFolderSource.duplicates`).

    Returns:
      `(header, rows)`: header dict (format, version, split, classes,
      empty_classes, num_examples, and `duplicates` when allowed and found),
      rows a list of (relative path str, label int, size in bytes int) in
      table order.

    Raises:
      ValueError: the folder is missing or holds no class folders or no
        image; a class folder's name is not UTF-8; a file is not a readable
        image: empty, not a JPEG or PNG (magic number), undecodable
        (truncated, corrupt), unreadable, a dangling symbolic link, a folder
        named like an image, or a name that is not UTF-8. The message names
        the files (up to 10) and what is wrong with each.
      DuplicateImagesError (a ValueError): the same image under two paths
        (a symbolic or hard link, or a copy), whether in one class or two;
        the message names both paths (up to 10 images), `groups` all. Not
        raised with `allow_duplicates`.
    """
    scan = _scan(data_dir, split_name)
    if scan.bad:
        raise ValueError(_bad_files(scan.bad, f"files of {scan.root}") +
                         ". Replace or remove them, then index again.")
    if not scan.rows:
        raise ValueError(f"{scan.root} holds no image ({', '.join(IMAGE_EXTENSIONS)}) in its "
                         "class folders.")
    if scan.duplicates and not allow_duplicates:
        raise DuplicateImagesError(
            _duplicates(scan.root, scan.duplicates) + f". Each copy in {scan.root} would be "
            "its own example, so one person's image would count twice (under two labels when the "
            "classes differ), and a private run's guarantee would not hold for them: their "
            "sensitivity doubles. Keep one copy of each (a symbolic link to a class folder "
            "lists all its images again: remove the link), then index again. For a "
            "non-private run only, --allow_duplicates writes the table anyway, listing them "
            "in it; a private run refuses that table.", scan.duplicates)
    rows = scan.rows
    order = np.random.default_rng(TABLE_ORDER_SEED).permutation(len(rows))
    rows = [rows[i] for i in order]
    header = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "split": split_name,
              "classes": scan.classes, "empty_classes": scan.empty, "num_examples": len(rows)}
    if scan.duplicates:
        header["duplicates"] = [list(group) for group in scan.duplicates]
    return header, rows


def index_split(data_dir, split_name, *, allow_duplicates=False):
    """Indexes DATA_DIR/split_name into DATA_DIR/split_name.tfdp_index.tsv (what the tool runs).

    Args:
      data_dir, split_name, allow_duplicates: as `build_index`.

    Returns:
      `(path, header)`: the table written and its header.

    Raises:
      ValueError, DuplicateImagesError: as `build_index`, or class folders
        that differ from the train split's table (then nothing is written).
    """
    header, rows = build_index(data_dir, split_name, allow_duplicates=allow_duplicates)
    _check_same_classes(data_dir, split_name, header["classes"])
    path = index_path(data_dir, split_name)
    write_index(path, header, rows)
    return path, header


def write_index(path, header, rows):
    """Writes an index table (the header line, then one line per row), whole; ASCII only.

    Args:
      path: the table's path (local or a gfile URL).
      header: the header dict (`build_index`).
      rows: (relative path str, label int, size int) tuples; a path may hold
        any character (it is written as a JSON string, ASCII-escaped).
    """
    lines = [f"# {INDEX_FORMAT} {json.dumps(header, sort_keys=True)}"]
    lines += [f"{json.dumps(relative)}\t{label}\t{size}" for relative, label, size in rows]
    storage.write_whole(path, "\n".join(lines) + "\n")


def read_index(path):
    """Reads and checks an index table.

    Returns:
      `(header, relative_paths, labels, sizes)`: the header dict; numpy
      arrays object [N] (str, "class/file", any characters), int32 [N],
      int64 [N].

    Raises:
      errors.DatasetNotFoundError: the table is missing (the message gives the
        command that writes it).
      ValueError: the file is not a tfdp index table of this version (a
        version 1 table, written before every file was decoded, must be
        written again), or its rows disagree with its header (a truncated
        copy).
    """
    if not tf.io.gfile.exists(path):
        data_dir, name = posixpath.split(path) if "://" in path else os.path.split(path)
        raise errors.DatasetNotFoundError(
            f"The JPEG folder's index table {path} is missing. Index the folder once "
            f"(it lists every file and its class, and checks them):\n  python "
            f"tools/index_jpeg_folder.py --data_dir={data_dir} "
            f"--split={name[:-len(INDEX_SUFFIX)]}")
    with tf.io.gfile.GFile(path, "r") as f:
        text = f.read()
    first, _, body = text.partition("\n")
    prefix = f"# {INDEX_FORMAT} "
    try:
        if not first.startswith(prefix):
            raise ValueError("no header line")
        header = json.loads(first[len(prefix):])
        if header.get("version") != INDEX_VERSION:
            raise ValueError(f"version {header.get('version')}, expected {INDEX_VERSION}")
        lines = body.split("\n")  # not splitlines(): a table is ASCII, rows end in "\n" only
        if lines and not lines[-1]:
            lines.pop()
        if len(lines) != header["num_examples"]:
            raise ValueError(f"{len(lines)} rows, the header says {header['num_examples']}")
        fields = [line.split("\t") for line in lines]
        if any(len(f) != 3 for f in fields):
            raise ValueError("a row without exactly 3 TAB-separated fields")
        # One json.loads for all paths (each a JSON string without a raw TAB or newline).
        names = json.loads("[" + ",".join(f[0] for f in fields) + "]")
        if len(names) != len(fields) or not all(isinstance(n, str) for n in names):
            raise ValueError("a path that is not one JSON string")
        relative = np.array(names, dtype=object)
        labels = np.array([int(f[1]) for f in fields], dtype=np.int32)
        sizes = np.array([int(f[2]) for f in fields], dtype=np.int64)
        if len(labels) and not 0 <= labels.min() <= labels.max() < len(header["classes"]):
            raise ValueError("a label outside the class list")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(
            f"{path} is not a valid tfdp index table ({e}). Write it again with "
            "tools/index_jpeg_folder.py.") from None
    return header, relative, labels, sizes


def check_index(data_dir, split_name):
    """Compares an index table with its folder: the same files, labels and sizes, all readable.

    Reads and decodes every file, as `build_index` does.

    Returns:
      A list of problems (strings; empty when the table matches the folder):
      files that are not readable images, images listed more than once,
      class folders, and files missing, added or changed (label or size).

    Raises:
      As `read_index`; ValueError: the split's folder is missing, or a class
        folder's name is not UTF-8.
    """
    header, relative, labels, sizes = read_index(index_path(data_dir, split_name))
    scan = _scan(data_dir, split_name)
    problems = []
    if scan.bad:
        problems.append(_bad_files(scan.bad, "files"))
    if scan.duplicates:
        problems.append(_duplicates(scan.root, scan.duplicates) + "; one person's image "
                        "would count twice: keep one copy of each")
    if scan.classes != header["classes"]:
        problems.append("the class folders differ from the table's classes")
    listed = {r: (int(l), int(s)) for r, l, s in zip(relative, labels, sizes)}
    found = {r: (l, s) for r, l, s in scan.rows}
    missing, added = sorted(set(listed) - set(found)), sorted(set(found) - set(listed))
    changed = sorted(r for r in set(listed) & set(found) if listed[r] != found[r])
    for what, names in (("missing from the folder", missing), ("not in the table", added),
                        ("changed (label or size)", changed)):
        if names:
            problems.append(f"{len(names)} files {what}: "
                            f"{', '.join(_shown(n) for n in names[:5])}")
    return problems


class JPEGFolderSource:
    """One split of a JPEG folder, read by index with TensorFlow ops only.

    The source for `tfdp.data.train_chunks` and `tfdp.data.eval_batches`,
    like `TFDSSource`, chosen with `tfdp.data.open_split(source="jpeg_folder")`.

    Attributes:
      name, split, data_dir, image_size: as given.
      num_examples: int, examples in the split (after slicing).
      num_classes: int, class folders of the split.
      classes: the class folder names, in label order.
      duplicates: list of tuples of relative paths, each one image listed
        more than once in the whole table (empty unless it was indexed with
        `allow_duplicates`); a private run refuses a source with any.
      image_shape: (image_size, image_size, 3).
      pure_tf: True: `read` is TensorFlow ops, and the trainer samples in
        the graph too.

    Args:
      name: the dataset's name (e.g. "imagenet2012"), for the report only.
      split: "NAME" or "NAME[a:b]" (TFDS slicing syntax, also percents): the
        folder DATA_DIR/NAME and its table, sliced in table order.
      data_dir: the folder holding NAME/ and NAME.tfdp_index.tsv (a local
        path or a gfile URL such as gs://BUCKET/imagenet).
      image_size: S: images are decoded (JPEG, PNG; 3 channels) and resized
        to S x S with area (box) interpolation, rounded to uint8 (De et al.
        2022, App. C.2: 224 for ImageNet). Required.

    Raises:
      errors.DatasetNotFoundError: the table is missing (the message gives
        the command that writes it), or a file it lists is missing or
        changed size (spot check of a few files; the message says how to
        check all).
      ValueError: no data_dir or image_size; a bad split string; an empty
        slice; a table that is not valid.
      tf.errors.InvalidArgumentError (from `read`, when a batch is read): a
        file whose size differs from the table's (changed after indexing);
        the message names it and the command that checks every file.
    """

    def __init__(self, name, split, *, data_dir, image_size):
        if not data_dir:
            raise ValueError(
                "source='jpeg_folder' reads DATA_DIR/<split>/<class>/*.JPEG: set data_dir "
                "(the configs' DATA_DIR) to the folder that holds the split folders.")
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
            raise ValueError(
                f"source='jpeg_folder' needs image_size (a positive int: images are resized "
                f"to S x S when read), got {image_size!r}; e.g. IMAGE_SIZE = 224.")
        match = _SPLIT.match(split.replace(" ", ""))
        if not match:
            raise ValueError(f"Split {split!r} is not NAME or NAME[a:b] (e.g. 'train', "
                             "'train[10000:]'); a JPEG folder has no split unions.")
        self.name, self.split, self.data_dir, self.image_size = name, split, data_dir, image_size
        self.pure_tf = True
        base = match.group(1)
        header, relative, labels, sizes = read_index(index_path(data_dir, base))
        first, end = _slice(split, base, len(relative))
        if end <= first:
            raise ValueError(f"Split {split!r} of {data_dir} is empty; check the slice.")
        relative, labels, sizes = relative[first:end], labels[first:end], sizes[first:end]
        self.classes = list(header["classes"])
        self.duplicates = [tuple(group) for group in header.get("duplicates", [])]
        self.num_classes = len(self.classes)
        self.num_examples = len(relative)
        self.image_shape = (image_size, image_size, 3)
        self._root = _join(data_dir, base)
        self._check_command = (f"python tools/index_jpeg_folder.py --data_dir={data_dir} "
                               f"--split={base} --check")
        _check_same_classes(data_dir, base, self.classes)
        _spot_check(self._root, relative, sizes, data_dir, base)
        with tf.device("/CPU:0"):
            # UTF-8 bytes (numpy's astype(bytes) would encode as ASCII, and refuse "café").
            paths = np.array([r.encode("utf-8") for r in relative], dtype=object)
            self._paths = tf.Variable(paths, trainable=False, dtype=tf.string,
                                      name="jpeg_paths")
            self._labels = tf.Variable(labels, trainable=False, dtype=tf.int32,
                                       name="jpeg_labels")
            self._sizes = tf.Variable(sizes, trainable=False, dtype=tf.int64, name="jpeg_sizes")

    def __repr__(self):
        return (f"JPEGFolderSource(data_dir={self.data_dir!r}, split={self.split!r}, "
                f"num_examples={self.num_examples}, image_shape={self.image_shape})")

    def read(self, indices):
        """The examples at `indices`, decoded; TensorFlow ops only (tf.data or tf.function).

        Args:
          indices: int64 [n], values in [0, num_examples).

        Returns:
          `(images uint8 [n, S, S, 3], labels int32 [n])`, in the order of `indices`.

        Raises:
          tf.errors.InvalidArgumentError (when run): a file whose size is not
            the table's, or whose bytes are no image, named in the message (it
            changed after indexing).
        """
        paths = tf.strings.join([self._root + "/", tf.gather(self._paths, indices)])
        images = tf.map_fn(self._decode, (paths, tf.gather(self._sizes, indices)),
                           fn_output_signature=tf.TensorSpec(self.image_shape, tf.uint8),
                           parallel_iterations=DECODE_PARALLELISM)
        return images, tf.gather(self._labels, indices)

    def _decode(self, path_and_size):
        path, size = path_and_size
        contents = tf.io.read_file(path)
        found = tf.cast(tf.strings.length(contents), tf.int64)
        same = tf.debugging.Assert(tf.equal(found, size), [
            "A file of the JPEG folder changed after it was indexed:", path, "has", found,
            "bytes, the index table says", size, f"bytes. Check every file with "
            f"{self._check_command}, then restore the file or index again."])
        # A file replaced by other bytes of the same size: decode_image's own error names
        # no file, so the signatures of the formats decode_image reads are checked first.
        image_bytes = tf.reduce_any(tf.stack([
            tf.equal(tf.strings.substr(contents, 0, 3), b"\xff\xd8\xff"),  # JPEG
            tf.equal(tf.strings.substr(contents, 0, 8), b"\x89PNG\r\n\x1a\n"),
            tf.equal(tf.strings.substr(contents, 0, 3), b"GIF"),
            tf.equal(tf.strings.substr(contents, 0, 2), b"BM"),
            tf.logical_and(tf.equal(tf.strings.substr(contents, 0, 4), b"RIFF"),  # WebP
                           tf.equal(tf.strings.substr(contents, 8, 4), b"WEBP")),
            tf.equal(tf.strings.substr(contents, 0, 2), b"\xff\x0a"),  # JPEG XL
            tf.equal(tf.strings.substr(contents, 0, 12), b"\0\0\0\x0cJXL \r\n\x87\n")]))
        an_image = tf.debugging.Assert(image_bytes, [
            "A file of the JPEG folder changed after it was indexed:", path, "is no longer "
            f"an image (JPEG, PNG, GIF, BMP, WebP or JPEG XL). Check every file with "
            f"{self._check_command}, then restore the file or index again."])
        with tf.control_dependencies([same, an_image]):
            image = tf.io.decode_image(contents, channels=3, expand_animations=False)
        size = self.image_size
        already = tf.reduce_all(tf.equal(tf.shape(image)[:2], [size, size]))
        image = tf.cond(already, lambda: image, lambda: _resize_uint8(image, size))
        return tf.ensure_shape(image, self.image_shape)


def _resize_uint8(image, image_size):
    image = tf.image.resize(image, [image_size, image_size], method=tf.image.ResizeMethod.AREA)
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def _slice(split, base, size):
    """[first, end) of a TFDS-style slice of a table of `size` rows."""
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    try:
        instructions = tfds.core.ReadInstruction.from_spec(split).to_absolute(
            {base: _Size(size)})
    except (ValueError, AssertionError) as e:
        raise ValueError(f"Split {split!r} is not a valid slice of {base!r} ({e}).") from None
    (instruction,) = instructions
    return instruction.from_ or 0, size if instruction.to is None else instruction.to


class _Size:
    def __init__(self, num_examples):
        self.num_examples = num_examples


def read_header(path):
    """The header dict of an index table (its first line only), or None if there is none."""
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path, "r") as f:
        first = f.readline()
    prefix = f"# {INDEX_FORMAT} "
    return json.loads(first[len(prefix):]) if first.startswith(prefix) else None


def _check_same_classes(data_dir, base, classes):
    """Refuses a split whose class folders differ from the train split's (labels would differ)."""
    if base == "train":
        return
    train = read_header(index_path(data_dir, "train"))
    if train is not None and train.get("classes") != classes:
        differ = sorted(set(train.get("classes", [])) ^ set(classes))
        raise ValueError(
            f"The class folders of {_join(data_dir, base)} differ from those of "
            f"{_join(data_dir, 'train')} ({len(differ)} differ, e.g. {', '.join(differ[:5])}), "
            "so the same label would mean two classes. Give every split the same class "
            "folders (an empty folder is allowed) and index them again.")


def _spot_check(root, relative, sizes, data_dir, base):
    """A few files of the table, spread over it, exist with their recorded size."""
    picks = np.unique(np.linspace(0, len(relative) - 1, min(_SPOT_CHECKS, len(relative)))
                      .astype(int))
    wrong = []
    for i in picks:
        path = _join(root, relative[i])
        try:
            found = tf.io.gfile.stat(path).length
        except tf.errors.NotFoundError:
            wrong.append(f"{_shown(relative[i])} (missing)")
            continue
        if found != sizes[i]:
            wrong.append(f"{_shown(relative[i])} ({found} bytes, the table says {sizes[i]})")
    if wrong:
        raise errors.DatasetNotFoundError(
            f"The JPEG folder {root} does not match its index table: {', '.join(wrong[:5])}. "
            "Copy the folder again, or index it again; check every file with:\n  python "
            f"tools/index_jpeg_folder.py --data_dir={data_dir} --split={base} --check")


_Scan = collections.namedtuple("_Scan", "root classes empty rows bad duplicates")


def _scan(data_dir, split_name):
    """Lists, reads and decodes every image file of DATA_DIR/split_name.

    Returns:
      `_Scan`: root (the split's folder); classes (sorted folder names); empty
      (those without an image file); rows [(relative, label, size)] in sorted
      order, every regular file named like an image (bad ones included, so
      that `check_index` sees their sizes); bad [(relative, problem)] sorted;
      duplicates [tuple of relative paths], the paths of each image listed
      more than once.

    Raises:
      ValueError: the folder is missing or holds no class folders; a class
        folder's name is not UTF-8, or it is a dangling symbolic link (the
        labels of the classes after it would shift).
    """
    root = _join(data_dir, split_name)
    if not tf.io.gfile.isdir(root):
        raise ValueError(f"{root} is not a folder. A JPEG folder holds one sub-folder per "
                         f"split ({split_name}/), each with one folder per class "
                         f"({split_name}/<class>/*.JPEG, ImageNet's layout).")
    entries = _listdir(root)
    dangling = sorted(name for name in entries if _dangling(_join(root, name)))
    if dangling:
        raise ValueError(
            f"{len(dangling)} entries of {root} are symbolic links to folders that do not "
            f"exist: " + ", ".join(f"{_shown(n)} -> {os.readlink(_join(root, n))}"
                                   for n in dangling[:10]) +
            ". Each would have been a class (labels are the sorted folder names): mount or "
            "copy their targets, or remove the links, then index again.")
    classes = sorted(name for name in entries if _isdir(_join(root, name)))
    if not classes:
        raise ValueError(f"{root} holds no class folders; expected {split_name}/<class>/*.JPEG.")
    not_utf8 = [name for name in classes if not _is_utf8(name)]
    if not_utf8:
        raise ValueError(f"{len(not_utf8)} class folders of {root} have names that are not "
                         f"UTF-8: {', '.join(_shown(n) for n in not_utf8[:10])}. Rename them "
                         f"in UTF-8 (e.g. convmv -f latin1 -t utf8 -r --notest {root}), then "
                         "index again.")
    files, empty, bad = [], [], []
    for label, name in enumerate(classes):
        names = sorted(f for f in _listdir(_join(root, name))
                       if f.lower().endswith(IMAGE_EXTENSIONS))
        if not names:
            empty.append(name)
        for file_name in names:
            relative = f"{name}/{file_name}"
            if _is_utf8(file_name):
                files.append((relative, label))
            else:
                bad.append((relative, "its name is not UTF-8: rename it in UTF-8, e.g. with "
                                      "convmv -f latin1 -t utf8"))
    read = _read_all([_join(root, relative) for relative, _ in files])
    rows, good = [], []
    for i, (relative, label) in enumerate(files):
        if i in read:
            rows.append((relative, label, read[i][0]))
            good.append(i)
            continue
        path = _join(root, relative)
        bad.append((relative, _file_problem(path) or
                    "changed while it was being indexed"))
        try:
            stat = tf.io.gfile.stat(path)
        except tf.errors.OpError:
            continue
        if not stat.is_directory:
            rows.append((relative, label, stat.length))
    duplicates = _same_images(root, [files[i][0] for i in good], [read[i] for i in good])
    return _Scan(root, classes, empty, rows, sorted(bad), duplicates)


def _listdir(folder):
    """The names in `folder`, without a trailing "/"; local names may hold undecodable bytes.

    Local folders are listed with os.listdir, which keeps a name that is not
    UTF-8 (as surrogate escapes) where tf.io.gfile.listdir raises
    UnicodeDecodeError.
    """
    if "://" in folder:
        return [name.rstrip("/") for name in tf.io.gfile.listdir(folder)]
    return os.listdir(folder)


def _dangling(path):
    """A local symbolic link whose target does not exist (gfile URLs have no links)."""
    return "://" not in path and os.path.islink(path) and not os.path.exists(path)


def _isdir(path):
    return tf.io.gfile.isdir(path) if "://" in path else os.path.isdir(path)


def _is_utf8(name):
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.listdir's surrogate escapes of undecodable bytes
        return False
    return True


def _shown(name):
    """`name` as a message shows it: as is, or escaped if it holds a TAB, newline or the like."""
    if not _is_utf8(name):
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    return name if name.isprintable() else json.dumps(name, ensure_ascii=False)


def _read_all(paths):
    """Reads and decodes every file in one parallel tf.data pass.

    Returns:
      {position in `paths`: (size in bytes, fingerprint bytes)} for the files
      that read, start with a JPEG or PNG magic number and decode to at least
      one pixel; the others are left out (`_file_problem` says why).
    """
    if not paths:
        return {}

    def check(i, path):
        contents = tf.io.read_file(path)
        magic = tf.logical_or(tf.equal(tf.strings.substr(contents, 0, 3), _JPEG_MAGIC),
                              tf.equal(tf.strings.substr(contents, 0, 8), _PNG_MAGIC))
        image = tf.io.decode_image(contents, channels=3, expand_animations=False)
        size = tf.cast(tf.strings.length(contents), tf.int64)
        fingerprint = tf.fingerprint(contents[tf.newaxis])[0]  # uint8 [8], farmhash64
        return i, size, fingerprint, tf.logical_and(magic, tf.size(image) > 0)

    ds = tf.data.Dataset.from_tensor_slices((tf.range(len(paths), dtype=tf.int64),
                                             tf.constant(paths, tf.string)))
    ds = ds.map(check, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    ds = ds.ignore_errors(log_warning=False).batch(_SCAN_BATCH)  # a failing file is dropped
    read = {}
    for positions, sizes, fingerprints, ok in ds.as_numpy_iterator():
        for i, size, fingerprint, good in zip(positions, sizes, fingerprints, ok):
            if good:
                read[int(i)] = (int(size), fingerprint.tobytes())
    return read


def _file_problem(path):
    """Why the file at `path` is not a readable image (a short phrase), or None."""
    if _dangling(path):
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    try:
        stat = tf.io.gfile.stat(path)
        if stat.is_directory:
            return "a folder, not a file"
        if stat.length == 0:
            return "empty"
        contents = tf.io.read_file(path)
    except tf.errors.OpError as e:
        return f"cannot be read: {_op_message(e)}"
    magic = contents.numpy()[:8]
    if not (magic[:3] == _JPEG_MAGIC or magic == _PNG_MAGIC):
        return "not a JPEG or PNG"
    try:
        image = tf.io.decode_image(contents, channels=3, expand_animations=False)
    except tf.errors.OpError as e:
        return f"does not decode: {_op_message(e)}"
    return None if tf.size(image) > 0 else "decodes to no pixel"


def _op_message(error):
    """A TensorFlow error's own words, without its function-node prefix and op suffix."""
    message = re.sub(r"\{\{[^}]*\}\}\s*", "", error.message)
    return re.sub(r"\s*\[Op:.*", "", message, flags=re.S).strip().rstrip(".")


def _same_images(root, relatives, reads):
    """Groups of paths holding one image: equal (size, fingerprint), then equal bytes.

    Args:
      root: the split's folder.
      relatives: relative paths of the files that read.
      reads: their (size, fingerprint), as `_read_all`.

    Returns:
      A sorted list of tuples of relative paths (two or more each).
    """
    candidates = collections.defaultdict(list)
    for relative, key in zip(relatives, reads):
        candidates[key].append(relative)
    groups = []
    for paths in candidates.values():
        if len(paths) < 2:
            continue
        by_digest = collections.defaultdict(list)  # a fingerprint collision is not a copy
        for relative in paths:
            with tf.io.gfile.GFile(_join(root, relative), "rb") as f:
                by_digest[hashlib.sha256(f.read()).digest()].append(relative)
        groups += [tuple(sorted(same)) for same in by_digest.values() if len(same) > 1]
    return sorted(groups)


def _duplicates(root, groups):
    """"N images are listed more than once: a/1.jpg and c/1.jpg (the same file), ..."."""
    shown = [_group(root, paths) for paths in groups[:10]]
    more = f", and {len(groups) - 10} more" if len(groups) > 10 else ""
    return f"{len(groups)} images are listed more than once: {', '.join(shown)}{more}"


def _group(root, paths):
    """"a/1.jpg and c/1.jpg (the same file)": a link (symbolic or hard), or a copy."""
    names = [_shown(p) for p in paths]
    local = [_join(root, p) for p in paths] if "://" not in root else None
    same = local is not None and all(os.path.samefile(local[0], p) for p in local[1:])
    return (f"{', '.join(names[:-1])} and {names[-1]} "
            f"({'the same file' if same else 'identical bytes'})")


def _bad_files(bad, what):
    """"N files of ROOT are not readable images: a/1.jpg (empty), ..."."""
    shown = [f"{_shown(relative)} ({problem})" for relative, problem in bad[:10]]
    more = f", and {len(bad) - 10} more" if len(bad) > 10 else ""
    return f"{len(bad)} {what} are not readable images: {', '.join(shown)}{more}"


def _join(*parts):
    """os.path.join for local paths, '/' for URLs (gs://...)."""
    if "://" in str(parts[0]):
        return posixpath.join(*(str(p) for p in parts))
    return os.path.join(*(str(p) for p in parts))
