"""Writes the ImageNet-shaped synthetic dataset, as TFDS ArrayRecord or as a JPEG folder.

Same features as TFDS's imagenet2012 (JPEG image, 1000-class label, file_name),
smooth random 224 x 224 JPEGs (about 22 KB each); for testing and measuring the
data path of `imagenet.gin` where ImageNet cannot be downloaded. Does nothing if
the dataset is already in --data_dir.

  python tools/make_synthetic_imagenet.py --data_dir=/tmp/synthetic/n5000 --num_train=5000

--layout=jpeg_folder writes the same examples as ImageNet's own layout,
DATA_DIR/{train,validation}/<synset>/*.JPEG, and indexes it (as
tools/index_jpeg_folder.py does), for the pure-TF input:

  python tools/make_synthetic_imagenet.py --layout=jpeg_folder \
    --data_dir=/tmp/synthetic_jpeg/n5000 --num_train=5000
  python -m tfdp.main --gin_file=imagenet.gin --gin_file=smoke.gin \
    --gin_param="DATA_DIR='/tmp/synthetic_jpeg/n5000'" \
    --gin_param="tfdp.data.open_split.source='jpeg_folder'" \
    --gin_param="tfdp.DataConfig.train_split='train'" \
    --gin_param="NUM_EXAMPLES=5000" --gin_param="BATCH_SIZE=64" --workdir=/tmp/run_jpeg

Then train on it, e.g.
  python -m tfdp.main --gin_file=imagenet.gin --gin_file=smoke.gin \
    --gin_param="DATA_DIR='/tmp/synthetic/n5000'" \
    --gin_param="tfdp.DataConfig.dataset='synthetic_imagenet'" \
    --gin_param="tfdp.DataConfig.train_split='train'" \
    --gin_param="NUM_EXAMPLES=5000" --gin_param="BATCH_SIZE=64" --workdir=/tmp/run
"""

import sys

from absl import app
from absl import flags

from tfdp.data import synthetic_imagenet

_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data directory to write into.",
                                required=True)
_NUM_TRAIN = flags.DEFINE_integer("num_train", 5000, "Examples in the train split.")
_NUM_VALIDATION = flags.DEFINE_integer("num_validation", 1000,
                                       "Examples in the validation split.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Height and width of every image.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the images and labels.")
_LAYOUT = flags.DEFINE_enum("layout", "array_record", ["array_record", "jpeg_folder"],
                            "A TFDS dataset in ArrayRecord, or ImageNet's JPEG-folder layout.")


MAX_IMAGE_SIZE = 4096  # 48 MiB an image in memory, 4 times ImageNet's largest common size


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not 1 <= _IMAGE_SIZE.value <= MAX_IMAGE_SIZE:
        print(f"error: --image_size={_IMAGE_SIZE.value}: give 1 to {MAX_IMAGE_SIZE} (each "
              "image is held in memory as image_size^2 x 3 bytes).", file=sys.stderr)
        raise SystemExit(2)
    try:
        if _LAYOUT.value == "jpeg_folder":
            data_dir = synthetic_imagenet.write_jpeg_folder(
                _DATA_DIR.value, num_train=_NUM_TRAIN.value,
                num_validation=_NUM_VALIDATION.value, image_size=_IMAGE_SIZE.value,
                seed=_SEED.value)
            print(f"The JPEG folder is in {data_dir}; use DATA_DIR='{data_dir}' with "
                  "tfdp.data.open_split.source='jpeg_folder'.")
            return
        data_dir = synthetic_imagenet.prepare_synthetic_imagenet(
            _DATA_DIR.value, num_train=_NUM_TRAIN.value, num_validation=_NUM_VALIDATION.value,
            image_size=_IMAGE_SIZE.value, seed=_SEED.value,
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{synthetic_imagenet.DATASET_NAME} is in {data_dir}; use --data_dir={data_dir}.")


if __name__ == "__main__":
    app.run(main)
