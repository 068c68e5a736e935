"""Indexes a JPEG folder (ImageNet's train/<synset>/*.JPEG layout) once, or checks its index.

The pure-TF input reads a JPEG folder by index (`tfdp.data.JPEGFolderSource`,
`tfdp.data.open_split.source = 'jpeg_folder'`). It needs, per split, a small
table of every file and its label, DATA_DIR/SPLIT.tfdp_index.tsv; this writes
it, checking that every file is a JPEG or PNG (and, with --decode, that it
decodes), and that every split has the train split's class folders.

  python tools/index_jpeg_folder.py --data_dir=gs://BUCKET/imagenet --split=train,validation
  python tools/index_jpeg_folder.py --data_dir=gs://BUCKET/imagenet --split=train --check

--check compares an existing table with its folder (missing, added or changed
files) and writes nothing; it exits 1 if they differ.
"""

import sys

from absl import app
from absl import flags

from tfdp.data import jpeg_folder

_DATA_DIR = flags.DEFINE_string("data_dir", None, "The folder holding SPLIT/<class>/*.JPEG "
                                "(local or gs://).", required=True)
_SPLITS = flags.DEFINE_list("split", ["train", "validation"], "Split folders to index, in "
                            "order (train first: the others are checked against its classes).")
_CHECK = flags.DEFINE_bool("check", False, "Check existing tables against the folder instead "
                           "of writing them.")
_DECODE = flags.DEFINE_bool("decode", False, "Also decode every image (about 2,000 a second "
                            "per core).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    failed = False
    for split in _SPLITS.value:
        try:
            if _CHECK.value:
                problems = jpeg_folder.check_index(_DATA_DIR.value, split, decode=_DECODE.value)
                path = jpeg_folder.index_path(_DATA_DIR.value, split)
                if problems:
                    failed = True
                    print(f"{path} does not match its folder:\n  " + "\n  ".join(problems))
                else:
                    print(f"{path} matches its folder.")
                continue
            path, header = jpeg_folder.index_split(_DATA_DIR.value, split, decode=_DECODE.value)
        except (ValueError, jpeg_folder.errors.DatasetNotFoundError) as e:
            raise SystemExit(f"error: {e}") from None
        empty = header["empty_classes"]
        print(f"Wrote {path}: {header['num_examples']} images in {len(header['classes'])} "
              f"classes" + (f" ({len(empty)} empty: {', '.join(empty[:5])})" if empty else "")
              + ".")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    app.run(main)
