"""`open_split`: the one place a config chooses how examples are read.

| source         | reads                                    | sampler  | runs on              |
|----------------|------------------------------------------|----------|----------------------|
| `array_record` | a TFDS split in ArrayRecord (TFDSSource) | numpy    | one host, or one     |
|                |                                          |          | process per host     |
| `in_memory`    | the same split, loaded once (ArraySource)| in graph | anywhere: tf.gather  |
| `jpeg_folder`  | DATA_DIR/SPLIT/<class>/*.JPEG            | in graph | anywhere:            |
|                | (JPEGFolderSource)                       |          | tf.io.read_file      |

`array_record` is the default, and the path every measured result in
README.md and docs/design/ took. `in_memory` and `jpeg_folder` are the pure-TF
input: their reads are TensorFlow ops, and so are their samplers
(`tfdp.data.graph_sampling`), so the per-host input graph calls no Python
(what a TPU pod needs; tests/inputs_test.py reads the graph). The
mechanism is the same on every path (Poisson sampling at q, with the same
truncation and padding); only the random stream differs.

Each config states its choice in its header comment; most keep the default.
"""

import gin

from tfdp.data import array_source
from tfdp.data import jpeg_folder
from tfdp.data import loading
from tfdp.data import tfds_source

SOURCES = ("array_record", "in_memory", "jpeg_folder")


@gin.configurable(module="tfdp.data", denylist=["name", "split", "data_dir", "image_size"])
def open_split(name, split, *, data_dir=None, image_size=None, source="array_record"):
    """Opens one split for reading by index, as the chosen `source`.

    Args:
      name: TFDS dataset name (e.g. "fashion_mnist", "imagenet2012"); for
        "jpeg_folder" only recorded (the report names it).
      split: TFDS split string ("train", "train[10000:]", "test").
      data_dir: "array_record"/"in_memory": the TFDS data directory (None:
        TFDS's default); "jpeg_folder": the folder that holds the split
        folders and their index tables (required; local or gs://).
      image_size: None or S (resize to S x S when read; required for
        "jpeg_folder").
      source: one of SOURCES (module docstring). Bind it in gin:
        `tfdp.data.open_split.source = "jpeg_folder"`.

    Returns:
      A source: `TFDSSource`, `ArraySource` (pure_tf=True) or
      `JPEGFolderSource`.

    Raises:
      ValueError: an unknown `source` (the message lists SOURCES), or what
        the source's constructor raises.
      tfdp.data.DatasetNotFoundError: the data is not prepared (the message
        gives the command that prepares it).
    """
    if source not in SOURCES:
        raise ValueError(f"Unknown input source {source!r}; use one of {', '.join(SOURCES)} "
                         "(e.g. --gin_param=\"tfdp.data.open_split.source = 'in_memory'\").")
    if source == "jpeg_folder":
        return jpeg_folder.JPEGFolderSource(name, split, data_dir=data_dir,
                                            image_size=image_size)
    split_source = tfds_source.TFDSSource(name, split, data_dir=data_dir, image_size=image_size)
    if source == "array_record":
        return split_source
    images, labels, num_classes = loading.read_split(split_source)
    arrays = array_source.ArraySource(images, labels, num_classes, pure_tf=True)
    # Where the arrays came from (the trainer checks a backbone's data against it).
    arrays.name, arrays.split, arrays.data_dir = name, split, data_dir
    return arrays


def check_duplicates(source, *, private):
    """Refuses, for a private run, a split that lists one image more than once; else warns.

    A JPEG folder indexed with `allow_duplicates` lists such images in its
    table (`JPEGFolderSource.duplicates`: a symbolic link to a class folder,
    a hard link, a copy). Each copy is its own example, so under DP one
    person's image would count twice, doubling their sensitivity; a
    non-private run only gets a warning. Other sources have no duplicates
    attribute and pass.

    Args:
      source: an opened split (`open_split`).
      private: whether the run is private.

    Raises:
      ValueError: `private` and the source lists duplicates; the message
        names the first ones and how to remove them.
    """
    groups = getattr(source, "duplicates", None) or []
    if not groups:
        return
    shown = ", ".join(" and ".join(group) for group in groups[:5])
    what = (f"The index table of {source.data_dir} ({source.split!r}) lists {len(groups)} images "
            f"more than once ({shown}{', ...' if len(groups) > 5 else ''}): it was written with "
            "--allow_duplicates.")
    if private:
        raise ValueError(
            what + " Each copy is its own example, so one person's image would count twice and "
            "the privacy guarantee would not hold for them (their sensitivity doubles). Keep "
            "one copy of each, then index the folder again without --allow_duplicates "
            "(python tools/index_jpeg_folder.py prints every group).")
    from absl import logging  # pylint: disable=g-import-not-at-top

    logging.warning("%s Each copy counts as its own example in this non-private run.", what)
