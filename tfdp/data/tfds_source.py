"""Random access to a prepared TFDS split: examples read by index from ArrayRecord.

Every dataset (fashion_mnist, cifar10, imagenet2012, synthetic_imagenet, ...)
goes through this one path. It is the random-access path TFDS documents
(`builder.as_data_source`, what `tfds.data_source` returns): the split's
ArrayRecord files are opened, and `read(indices)` fetches the serialized
examples at any indices (`__getitems__`, which reads them in parallel), then
decodes them (JPEG/PNG) inside the tf.data graph, in parallel. Nothing is
loaded up front: memory depends on the batch size, not on the split's size, so
ImageNet at 224 x 224 (about 190 GB of pixels) trains from disk.

The datasets are prepared beforehand, in ArrayRecord (downloads are always
off): Fashion-MNIST from local files with `tools/prepare_fashion_mnist.py`, the
synthetic ImageNet-shaped set with `tools/make_synthetic_imagenet.py`, anything
else with `tfds build NAME --file_format=array_record` on a machine with
network. A dataset already prepared as TFRecord only is converted in place with
`tfds convert_format` (the error message gives the command).

Pixels stay uint8; scaling to floats happens in the model with fixed constants,
so no statistic is ever computed from the private training set (Tramer & Boneh
2021, App. B, on private data normalization).
"""

import dataclasses
import os
import textwrap

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdp.data import errors
from tfdp.data import preparation
from tfdp.data import synthetic_imagenet  # noqa: F401  (registers its TFDS builder)

# TFDS 4.9's `tfds` command line imports apache_beam and mlcroissant at start-up but does
# not declare them.
_TFDS_CLI_INSTALL = "pip install apache-beam mlcroissant"
# Images decoded concurrently inside one batch (tf.map_fn in the tf.data graph).
DECODE_PARALLELISM = 16
# A split whose ArrayRecord shards total at most this many bytes has every record read
# (and so every chunk's checksum verified) when it is opened, before the workdir is
# touched: about 0.3 s for Fashion-MNIST's 37 MB train split. A larger split (ImageNet) has
# only its shards' footers read then; a corrupt record is named when a batch reads it.
FULL_CHECK_MAX_BYTES = 2 * 2**30
_RECORDS_PER_READ = 4096


