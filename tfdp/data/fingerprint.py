"""What a resume checks about its data: a fingerprint of each split the run reads.

A resumed run continues the checkpoint's privacy ledger, so it must train on
the examples the checkpoint's steps were taken on: the accountant composes
the steps of one mechanism on one dataset, and a resume that read another
copy of it (a `data_dir` or `$TFDS_DATA_DIR` that points elsewhere, with
other labels or images) would compose steps on two datasets under one ε,
and report metrics of a test set the first steps never saw. The trainer
records `split_fingerprint` of the training and test splits in the
checkpoint's ledger, and refuses a resume whose fingerprints differ
(`differences` names what changed). Moving the same files elsewhere is no
change.

What a fingerprint covers, by source:

- `TFDSSource` (ArrayRecord files): the dataset's full name
  (name/config/version), the split string, its example count, and for every
  shard file the split reads, its size and a SHA-256: of the whole file when
  the shards total at most `FULL_DIGEST_MAX_BYTES` (Fashion-MNIST's and
  CIFAR-10's are read in well under a second), else of `SAMPLED_BLOCKS`
  blocks of 1 MiB at fixed offsets of each shard (ImageNet's 140 GB: an edit
  of the same size outside those blocks is not seen; `covers` says which).
- `ArraySource` (the "in_memory" input): the SHA-256 of its images and
  labels, whole.
- `JPEGFolderSource`: the SHA-256 of the split's index table (relative
  paths, labels and file sizes), not of the JPEG bytes.
- Anything else (TFDS mock data in the tests, an audit's canaries): the
  name, split and example count only.

Pure Python and NumPy, plus `tfdp.storage` for gs:// files.
"""

import hashlib
from typing import Any, Dict, List

import numpy as np

from tfdp import storage

FULL_DIGEST_MAX_BYTES = 4 << 30
SAMPLED_BLOCKS = 16
BLOCK_BYTES = 1 << 20


def split_fingerprint(source) -> Dict[str, Any]:
    """A JSON-able fingerprint of the examples `source` reads (see the module docstring).

    Args:
      source: an opened split (`tfdp.data.open_split`): `TFDSSource`,
        `ArraySource` or `JPEGFolderSource`; anything else with `num_examples`.

    Returns:
      A dict with `name`, `split`, `num_examples`, `covers` (what the digest
      covers, in words) and `sha256` (absent when only the name and size are
      known).
    """
    from tfdp.data import array_source  # pylint: disable=g-import-not-at-top
    from tfdp.data import jpeg_folder  # pylint: disable=g-import-not-at-top
    from tfdp.data import tfds_source  # pylint: disable=g-import-not-at-top

    record = {"name": getattr(source, "name", type(source).__name__),
              "split": getattr(source, "split", None),
              "num_examples": int(source.num_examples)}
    if isinstance(source, tfds_source.TFDSSource):
        record.update(_tfds_digest(source))
    elif isinstance(source, array_source.ArraySource):
        images, labels = source.arrays()
        digest = hashlib.sha256()
        for array in (images, labels):
            digest.update(str((array.dtype.str, array.shape)).encode())
            digest.update(np.ascontiguousarray(array).data)
        record.update(covers="every image and label", sha256=digest.hexdigest())
    elif isinstance(source, jpeg_folder.JPEGFolderSource):
        base = source.split.split("[", 1)[0]
        index = jpeg_folder.index_path(source.data_dir, base)
        record.update(covers=f"the index table {base}{jpeg_folder.INDEX_SUFFIX} (paths, labels, "
                      "file sizes), not the JPEG bytes",
                      sha256=hashlib.sha256(storage.read_bytes(index)).hexdigest())
    else:
        record["covers"] = "the name, split and example count only"
    return record


def _tfds_digest(source):
    builder = source._builder  # pylint: disable=protected-access
    record = {"name": builder.info.full_name}
    if not builder.info.splits:  # tfds.testing.mock_data: no files
        return {**record, "covers": "the name, split and example count only (mock data)"}
    instructions = builder.info.splits[source.split].file_instructions
    shards = sorted({instruction.filename for instruction in instructions})
    sizes = [storage.stat_length(name) for name in shards]
    whole = sum(sizes) <= FULL_DIGEST_MAX_BYTES
    digest = hashlib.sha256()
    for name, size in zip(shards, sizes):
        digest.update(f"{name.rsplit('/', 1)[-1]}:{size}\n".encode())
        if whole:
            for chunk in storage.read_chunks(name):
                digest.update(chunk)
        else:
            for offset in _sample_offsets(size):
                digest.update(storage.read_range(name, offset, BLOCK_BYTES))
    ranges = sorted((i.filename.rsplit("/", 1)[-1], int(i.skip), int(i.take))
                    for i in instructions)
    digest.update(repr(ranges).encode())
    covers = ("every byte of the split's shard files" if whole else
              f"the sizes of the split's shard files and {SAMPLED_BLOCKS} blocks of "
              f"{BLOCK_BYTES >> 20} MiB of each")
    return {**record, "covers": covers, "sha256": digest.hexdigest()}


def _sample_offsets(size):
    if size <= SAMPLED_BLOCKS * BLOCK_BYTES:
        return range(0, size, BLOCK_BYTES)
    last = size - BLOCK_BYTES
    return sorted({last * k // (SAMPLED_BLOCKS - 1) for k in range(SAMPLED_BLOCKS)})


def differences(saved: Dict[str, Dict[str, Any]],
                current: Dict[str, Dict[str, Any]]) -> List[str]:
    """What differs between two `{split role: split_fingerprint}` maps, as readable lines.

    Args:
      saved: the checkpoint's fingerprints, e.g. `{"train": ..., "test": ...}`.
      current: this run's.

    Returns:
      One line per role whose fingerprint differs (empty: the same data).
    """
    lines = []
    for role in sorted(set(saved) | set(current)):
        before, after = saved.get(role), current.get(role)
        if before == after:
            continue
        if before is None or after is None:
            lines.append(f"{role}: recorded in only one of them")
            continue
        fields = [key for key in ("name", "split", "num_examples", "sha256")
                  if before.get(key) != after.get(key)]
        what = ", ".join(f"{key} {_short(before.get(key))} -> {_short(after.get(key))}"
                         for key in fields) or "how it was fingerprinted"
        lines.append(f"{role} split: {what} (fingerprint of {after.get('covers')})")
    return lines


def _short(value):
    return f"{value[:12]}..." if isinstance(value, str) and len(value) == 64 else repr(value)
