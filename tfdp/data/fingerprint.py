"""What a resume checks about its data: a fingerprint of each split the run reads.

A resumed run continues the checkpoint's privacy record, so it must train on
the examples the checkpoint's steps were taken on: the accountant composes
the steps of one mechanism on one dataset, and a resume that read another
copy of it (a `data_dir` or `$TFDS_DATA_DIR` that points elsewhere, with
other labels or images) would compose steps on two datasets under one ε,
and report metrics of a test set the first steps never saw. The trainer
records `split_fingerprint` of the training and test splits in the
checkpoint's privacy record, and refuses a resume whose fingerprints differ
(`differences` names what changed). Moving the same files elsewhere is no
change.

What a fingerprint covers, by source:

- `TFDSSource` (ArrayRecord files): the dataset's full name
  (name/config/version), the split string, its example count, and for every
  shard file the split reads, its size and a SHA-256: of the whole file when
  the shards total at most `FULL_DIGEST_MAX_BYTES` (1 GiB: Fashion-MNIST's
  and CIFAR-10's are read in well under a second), else of blocks of
  `BLOCK_BYTES` (64 KiB) at evenly spaced offsets of each shard, its first
  and last (the ArrayRecord footer) included, `SAMPLE_BUDGET_BYTES` (256 MiB)
  in all and 2 to 16 per shard, read by `READ_THREADS` threads (ImageNet's
  1,024 train shards: 4 blocks each; an edit of the same size outside the
  blocks is not seen, and `covers` says so). On gs:// a large split is
  covered by the CRC32C checksums Cloud Storage keeps (one listing, nothing
  read) where google-cloud-storage can list them; NOT tested against Cloud
  Storage from here. The digest's parameters are recorded with it, and a
  resume recomputes it with the recorded ones (`compare`).
- `ArraySource` (the "in_memory" input): the SHA-256 of its images and
  labels, whole.
- `JPEGFolderSource`: the SHA-256 of the split's index table (relative
  paths, labels and file sizes), not of the JPEG bytes.
- Anything else (TFDS mock data in the tests, an audit's canaries): the
  name, split and example count only.

Pure Python and NumPy, plus `tfdp.storage` for gs:// files.
"""

import concurrent.futures
import hashlib
from typing import Any, Dict, List

import numpy as np

from tfdp import storage

METHOD_VERSION = 1
FULL_DIGEST_MAX_BYTES = 1 << 30
SAMPLE_BUDGET_BYTES = 256 << 20
BLOCK_BYTES = 64 << 10
READ_THREADS = 16


def current_method() -> Dict[str, Any]:
    """The parameters of a TFDS split's digest now (recorded with it, see `split_fingerprint`)."""
    return {"version": METHOD_VERSION, "whole_max_bytes": FULL_DIGEST_MAX_BYTES,
            "block_bytes": BLOCK_BYTES, "budget_bytes": SAMPLE_BUDGET_BYTES}


def split_fingerprint(source, method=None) -> Dict[str, Any]:
    """A JSON-able fingerprint of the examples `source` reads (see the module docstring).

    Args:
      source: an opened split (`tfdp.data.open_split`): `TFDSSource`,
        `ArraySource` or `JPEGFolderSource`; anything else with `num_examples`.
      method: for a `TFDSSource`, the digest's parameters (`current_method()`
        when None): a resume recomputes the digest with the parameters its
        checkpoint recorded, so that a tfdp with other defaults still
        recognizes the same data.

    Returns:
      A dict with `name`, `split`, `num_examples`, `covers` (what the digest
      covers, in words), `sha256` (absent when only the name and size are
      known) and, for a TFDSSource, `method`.
    """
    from tfdp.data import array_source  # pylint: disable=g-import-not-at-top
    from tfdp.data import jpeg_folder  # pylint: disable=g-import-not-at-top
    from tfdp.data import tfds_source  # pylint: disable=g-import-not-at-top

    record = {"name": getattr(source, "name", type(source).__name__),
              "split": getattr(source, "split", None),
              "num_examples": int(source.num_examples)}
    if isinstance(source, tfds_source.TFDSSource):
        record.update(_tfds_digest(source, method or current_method()))
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