class TFDSSource:
    """One split of a prepared TFDS dataset, read by index (nothing held in memory).

    The source for `tfdp.data.train_batches` and `tfdp.data.eval_batches`.
    Works under `tfdp.data.mock_data` (random examples, no files needed).

    Attributes:
      name: the TFDS name, as given.
      split: the TFDS split string, as given.
      data_dir: the TFDS data directory, as given (None: TFDS's default).
      image_size: None, or S: images are resized to S x S when read.
      num_examples: int, examples in the split.
      num_classes: int, from the dataset's ClassLabel feature.
      image_shape: (height, width, channels) of the images `read` returns.
      pure_tf: False: `read` fetches records through Python
        (`tf.numpy_function`), so its training batches are sampled in numpy
        too (`tfdp.data.index_stream`); a TPU pod's per-host input cannot run
        it (use `ArraySource` or `JPEGFolderSource` there).

    Args:
      name: TFDS dataset name, optionally with config/version
        (e.g. "fashion_mnist", "cifar10", "imagenet2012", "synthetic_imagenet").
      split: TFDS split string, e.g. "train", "test", "train[10000:]"
        (TFDS slicing syntax).
      data_dir: TFDS data directory; None means the TFDS default
        (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`).
      image_size: None, or an int S: resize every image to S x S with area
        (box) interpolation, rounded back to uint8 (De et al. 2022, App. C.2,
        224 for ImageNet; 32 as in Chrabaszcz et al. 2017). Required when the
        dataset's images have varying sizes (imagenet2012).

    Raises:
      DatasetNotFoundError: the dataset is not prepared in `data_dir`, or is
        prepared without ArrayRecord files; the message says the command that
        prepares (or converts) it.
      ValueError: unknown dataset name; a dataset without (uint8 image, class
        label) supervised keys; varying image sizes without `image_size`;
        image_size not None or a positive int; an empty split. A bad split
        string raises TFDS's own ValueError that lists the valid splits.
    """

    def __init__(self, name, split, *, data_dir=None, image_size=None):
        if image_size is not None and (
                isinstance(image_size, bool) or not isinstance(image_size, int)
                or image_size < 1):
            raise ValueError(f"image_size must be None or a positive int, got {image_size!r}.")
        self.name = name
        self.split = split
        self.data_dir = data_dir
        self.image_size = image_size
        self.pure_tf = False
        try:
            builder = open_builder(lambda: tfds.builder(name, data_dir=data_dir), name, data_dir)
        except tfds.core.DatasetNotFoundError:
            raise ValueError(
                f"Unknown TFDS dataset {name!r}. Use a TFDS name such as 'fashion_mnist', "
                "'cifar10' or 'imagenet2012' (list: `tfds.list_builders()`)."
            ) from None
        self._image_key, self._label_key = _supervised_keys(builder)
        self._features = builder.info.features
        image_feature = self._features[self._image_key]
        if image_size is None and None in image_feature.shape:
            raise ValueError(
                f"Images of {name!r} have varying sizes {image_feature.shape}; pass "
                "image_size=S to resize them to S x S (e.g. 224 or 32 for ImageNet)."
            )
        if builder.is_prepared() and builder.info.splits[split].num_examples == 0:
            # (ArrayRecord cannot open an empty slice.) A bad split name raises
            # TFDS's ValueError here, which lists the valid splits.
            raise ValueError(f"Split {split!r} of {name!r} is empty; check the split slice.")
        self._source = _open_data_source(builder, split)
        check_split_files(builder, split)
        self._builder = builder
        self.num_examples = len(self._source)
        self.num_classes = int(self._features[self._label_key].num_classes)
        channels = image_feature.shape[-1]
        if image_size is None:
            self.image_shape = tuple(int(d) for d in image_feature.shape)
        else:
            self.image_shape = (image_size, image_size, int(channels))

    def __repr__(self):
        return (f"TFDSSource(name={self.name!r}, split={self.split!r}, "
                f"num_examples={self.num_examples}, image_shape={self.image_shape})")

    def read(self, indices):
        """The examples at `indices`, decoded; for use inside tf.data (or tf.function).

        Args:
          indices: int64 [n], any order, values in [0, num_examples).

        Returns:
          `(images, labels)`: images uint8 [n, height, width, channels]
          (`image_shape`), labels int32 [n], in the order of `indices`.
        """
        records = tf.numpy_function(self._fetch, [indices], tf.string, stateful=False)
        records = tf.ensure_shape(records, [None])
        images, labels = tf.map_fn(
            self._decode,
            records,
            fn_output_signature=(tf.TensorSpec(self.image_shape, tf.uint8),
                                 tf.TensorSpec([], tf.int32)),
            parallel_iterations=DECODE_PARALLELISM,
        )
        return images, labels

    def _fetch(self, indices):
        """int64 [n] -> the n serialized examples (object array of bytes).

        Raises:
          DatasetNotFoundError: a record that cannot be read (a corrupt shard); the
            message names the shard and the command that prepares the dataset again.
            The same error is kept as `read_error`, for the trainer to raise once
            TensorFlow has wrapped it (`raise_read_error`).
        """
        try:
            records = self._source.__getitems__(indices.tolist())
        except RuntimeError as e:  # "Corrupted Riegeli/records file: ... hash mismatch"
            self.read_error = _corrupt_records_error(self._builder, self.split,
                                                     indices.tolist(), e)
            raise self.read_error from None
        return np.array(records, dtype=object).reshape([len(indices)])

    read_error = None

    def _decode(self, record):
        example = self._features.deserialize_example(record)
        image = example[self._image_key]
        if self.image_size is not None:
            size = self.image_size
            already = tf.reduce_all(tf.equal(tf.shape(image)[:2], [size, size]))
            # An area resize to the same size is the identity, but not free (~2x the decode).
            image = tf.cond(already, lambda: image, lambda: _resize_uint8(image, size))
        return tf.ensure_shape(image, self.image_shape), tf.cast(example[self._label_key], tf.int32)


