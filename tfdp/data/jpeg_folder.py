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

The table file is a small text file: a first line `# tfdp-jpeg-index
{json header}` (format version, class names, number of examples), then one
line per example, `relative/path<TAB>label<TAB>size in bytes`. About 40 bytes
an example: 50 MB for ImageNet's 1.28M.
"""

import json
import os
import posixpath
import re

import numpy as np
import tensorflow as tf

from tfdp.data import errors

INDEX_SUFFIX = ".tfdp_index.tsv"
INDEX_FORMAT = "tfdp-jpeg-index"
INDEX_VERSION = 1
TABLE_ORDER_SEED = 20221125  # public: the order of the table, not of any training batch
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")  # case-insensitive (ImageNet: .JPEG; one PNG)
# Images decoded concurrently inside one batch (tf.map_fn in the tf.data graph).
DECODE_PARALLELISM = 16
# Files whose existence and size `JPEGFolderSource` checks when it opens (a cheap
# guard; `tools/index_jpeg_folder.py --check` checks every file).
_SPOT_CHECKS = 32
_SPLIT = re.compile(r"^([A-Za-z0-9_-]+)(\[[^\]]*\])?$")


def index_path(data_dir, split_name):
    """Where the index table of `split_name` ("train") lives: DATA_DIR/train.tfdp_index.tsv."""
    return _join(data_dir, split_name + INDEX_SUFFIX)


def build_index(data_dir, split_name, *, decode=False):
    """Lists DATA_DIR/split_name/<class>/* into an index table (rows in table order).

    Args:
      data_dir: the folder holding `split_name/` (local or a gfile URL).
      split_name: a plain split name, e.g. "train" or "validation".
      decode: also decode every image (slow: about 2,000 images/s per core)
        and refuse any that does not decode; otherwise only each file's first
        bytes are checked (a JPEG, PNG starts with its magic number).

    Returns:
      `(header, rows)`: header dict (format, version, classes, num_examples),
      rows a list of (relative path, label, size in bytes) in table order.

    Raises:
      ValueError: the folder is missing, holds no class folders or no image,
        or a file is empty, not an image, or (with decode) does not decode;
        the message names the files (up to 10).
    """
    root = _join(data_dir, split_name)
    if not tf.io.gfile.isdir(root):
        raise ValueError(f"{root} is not a folder. A JPEG folder holds one sub-folder per "
                         f"split ({split_name}/), each with one folder per class "
                         f"({split_name}/<class>/*.JPEG, ImageNet's layout).")
    classes = sorted(name.rstrip("/") for name in tf.io.gfile.listdir(root)
                     if tf.io.gfile.isdir(_join(root, name.rstrip("/"))))
    if not classes:
        raise ValueError(f"{root} holds no class folders; expected {split_name}/<class>/*.JPEG.")
    rows, empty, bad = [], [], []
    for label, name in enumerate(classes):
        files = sorted(f for f in tf.io.gfile.listdir(_join(root, name))
                       if f.lower().endswith(IMAGE_EXTENSIONS))
        if not files:
            empty.append(name)
        for file_name in files:
            relative = f"{name}/{file_name}"
            path = _join(root, relative)
            size = tf.io.gfile.stat(path).length
            problem = _file_problem(path, size)
            if problem:
                bad.append(f"{relative} ({problem})")
            rows.append((relative, label, size))
    if not rows:
        raise ValueError(f"{root} holds no image ({', '.join(IMAGE_EXTENSIONS)}) in its class "
                         "folders.")
    if decode and not bad:
        bad = _undecodable(root, rows)
    if bad:
        raise ValueError(f"{len(bad)} files of {root} are not readable images: "
                         f"{', '.join(bad[:10])}. Replace or remove them, then index again.")
    order = np.random.default_rng(TABLE_ORDER_SEED).permutation(len(rows))
    rows = [rows[i] for i in order]
    header = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "split": split_name,
              "classes": classes, "empty_classes": empty, "num_examples": len(rows)}
    return header, rows


def index_split(data_dir, split_name, *, decode=False):
    """Indexes DATA_DIR/split_name into DATA_DIR/split_name.tfdp_index.tsv (what the tool runs).

    Args:
      data_dir, split_name, decode: as `build_index`.

    Returns:
      `(path, header)`: the table written and its header.

    Raises:
      ValueError: as `build_index`, or class folders that differ from the
        train split's table (then nothing is written).
    """
    header, rows = build_index(data_dir, split_name, decode=decode)
    _check_same_classes(data_dir, split_name, header["classes"])
    path = index_path(data_dir, split_name)
    write_index(path, header, rows)
    return path, header


def write_index(path, header, rows):
    """Writes an index table (the header line, then one line per row), whole."""
    lines = [f"# {INDEX_FORMAT} {json.dumps(header, sort_keys=True)}"]
    lines += [f"{relative}\t{label}\t{size}" for relative, label, size in rows]
    with tf.io.gfile.GFile(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def read_index(path):
    """Reads and checks an index table.

    Returns:
      `(header, relative_paths, labels, sizes)`: the header dict; numpy
      arrays object [N] (str), int32 [N], int64 [N].

    Raises:
      errors.DatasetNotFoundError: the table is missing (the message gives the
        command that writes it).
      ValueError: the file is not a tfdp index table, or its rows disagree
        with its header (a truncated copy).
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
        lines = body.splitlines()
        if len(lines) != header["num_examples"]:
            raise ValueError(f"{len(lines)} rows, the header says {header['num_examples']}")
        fields = [line.split("\t") for line in lines]
        relative = np.array([f[0] for f in fields], dtype=object)
        labels = np.array([int(f[1]) for f in fields], dtype=np.int32)
        sizes = np.array([int(f[2]) for f in fields], dtype=np.int64)
        if len(labels) and not 0 <= labels.min() <= labels.max() < len(header["classes"]):
            raise ValueError("a label outside the class list")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(
            f"{path} is not a valid tfdp index table ({e}). Write it again with "
            "tools/index_jpeg_folder.py.") from None
    return header, relative, labels, sizes


def check_index(data_dir, split_name, *, decode=False):
    """Compares an index table with its folder: the same files, labels and sizes.

    Returns:
      A list of problems (strings; empty when the table matches the folder).

    Raises:
      As `read_index` and `build_index`.
    """
    header, relative, labels, sizes = read_index(index_path(data_dir, split_name))
    fresh_header, rows = build_index(data_dir, split_name, decode=decode)
    problems = []
    if fresh_header["classes"] != header["classes"]:
        problems.append("the class folders differ from the table's classes")
    listed = {r: (int(l), int(s)) for r, l, s in zip(relative, labels, sizes)}
    found = {r: (l, s) for r, l, s in rows}
    missing, added = sorted(set(listed) - set(found)), sorted(set(found) - set(listed))
    changed = sorted(r for r in set(listed) & set(found) if listed[r] != found[r])
    for what, names in (("missing from the folder", missing), ("not in the table", added),
                        ("changed (label or size)", changed)):
        if names:
            problems.append(f"{len(names)} files {what}: {', '.join(names[:5])}")
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
        self.num_classes = len(self.classes)
        self.num_examples = len(relative)
        self.image_shape = (image_size, image_size, 3)
        self._root = _join(data_dir, base)
        _check_same_classes(data_dir, base, self.classes)
        _spot_check(self._root, relative, sizes, data_dir, base)
        with tf.device("/CPU:0"):
            self._paths = tf.Variable(relative.astype(bytes), trainable=False, dtype=tf.string,
                                      name="jpeg_paths")
            self._labels = tf.Variable(labels, trainable=False, dtype=tf.int32,
                                       name="jpeg_labels")

    def __repr__(self):
        return (f"JPEGFolderSource(data_dir={self.data_dir!r}, split={self.split!r}, "
                f"num_examples={self.num_examples}, image_shape={self.image_shape})")

    def read(self, indices):
        """The examples at `indices`, decoded; TensorFlow ops only (tf.data or tf.function).

        Args:
          indices: int64 [n], values in [0, num_examples).

        Returns:
          `(images uint8 [n, S, S, 3], labels int32 [n])`, in the order of `indices`.
        """
        paths = tf.strings.join([self._root + "/", tf.gather(self._paths, indices)])
        images = tf.map_fn(self._decode, paths,
                           fn_output_signature=tf.TensorSpec(self.image_shape, tf.uint8),
                           parallel_iterations=DECODE_PARALLELISM)
        return images, tf.gather(self._labels, indices)

    def _decode(self, path):
        image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
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
            wrong.append(f"{relative[i]} (missing)")
            continue
        if found != sizes[i]:
            wrong.append(f"{relative[i]} ({found} bytes, the table says {sizes[i]})")
    if wrong:
        raise errors.DatasetNotFoundError(
            f"The JPEG folder {root} does not match its index table: {', '.join(wrong[:5])}. "
            "Copy the folder again, or index it again; check every file with:\n  python "
            f"tools/index_jpeg_folder.py --data_dir={data_dir} --split={base} --check")


def _file_problem(path, size):
    if size == 0:
        return "empty"
    with tf.io.gfile.GFile(path, "rb") as f:
        magic = f.read(8)
    if magic[:3] == b"\xff\xd8\xff" or magic == b"\x89PNG\r\n\x1a\n":
        return None
    return "not a JPEG or PNG"


def _undecodable(root, rows):
    """The rows whose file does not decode, via a parallel tf.data pass."""
    paths = tf.constant([_join(root, r) for r, _, _ in rows])

    def ok(path):
        decoded = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
        return tf.size(decoded) > 0

    ds = tf.data.Dataset.from_tensor_slices(paths).map(
        ok, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.ignore_errors(log_warning=False)  # a failing element is dropped
    decoded = sum(1 for _ in ds)
    if decoded == len(rows):
        return []
    bad = []
    for relative, _, _ in rows:  # rare: find the culprits one by one
        try:
            ok(tf.constant(_join(root, relative)))
        except tf.errors.OpError as e:
            bad.append(f"{relative} ({type(e).__name__})")
    return bad


def _join(*parts):
    """os.path.join for local paths, '/' for URLs (gs://...)."""
    if "://" in str(parts[0]):
        return posixpath.join(*(str(p) for p in parts))
    return os.path.join(*(str(p) for p in parts))