def _tfds_digest(source, method):
    builder = source._builder  # pylint: disable=protected-access
    record = {"name": builder.info.full_name}
    if not builder.info.splits:  # tfds.testing.mock_data: no files
        return {**record, "covers": "the name, split and example count only (mock data)"}
    block = int(method["block_bytes"])
    instructions = builder.info.splits[source.split].file_instructions
    shards = sorted({instruction.filename for instruction in instructions})
    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        sizes = list(pool.map(storage.stat_length, shards))
        whole = sum(sizes) <= method["whole_max_bytes"]
        per_shard = min(16, max(2, int(method["budget_bytes"]) // (len(shards) * block)))
        checksums = None if whole or not storage.is_url(shards[0]) else _object_checksums(shards)
        if not whole and checksums is None:
            reads = [(name, offset) for name, size in zip(shards, sizes)
                     for offset in _sample_offsets(size, per_shard, block)]
            blocks = iter(pool.map(lambda read: storage.read_range(read[0], read[1], block),
                                   reads))
    digest = hashlib.sha256()
    for k, (name, size) in enumerate(zip(shards, sizes)):
        digest.update(f"{name.rsplit('/', 1)[-1]}:{size}\n".encode())
        if whole:
            for chunk in storage.read_chunks(name):
                digest.update(chunk)
        elif checksums is not None:
            digest.update(checksums[k].encode())
        else:
            for _ in _sample_offsets(size, per_shard, block):
                digest.update(next(blocks))
    ranges = sorted((i.filename.rsplit("/", 1)[-1], int(i.skip), int(i.take))
                    for i in instructions)
    digest.update(repr(ranges).encode())
    if whole:
        covers = "every byte of the split's shard files"
    elif checksums is not None:
        covers = "the sizes and Cloud Storage CRC32C checksums of the split's shard files"
    else:
        covers = (f"the sizes of the split's shard files and {per_shard} blocks of "
                  f"{block >> 10} KiB of each, the first and last included")
    return {**record, "covers": covers, "sha256": digest.hexdigest(), "method": dict(method)}


def _object_checksums(names):
    """The CRC32C of each gs:// object in `names` from one listing per folder, or None.

    Reading sampled blocks through tf.io.gfile on gs:// fills a read buffer of
    tens of MiB per block, so a large split on an object store is covered by
    the checksums the store keeps instead (every byte, nothing read). None
    where they cannot be listed (another scheme, no google-cloud-storage).
    """
    if not all(name.startswith("gs://") for name in names):
        return None
    try:
        from google.cloud import storage as gcs  # pylint: disable=g-import-not-at-top

        client = gcs.Client()
        found = {}
        for folder in sorted({name.rsplit("/", 1)[0] for name in names}):
            bucket, _, prefix = folder[len("gs://"):].partition("/")
            for blob in client.list_blobs(bucket, prefix=prefix + "/"):
                found[f"gs://{bucket}/{blob.name}"] = blob.crc32c
        return [found[name] for name in names]
    except Exception:  # pylint: disable=broad-except  (no client, no access: sample blocks)
        return None


def _sample_offsets(size, count, block):
    """`count` offsets of blocks evenly spaced over a file of `size` bytes, first and last."""
    if size <= count * block:
        return range(0, size, block)
    last = size - block
    return sorted({last * k // (count - 1) for k in range(count)})


def compare(saved: Dict[str, Dict[str, Any]], sources: Dict[str, Any],
            current: Dict[str, Dict[str, Any]] = None) -> List[str]:
    """What differs between a checkpoint's fingerprints and the splits this run opened.

    A split whose saved fingerprint recorded another method than its
    `current` one (other defaults in a newer tfdp) is fingerprinted again
    with the saved method, so that the change of method is not taken for
    other data; the others are compared as they are (no second read).

    Args:
      saved: the checkpoint's `{role: split_fingerprint}`, e.g. roles
        "train" and "test".
      sources: this run's `{role: opened split}`.
      current: this run's `{role: split_fingerprint}` of `sources`, if already
        computed (None: computed here).

    Returns:
      The lines of `differences` (empty: the same data).
    """
    current = dict(current or {})
    for role, source in sources.items():
        method = (saved.get(role) or {}).get("method")
        if role not in current or current[role].get("method") != method:
            current[role] = split_fingerprint(source, method=method)
    return differences(saved, current)


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
    compared = ("name", "split", "num_examples", "sha256")
    for role in sorted(set(saved) | set(current)):
        before, after = saved.get(role), current.get(role)
        if before is not None and after is not None and all(
                before.get(key) == after.get(key) for key in compared):
            continue
        if before is None or after is None:
            lines.append(f"{role}: recorded in only one of them")
            continue
        fields = [key for key in compared if before.get(key) != after.get(key)]
        what = ", ".join(f"{key} {_short(before.get(key))} -> {_short(after.get(key))}"
                         for key in fields) or "how it was fingerprinted"
        lines.append(f"{role} split: {what} (fingerprint of {after.get('covers')})")
    return lines


def _short(value):
    return f"{value[:12]}..." if isinstance(value, str) and len(value) == 64 else repr(value)
