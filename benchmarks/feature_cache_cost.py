"""What the feature cache costs and saves: compute + write against read + check.

Calls `tfdp.features.cached_features` and `write_feature_cache` as the trainer
does (the features computed, then kept once checkpoint 0 exists), in a
temporary workdir, then `cached_features` again as a resume does (read the
cache, check the data's fingerprints, the SHA-256s and the extractor on its
probe images), and prints each time, the cache's size on disk and what is
left after `remove_feature_cache`. Needs the prepared dataset
(`python tools/prepare_fashion_mnist.py`) and Kymatio.

    python benchmarks/feature_cache_cost.py --data_dir=/tmp/tfds
"""

import os
import shutil
import sys
import tempfile
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tfdp import data  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdp import features  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdp import host  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdp import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdp.data import fingerprint  # pylint: disable=g-import-not-at-top,wrong-import-position

_DATASET = flags.DEFINE_string("dataset", "fashion_mnist", "TFDS dataset (prepared).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data_dir (None: TFDS_DATA_DIR).")
_TMP = flags.DEFINE_string("tmp", None, "where the temporary workdir goes (None: $TMPDIR).")


def main(argv):
    del argv
    print(host.describe_host())
    splits = {role: data.open_split(_DATASET.value, role, data_dir=_DATA_DIR.value)
              for role in ("train", "test")}
    fingerprints = {role: fingerprint.split_fingerprint(s) for role, s in splits.items()}
    extractor = models.FrozenFeatureExtractor(
        name="scatternet", compute_features=models.compute_scatternet_features, compose=None)
    workdir = tempfile.mkdtemp(dir=_TMP.value)
    try:
        start = time.perf_counter()
        first = features.cached_features(splits["train"], splits["test"], extractor, None,
                                          workdir, fingerprints=fingerprints)
        computed = time.perf_counter()
        features.write_feature_cache(workdir, extractor, fingerprints, first.unsaved)
        written = time.perf_counter()
        again = features.cached_features(splits["train"], splits["test"], extractor, None,
                                          workdir, fingerprints=fingerprints)
        read = time.perf_counter()
        assert again.unsaved is None, "the second call did not read the cache"
        folder = os.path.join(workdir, features.FEATURE_CACHE_DIR)
        size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
        features.remove_feature_cache(workdir)
        print(f"{first.train.num_examples} + {first.test.num_examples} images: features "
              f"computed in {computed - start:.1f} s, cache written in {written - computed:.1f}"
              f" s; read and checked in {read - written:.1f} s; {size / 1e9:.2f} GB on disk; "
              f"left after remove_feature_cache: {os.listdir(workdir)}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
