"""A JPEG folder: tfdp's index, TFDS's ImageFolder, or a one-off copy to ArrayRecord?

The same folder (`tools/make_synthetic_imagenet.py --layout=jpeg_folder`), three ways:

  index         `tfdp.data.jpeg_folder.JPEGFolderSource`: the index table, read by
                index in the graph (`read(indices)`: gather the paths, tf.io.read_file,
                decode, resize). What a Poisson sample needs: any set of indices.
  image_folder  `tfds.folder_dataset.ImageFolder(DATA_DIR)`: lists the folder when
                built; `as_dataset` streams the split's files in one (shuffled) order.
                It has no read by index: a batch of given indices cannot be asked for.
  array_record  the folder's bytes copied once into an ArrayRecord file (the conversion
                is timed), read by index with `ArrayRecordDataSource.__getitems__`
                (Python), decoded by tf.io: random access, through a Python call.

Each reads whole passes of the split in batches of --batch_size (by index: a random
permutation cut into batches) and prints images per second (min / median / max over
--rounds, variants interleaved; and images per CPU-second of the process, which a
loaded host disturbs less), decoding to uint8 [batch, S, S, 3] in each.

  python tools/make_synthetic_imagenet.py --layout=jpeg_folder --data_dir=/tmp/jpeg2k \
    --num_train=2000 --num_validation=10
  python benchmarks/jpeg_folder_vs_tfds.py --data_dir=/tmp/jpeg2k
"""

import os
import statistics
import tempfile
import time

from absl import app
from absl import flags

from tfdp import host

host.enable_onednn()  # before TensorFlow's import, which reads TF_ENABLE_ONEDNN_OPTS

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from tfdp.data import jpeg_folder  # noqa: E402

_DATA_DIR = flags.DEFINE_string("data_dir", None, "The indexed JPEG folder.", required=True)
_BATCH = flags.DEFINE_integer("batch_size", 256, "Images a batch.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Passes of each variant.")
_SIZE = flags.DEFINE_integer("image_size", 224, "Images are decoded to S x S.")


def _decode(contents, size):
    """uint8 [S, S, 3], resized only where it is not S x S already (as the index's read)."""
    image = tf.io.decode_image(contents, channels=3, expand_animations=False)
    same = tf.reduce_all(tf.equal(tf.shape(image)[:2], [size, size]))
    image = tf.cond(same, lambda: image, lambda: jpeg_folder._resize_uint8(  # pylint: disable=protected-access
        image, size))
    return tf.ensure_shape(image, (size, size, 3))


def _index(data_dir, size, batch, rng):
    source = jpeg_folder.JPEGFolderSource("jpeg", "train", data_dir=data_dir, image_size=size)
    read = tf.function(source.read)
    order = rng.permutation(source.num_examples)

    def one_pass():
        for start in range(0, len(order), batch):
            images, _ = read(tf.constant(order[start:start + batch], tf.int64))
        return images.numpy().shape[0] and len(order)
    return one_pass


def _image_folder(data_dir, size, batch, rng):
    del rng
    started = time.perf_counter()
    builder = tfds.folder_dataset.ImageFolder(data_dir)
    print(f"  ImageFolder built (folder listed) in {time.perf_counter() - started:.2f} s")
    dataset = builder.as_dataset(split="train", shuffle_files=True, decoders={
        "image": tfds.decode.SkipDecoding()})
    dataset = dataset.map(lambda x: (_decode(x["image"], size), x["label"]),
                          num_parallel_calls=tf.data.AUTOTUNE).batch(batch)

    def one_pass():
        return sum(int(images.shape[0]) for images, _ in dataset)
    return one_pass


def _array_record(data_dir, size, batch, rng):
    from array_record.python import array_record_data_source  # pylint: disable=g-import-not-at-top
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

    _, relative, labels, _ = jpeg_folder.read_index(jpeg_folder.index_path(data_dir, "train"))
    path = os.path.join(tempfile.mkdtemp(), "train.array_record")  # not in the folder
    started = time.perf_counter()
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    for name in relative:
        with open(os.path.join(data_dir, "train", name), "rb") as f:
            writer.write(f.read())
    writer.close()
    print(f"  ArrayRecord copy of {len(relative)} files in {time.perf_counter() - started:.2f} s"
          f" ({os.path.getsize(path) / 1e6:.1f} MB)")
    source = array_record_data_source.ArrayRecordDataSource([path])
    labels = np.asarray(labels, np.int32)
    decode = tf.function(lambda contents: tf.map_fn(
        lambda c: _decode(c, size), contents, fn_output_signature=tf.uint8,
        parallel_iterations=jpeg_folder.DECODE_PARALLELISM))
    order = rng.permutation(len(relative))

    def one_pass():
        for start in range(0, len(order), batch):
            indices = order[start:start + batch]
            images = decode(tf.constant(source.__getitems__(list(indices))))
            _ = labels[indices]
        return images.shape[0] and len(order)
    return one_pass


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    passes = {name: make(_DATA_DIR.value, _SIZE.value, _BATCH.value, rng) for name, make in (
        ("index", _index), ("image_folder", _image_folder), ("array_record", _array_record))}
    rates = {name: [] for name in passes}
    per_cpu = {name: [] for name in passes}
    for name, one_pass in passes.items():  # a warm-up pass each: tracing, file cache
        one_pass()
    for round_ in range(_ROUNDS.value):
        names = list(passes)[round_ % len(passes):] + list(passes)[:round_ % len(passes)]
        for name in names:
            started, cpu = time.perf_counter(), time.process_time()
            count = passes[name]()
            rates[name].append(count / (time.perf_counter() - started))
            per_cpu[name].append(count / (time.process_time() - cpu))
    for name in passes:
        print(f"{name:13s} " + "   ".join(
            f"{what} min {min(v):6.1f} median {statistics.median(v):6.1f} max {max(v):6.1f}"
            for what, v in (("images/s", rates[name]), ("per CPU-s", per_cpu[name]))))


if __name__ == "__main__":
    app.run(main)