def open_builder(make_builder, name, data_dir):
    """`make_builder()`, or a clear error if a dataset_info.json it reads is damaged.

    TFDS reads `<data_dir>/<name>/<version>/dataset_info.json` when it builds the
    builder, and a file that is not one (cut short, overwritten, not JSON) ends in a
    protobuf ParseError, a RuntimeError or an AssertionError that names no file.

    Args:
      make_builder: builds the TFDS builder, e.g. `lambda: tfds.builder(name, data_dir=...)`.
      name: the dataset's TFDS name (as given; versions and configs allowed).
      data_dir: the TFDS data directory (None: TFDS's default).

    Returns:
      The builder.

    Raises:
      tfdp.data.DatasetNotFoundError: a dataset_info.json of the dataset in
        `data_dir` cannot be read as one; the message names it and says to delete its
        folder and prepare the dataset again. Other errors of `make_builder` are raised
        as they are.
    """
    try:
        return make_builder()
    except tfds.core.DatasetNotFoundError:
        raise
    except Exception:  # pylint: disable=broad-except  (re-raised unless a file is damaged)
        message = _damaged_dataset_info(name, data_dir)
        if message is None:
            raise
        raise errors.DatasetNotFoundError(message) from None


def _damaged_dataset_info(name, data_dir):
    """The message for the first dataset_info.json of `name` that is not one, or None."""
    try:
        dataset = dataset_identity(name)
    except Exception:  # pylint: disable=broad-except
        return None
    root = os.fspath(data_dir) if data_dir is not None else tfds.core.constants.DATA_DIR
    folder = tfds.core.Path(root) / dataset
    for info in sorted([*folder.glob("*/dataset_info.json"),
                        *folder.glob("*/*/dataset_info.json")]):
        try:
            proto = tfds.core.dataset_info.read_from_json(info)
            reason = None if proto.version == info.parent.name else (
                f"its version is {proto.version!r}, its folder's {info.parent.name!r}")
        except Exception as e:  # pylint: disable=broad-except  (ParseError, UnicodeDecodeError..)
            reason = " ".join(str(e).split()).rstrip(".") or type(e).__name__
        if reason is None:
            continue
        command = preparation.prepare_command(dataset, root)
        return (f"{info} is not a valid TFDS dataset_info.json ({reason}): the dataset in "
                f"{info.parent} is damaged. Delete that folder and run {command} again.")
    return None


