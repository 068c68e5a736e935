"""Converts the local Fashion-MNIST IDX files into the TFDS dataset `fashion_mnist`.

Run once (about 20 s), from any directory:

  apt-get update && apt-get install dataset-fashion-mnist
  python tools/prepare_fashion_mnist.py --data_dir=/path/to/tensorflow_datasets

It is written in ArrayRecord, the format TFDS reads by index: afterwards
`tfds.data_source("fashion_mnist", data_dir=...)` and
`tfdp.data.TFDSSource("fashion_mnist", "train", data_dir=...)` read it.
Does nothing if the dataset is already there (a TFRecord-only copy written by
an older tfdp is rewritten as ArrayRecord). A missing or damaged source file or
dataset_info.json, a data_dir that is a file or cannot be written, and a full
disk each exit with status 1 and one line on stderr that says what to do; a
failed conversion leaves no partial files behind.
"""

from absl import app
from absl import flags

from tfdp.data import fashion_mnist

_SOURCE_DIR = flags.DEFINE_string(
    "source_dir",
    str(fashion_mnist.DEFAULT_SOURCE_DIR),
    "Folder with train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
    "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz.",
)
_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    None,
    "TFDS data directory to write into (default: $TFDS_DATA_DIR or ~/tensorflow_datasets).",
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    data_dir = fashion_mnist.prepare_fashion_mnist(
        source_dir=_SOURCE_DIR.value, data_dir=_DATA_DIR.value
    )
  except (OSError, ValueError) as e:  # missing, damaged or unwritable: one line
    raise SystemExit(f"error: {e}") from None
  print(
      f"Fashion-MNIST is in {data_dir / fashion_mnist.DATASET_NAME} "
      f"(TFDS dataset '{fashion_mnist.DATASET_NAME}'); use --data_dir={data_dir}."
  )


if __name__ == "__main__":
  app.run(main)
