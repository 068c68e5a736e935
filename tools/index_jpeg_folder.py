"""Indexes a JPEG folder (ImageNet's train/<synset>/*.JPEG layout) once, or checks its index.

The pure-TF input reads a JPEG folder by index (`tfdp.data.JPEGFolderSource`,
`tfdp.data.open_split.source = 'jpeg_folder'`). It needs, per split, a small
table of every file and its label, DATA_DIR/SPLIT.tfdp_index.tsv; this writes
it, after reading and decoding every file (about 2,000 images a second per
core), so that no bad file surfaces mid-training. It refuses, naming each
file: an empty, truncated or corrupt file, one that is not a JPEG or PNG, a
dangling symbolic link, a folder named like an image, a name that is not
UTF-8, and an image listed twice (a symbolic link to a class folder, a hard
link, a copy: one person's image would count twice; every pair is printed to
stdout, one per line, TAB-separated). For a non-private run only,
--allow_duplicates writes the table anyway, listing them in its header; a
private run refuses that table, and a non-private one warns. Every split must have the train
split's class folders. Any other name (non-ASCII, a TAB, a newline) is fine:
the table quotes it.

  python tools/index_jpeg_folder.py --data_dir=gs://BUCKET/imagenet --split=train,validation
  python tools/index_jpeg_folder.py --data_dir=gs://BUCKET/imagenet --split=train --check

--check compares an existing table with its folder (missing, added or changed
files, and files that no longer decode) and writes nothing; it exits 1 if they
differ. Any refusal exits 1 with one "error: ..." line, never a traceback.
"""

import json
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
_ALLOW_DUPLICATES = flags.DEFINE_bool(
    "allow_duplicates", False, "Write the table even if an image is listed more than once "
    "(listing them in it): for NON-PRIVATE runs only; a private run refuses such a table.")
_DECODE = flags.DEFINE_bool("decode", True, "Decode every image (about 2,000 a second per "
                            "core). Always on: --nodecode is refused, since a file that does "
                            "not decode would stop a training run mid-way.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not _DECODE.value:
        raise app.UsageError("--nodecode: every file is decoded when indexed or checked, so "
                             "that no bad file stops a training run mid-way; drop the flag.")
    if not _SPLITS.value or not all(split.strip() for split in _SPLITS.value):
        print(f"error: --split={','.join(_SPLITS.value)!r} names no split folder: give the "
              "folders to index, e.g. --split=train,validation.", file=sys.stderr)
        raise SystemExit(2)
    failed = False
    for split in _SPLITS.value:
        try:
            if _CHECK.value:
                problems = jpeg_folder.check_index(_DATA_DIR.value, split)
                path = jpeg_folder.index_path(_DATA_DIR.value, split)
                if problems:
                    failed = True
                    print(f"{path} does not match its folder:\n  " + "\n  ".join(problems))
                else:
                    print(f"{path} matches its folder.")
                continue
            path, header = jpeg_folder.index_split(_DATA_DIR.value, split,
                                                   allow_duplicates=_ALLOW_DUPLICATES.value)
        except jpeg_folder.DuplicateImagesError as e:
            print(f"All {len(e.groups)} images listed more than once, one per line:")
            for paths in e.groups:  # TAB-separated, each path as in the table (JSON if odd)
                print("\t".join(_line_safe(p) for p in paths))
            raise SystemExit(f"error: {e}") from None
        except (ValueError, jpeg_folder.errors.DatasetNotFoundError) as e:
            raise SystemExit(f"error: {e}") from None
        empty = header["empty_classes"]
        print(f"Wrote {path}: {header['num_examples']} images in {len(header['classes'])} "
              f"classes" + (f" ({len(empty)} empty: {', '.join(empty[:5])})" if empty else "")
              + ".")
        if header.get("duplicates"):
            print(f"warning: {len(header['duplicates'])} images are listed more than once "
                  "(--allow_duplicates; the groups are in the table's header): a private run "
                  "refuses this table.")
    sys.exit(1 if failed else 0)


def _line_safe(path):
    """`path` as is, or JSON-quoted (as in the table) if it holds a TAB, newline or the like."""
    return path if path.isprintable() and not path.startswith('"') else json.dumps(path)


if __name__ == "__main__":
    app.run(main)