def _open_data_source(builder, split):
    """`builder.as_data_source(split)` of serialized records, or a clear error."""
    _restore_alternative_file_formats(builder.info)
    try:
        return builder.as_data_source(
            split=split, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
    except (NotImplementedError, ValueError) as e:
        # TFDS raises these when no random-access file format is available.
        if not builder.is_prepared():
            raise errors.DatasetNotFoundError(_not_prepared_message(builder)) from None
        if isinstance(e, NotImplementedError):
            raise errors.DatasetNotFoundError(_no_array_record_message(builder)) from None
        raise


def check_split_files(builder, split):
    """Refuses a half-prepared folder: every file the split reads must exist and be whole.

    A preparation that was interrupted, or a copy that missed or cut a shard,
    would otherwise open fine and fail on the first batch that reads it, deep
    inside training, after the workdir was written. Each ArrayRecord shard is
    opened (which reads its footer, the index of its records) and its record
    count compared with the one in dataset_info.json; this reads a few KB per
    shard, not the examples.

    Raises:
      DatasetNotFoundError: naming the folder, the missing or corrupt files
        and the command that prepares the dataset again.
    """
    if not builder.info.splits:
        # `tfds.testing.mock_data` serves examples without split metadata or files.
        return
    instructions = builder.info.splits[split].file_instructions
    missing = sorted({os.path.basename(instruction.filename)
                      for instruction in instructions
                      if not tf.io.gfile.exists(instruction.filename)})
    command = _not_prepared_message(builder).split("\n", 1)[1]
    if missing:
        raise errors.DatasetNotFoundError(
            f"TFDS folder {builder.data_dir} is only partly prepared: split {split!r} needs "
            f"{', '.join(missing)}, which is missing. Delete the folder and prepare it again:"
            f"\n{command}")
    shards = sorted({(i.filename, i.examples_in_shard) for i in instructions})
    total = sum(tf.io.gfile.stat(filename).length for filename, _ in shards)
    read_records = total <= FULL_CHECK_MAX_BYTES
    corrupt = []
    for filename, expected in shards:
        if ".array_record" in filename:
            problem = _array_record_problem(filename, expected, read_records=read_records)
            if problem:
                corrupt.append(f"{os.path.basename(filename)} ({problem})")
    if corrupt:
        raise errors.DatasetNotFoundError(_corrupt_message(builder, split, corrupt))


def _corrupt_message(builder, split, corrupt):
    command = _not_prepared_message(builder).split("\n", 1)[1]
    return (f"TFDS folder {builder.data_dir} holds a corrupt shard of split {split!r}: "
            f"{'; '.join(corrupt)}. A truncated copy, flipped bytes (a bad disk or copy) or "
            "an interrupted preparation does this. Delete the folder and prepare it again "
            f"(or copy it again):\n{command}")


# Shards whose every record was read: {(filename, size, mtime_ns)}, so that a split opened
# twice in one process is read once.
_VERIFIED = set()


def _array_record_problem(filename, expected, *, read_records=False):
    """None if the ArrayRecord shard opens with `expected` records, else what is wrong.

    With `read_records`, every record is also read, which checks every chunk's hash
    (same-size corruption, e.g. flipped bytes, that the footer alone does not show).
    """
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

    try:
        stat = os.stat(filename)
        key = (filename, stat.st_size, stat.st_mtime_ns)
    except OSError:
        key = None
    try:
        reader = array_record_module.ArrayRecordReader(filename)
        try:
            found = reader.num_records()
            if read_records and found == expected and key not in _VERIFIED:
                for start in range(0, found, _RECORDS_PER_READ):
                    reader.read(start, min(found, start + _RECORDS_PER_READ))
                if key is not None:
                    _VERIFIED.add(key)
        finally:
            reader.close()
    except (RuntimeError, OSError, ValueError) as e:
        return " ".join(str(e).split())[:200] or f"unreadable: {type(e).__name__}"
    if found != expected:
        return f"{found} readable records, {expected} expected"
    return None


def _corrupt_records_error(builder, split, indices, error):
    """The DatasetNotFoundError of a read that failed: the shards of `indices` that fail."""
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

    start, where = 0, {}  # shard filename -> its records holding some of `indices`
    wanted = sorted(set(int(i) for i in indices))
    for instruction in builder.info.splits[split].file_instructions:
        count = instruction.take if instruction.take >= 0 else (
            instruction.examples_in_shard - instruction.skip)
        for i in wanted:
            if start <= i < start + count:
                where.setdefault(instruction.filename, []).append(instruction.skip + i - start)
        start += count
    corrupt = []
    for filename, positions in sorted(where.items()):
        try:
            reader = array_record_module.ArrayRecordReader(filename)
            try:
                for position in positions:
                    reader.read(position, position + 1)
            finally:
                reader.close()
        except (RuntimeError, OSError, ValueError) as e:
            corrupt.append(f"{os.path.basename(filename)} ({' '.join(str(e).split())[:200]})")
    if not corrupt:
        corrupt = [f"one of {', '.join(os.path.basename(f) for f in sorted(where)) or 'its shards'}"
                   f" ({' '.join(str(error).split())[:200]})"]
    return errors.DatasetNotFoundError(_corrupt_message(builder, split, corrupt))


def raise_read_error(*sources):
    """Raises the `read_error` a source kept (a corrupt shard met while training), if any.

    A read inside tf.data reaches the caller as a TensorFlow error that wraps the
    message; the trainer calls this on such an error to raise the clear one instead.
    """
    for source in sources:
        error = getattr(source, "read_error", None)
        if error is not None:
            raise error


def _restore_alternative_file_formats(info):
    """Makes `info.available_file_formats()` list what dataset_info.json lists.

    `tfds convert_format` adds ArrayRecord files next to TFRecord ones and
    records them in dataset_info.json as `alternativeFileFormats`. TFDS 4.9.10
    restores that field into the proto of a registered builder (imagenet2012,
    cifar10, ...) but not into `available_file_formats()`, which
    `as_data_source` checks, so a converted dataset would still look TFRecord
    only. (Builders read from files alone are not affected.)
    """
    for value in list(info.as_proto.alternative_file_formats):
        if tfds.core.file_adapters.FileFormat.from_value(value) not in info.available_file_formats():
            info.add_alternative_file_format(value)


def _supervised_keys(builder):
    """Returns (image_key, label_key), checking they are uint8 Image and ClassLabel."""
    keys = builder.info.supervised_keys
    if not keys or len(keys) != 2 or not all(isinstance(k, str) for k in keys):
        raise ValueError(
            f"TFDS dataset {builder.name!r} has no (image, label) supervised keys "
            f"(got {keys!r}); tfdp needs an image classification dataset."
        )
    image_key, label_key = keys
    image_feature = builder.info.features[image_key]
    if not isinstance(image_feature, tfds.features.Image) or image_feature.np_dtype != np.uint8:
        raise ValueError(
            f"Feature {image_key!r} of {builder.name!r} is not a uint8 image "
            f"({image_feature!r}); tfdp needs uint8 images."
        )
    if not isinstance(builder.info.features[label_key], tfds.features.ClassLabel):
        raise ValueError(
            f"Feature {label_key!r} of {builder.name!r} is not a class label; tfdp "
            "needs a classification dataset."
        )
    return image_key, label_key


def _resize_uint8(image, image_size):
    """Resizes uint8 [height, width, channels] to uint8 [image_size, image_size, channels]."""
    image = tf.image.resize(image, [image_size, image_size], method=tf.image.ResizeMethod.AREA)
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def _not_prepared_message(builder):
    """The message of DatasetNotFoundError: what is missing and the command to run."""
    data_dir = builder.data_dir_root
    header = (
        f"TFDS dataset {builder.name!r} (version {builder.version}) is not prepared "
        f"in {data_dir} (looked for {builder.data_dir}). tfdp never downloads "
        "(TFDS downloads are off)."
    )
    if builder.name == preparation.FASHION_MNIST:
        return (
            f"{header} Convert the local Fashion-MNIST files once:\n"
            f"  {preparation.INSTALL_COMMAND}\n"
            f"  python tools/prepare_fashion_mnist.py --data_dir={data_dir}"
        )
    if builder.name == preparation.SYNTHETIC_IMAGENET:
        return (
            f"{header} Generate it once, e.g.:\n"
            f"  python tools/make_synthetic_imagenet.py --data_dir={data_dir} "
            "--num_train=5000"
        )
    message = (
        f"{header} Prepare it, in ArrayRecord, on a machine with network access "
        f"(the `tfds` command needs `{_TFDS_CLI_INSTALL}`, tensorflow/datasets#5463):\n"
        f"  tfds build {builder.info.full_name.rsplit('/', 1)[0]} --data_dir={data_dir} "
        "--file_format=array_record\n"
        f"then copy its folder {builder.data_dir} to the same path on this machine."
    )
    instructions = getattr(builder, "MANUAL_DOWNLOAD_INSTRUCTIONS", None)
    if instructions:
        message += (
            f"\n{builder.name!r} needs a manual download first, into "
            f"{data_dir}/downloads/manual (or pass --manual_dir to `tfds build`):\n"
            + textwrap.indent(textwrap.dedent(instructions).strip(), "  ")
        )
    return message


def _no_array_record_message(builder):
    formats = sorted(f.value for f in builder.info.available_file_formats())
    return (
        f"TFDS dataset {builder.name!r} is prepared in {builder.data_dir} as "
        f"{', '.join(formats)} only. tfdp reads examples by index, which needs the "
        "ArrayRecord format. Convert it once, in place (the existing files stay; the "
        f"`tfds` command needs `{_TFDS_CLI_INSTALL}`, tensorflow/datasets#5463):\n"
        f"  tfds convert_format --dataset_version_dir={builder.data_dir} "
        "--out_file_format=array_record"
    )


def dataset_identity(name):
    """The dataset that a TFDS name spells, whatever the spelling: its TFDS dataset name.

    TFDS accepts several spellings of one dataset (`tfds.builder` parses
    them with `tfds.core.naming.parse_builder_name_kwargs`): "fashion_mnist",
    "Fashion_MNIST" (CamelCase is snake-cased), "fashion_mnist:3.0.1",
    "fashion_mnist:3.*.*", "fashion_mnist/default:3.0.1" and builder
    keyword arguments ("fashion_mnist/key=value"). Versions and configs are
    dropped on purpose: two versions of a dataset hold the same examples, and
    two configs of one dataset may (a subset config, another resolution), so
    for the question "may these two runs share an example" they count as one
    dataset. (Datasets of different names that share examples, e.g.
    "imagenet2012" and "imagenet2012_subset", are not recognised.)

    Args:
      name: a TFDS dataset name as a config or the user gives it.

    Returns:
      str: the dataset's TFDS name, e.g. "fashion_mnist".

    Raises:
      ValueError: a name TFDS cannot parse (TFDS's message).
    """
    parsed, _ = tfds.core.naming.parse_builder_name_kwargs(str(name))
    return parsed.name


def same_dataset(name_a, name_b):
    """Whether two TFDS names spell the same dataset (`dataset_identity`)."""
    return dataset_identity(name_a) == dataset_identity(name_b)


# TFDS datasets built from the images of one collection, under other names: a split of one
# may hold the same images as any split of another, and their example orders differ.
_IMAGE_COLLECTIONS = {
    name: "ImageNet (ILSVRC 2012)" for name in (
        "imagenet2012", "imagenet2012_subset", "imagenet2012_real", "imagenet2012_multilabel",
        "imagenet2012_corrupted", "imagenet2012_fewshot", "imagenet_resized",
        "downsampled_imagenet")}


def is_tfds_dataset(name):
    """Whether `name` spells a dataset TFDS knows (a registered builder), any spelling."""
    try:
        tfds.builder_cls(dataset_identity(name))
    except (ValueError, tfds.core.DatasetNotFoundError):
        return False
    return True


def image_collection(name):
    """The collection of images a TFDS dataset is built from (its own name if not listed).

    `imagenet_resized/32x32` (ImageNet-32, De et al. 2022's pretraining set)
    holds `imagenet2012`'s images downsampled, `imagenet2012_subset` a part of
    them: all three are "ImageNet (ILSVRC 2012)".

    Raises:
      ValueError: a name TFDS cannot parse.
    """
    identity = dataset_identity(name)
    return _IMAGE_COLLECTIONS.get(identity, identity)


@dataclasses.dataclass(frozen=True)
class _SplitSize:
    """A split's size, where `tfds.core.ReadInstruction.to_absolute` takes a `tfds.core.SplitInfo`.

    `to_absolute` reads only `num_examples` of each split (TFDS 4.9,
    `tensorflow_datasets/core/splits.py`).

    Attributes:
      num_examples: the examples in the split.
    """

    num_examples: int


def splits_overlap(name, split_a, split_b, *, data_dir=None, image_size=None):
    """Whether two split strings of one TFDS dataset share any example.

    Resolves both (e.g. "train[:2000]" and "train[2000:]") to absolute
    example ranges of their base splits (`tfds.core.ReadInstruction`, with
    the splits' sizes) and intersects them, so percent slices and unions
    ("train[:10%]+test") are exact too.

    Args:
      name: TFDS name, e.g. "fashion_mnist".
      split_a, split_b: TFDS split strings.
      data_dir: TFDS data_dir (None: TFDS's default).
      image_size: as `TFDSSource` (required for a dataset of varying image sizes).

    Returns:
      bool: True if some example is in both.

    Raises:
      ValueError: if a split string is not valid for the dataset (TFDS's).
    """
    def ranges(split):
        # [(split name, first, end)] of the examples a split string reads; the split sizes
        # come from TFDSSource, which also answers under tfdp.data.mock_data.
        bases = {part.split("[")[0].strip() for part in split.split("+")}
        sizes = {base: _SplitSize(TFDSSource(name, base, data_dir=data_dir,
                                             image_size=image_size).num_examples)
                 for base in bases}
        return [(i.splitname, i.from_ or 0,
                 sizes[i.splitname].num_examples if i.to is None else i.to)
                for i in tfds.core.ReadInstruction.from_spec(split).to_absolute(sizes)]

    return any(name_a == name_b and max(start_a, start_b) < min(end_a, end_b)
               for name_a, start_a, end_a in ranges(split_a)
               for name_b, start_b, end_b in ranges(split_b))
