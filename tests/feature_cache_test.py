"""The feature cache: private state of the run, in its workdir, checked before it is reused.

Unit-level tests of `tfdp.features.cached_features` and its cache
(`read_feature_cache`, `write_feature_cache`, `remove_feature_cache`) on small
in-memory splits and a stand-in extractor. The trainer's wiring (a resume
reads the cache; a finished run leaves none, and none in its export) is
tests/models/finetune_test.py's end-to-end fine-tuning run.
"""

import errno
import json
import os

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from tfdp import data
from tfdp import features
from tfdp import storage


class _Extractor:
    """A stand-in for a frozen extractor: features = scale * images / 255 (+ offset)."""

    head = None

    def __init__(self, scale=1.0, offset=0.0, name="a stand-in extractor"):
        self.scale, self.offset, self.name = scale, offset, name
        self.computed = []  # the number of images of each call

    def compute_features(self, images):
        self.computed.append(len(images))
        return (np.asarray(images, np.float32) * (self.scale / 255.0)
                + np.float32(self.offset)).astype(np.float32)


def _split(seed, n=32):
    rng = np.random.default_rng(seed)
    return data.ArraySource(rng.integers(0, 256, (n, 4, 4, 3)).astype(np.uint8),
                            rng.integers(0, 10, n).astype(np.int32), 10)


def _features(workdir, extractor, train=None, test=None, **kwargs):
    train = train or _split(0)
    test = test or _split(1, n=16)
    out_train, out_test, _ = features.cached_features(train, test, extractor, None,
                                                      str(workdir), **kwargs)
    return [source.arrays() for source in (out_train, out_test)]


def _cache(workdir):
    return workdir / features.FEATURE_CACHE_DIR


def _snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_a_restart_reads_the_cache_and_computes_only_the_probe(tmp_path):
    first = _Extractor()
    computed = _features(tmp_path, first)
    assert first.computed == [32, 16]  # train, test: once each
    assert sorted(os.listdir(_cache(tmp_path))) == ["cache.json", "test.npy", "train.npy"]
    record = json.loads((_cache(tmp_path) / "cache.json").read_text())
    assert record["extractor"] == "a stand-in extractor"
    assert record["arrays"]["train"]["shape"] == [32, 4, 4, 3]
    assert set(record["data"]) == {"train", "test"}
    again = _Extractor()
    reread = _features(tmp_path, again)
    assert again.computed == [features.PROBE_EXAMPLES]  # the probe, nothing else
    for (images, labels), (images_again, labels_again) in zip(computed, reread):
        np.testing.assert_array_equal(images_again, images)
        np.testing.assert_array_equal(labels_again, labels)
    # The check can fail: another workdir computes the features again.
    other = _Extractor()
    _features(tmp_path / "other", other)
    assert other.computed == [32, 16]


def test_a_cache_of_another_extractor_is_refused_and_kept(tmp_path):
    _features(tmp_path, _Extractor())
    before = _snapshot(_cache(tmp_path))
    with pytest.raises(ValueError, match=r"computed by another extractor.*differ by up to "
                                         r".*Delete .*feature_cache to compute"):
        _features(tmp_path, _Extractor(scale=1.01))
    with pytest.raises(ValueError, match="computed by another extractor"):
        _features(tmp_path, _Extractor(name="another name"))
    assert _snapshot(_cache(tmp_path)) == before


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(relative=st.floats(1e-7, 1e-1), offset=st.booleans())
def test_the_probe_accepts_what_rounding_explains_and_nothing_more(tmp_path_factory, relative,
                                                                   offset):
    # Another host's vector units change the last bits; another extractor changes more. The
    # stand-in's largest cached feature is <= 1 (scale 1), so a relative change of r moves the
    # largest probe feature by about r: accepted iff r <= PROBE_TOLERANCE (away from the edge).
    hypothesis.assume(abs(relative - features.PROBE_TOLERANCE) > 2e-5)
    workdir = tmp_path_factory.mktemp("probe")
    _features(workdir, _Extractor())
    scale = float(np.load(_cache(workdir) / "train.npy")[:features.PROBE_EXAMPLES].max())
    changed = (_Extractor(offset=relative * scale) if offset
               else _Extractor(scale=1.0 + relative))
    if relative < features.PROBE_TOLERANCE:
        _features(workdir, changed)
    else:
        with pytest.raises(ValueError, match="computed by another extractor"):
            _features(workdir, changed)


def test_a_cache_of_other_data_is_refused(tmp_path):
    _features(tmp_path, _Extractor())
    before = _snapshot(_cache(tmp_path))
    extractor = _Extractor()
    with pytest.raises(ValueError, match=r"features of other data than this run reads: "
                                         r"train split: .*sha256"):
        _features(tmp_path, extractor, train=_split(5))
    assert extractor.computed == []  # refused before any feature
    assert _snapshot(_cache(tmp_path)) == before


@pytest.mark.parametrize("damage", ["edit", "truncate", "missing"])
def test_a_changed_or_truncated_cache_is_refused_with_what_to_do(tmp_path, damage):
    _features(tmp_path, _Extractor())
    path = _cache(tmp_path) / "train.npy"
    content = path.read_bytes()
    if damage == "edit":  # the same size, one feature changed
        path.write_bytes(content[:-4] + np.float32(7.0).tobytes())
    elif damage == "truncate":
        path.write_bytes(content[:len(content) // 2])
    else:
        path.unlink()
    with pytest.raises(ValueError, match=r"feature_cache.*train\.npy.*(truncated or changed|"
                                         r"cannot be read).*Delete .*feature_cache"):
        _features(tmp_path, _Extractor())


def test_a_cache_without_its_record_is_no_cache_and_is_written_again(tmp_path):
    # As after a kill while the arrays were written: cache.json is written last.
    _features(tmp_path, _Extractor())
    (_cache(tmp_path) / "cache.json").unlink()
    (_cache(tmp_path) / "train.npy").write_bytes(b"half an array")
    extractor = _Extractor()
    _features(tmp_path, extractor)
    assert extractor.computed == [32, 16]
    again = _Extractor()
    _features(tmp_path, again)
    assert again.computed == [features.PROBE_EXAMPLES]


def test_a_full_disk_leaves_no_cache_and_the_features_are_still_returned(tmp_path,
                                                                          monkeypatch):
    def full(path, array):
        with open(path + ".tmp-1", "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "write_array", full)
    (images, _), _ = _features(tmp_path, _Extractor())
    assert images.shape == (32, 4, 4, 3)
    assert not (_cache(tmp_path) / "cache.json").exists()
    monkeypatch.undo()
    extractor = _Extractor()
    _features(tmp_path, extractor)  # the next run computes and writes them
    assert extractor.computed == [32, 16]
    features.remove_feature_cache(str(tmp_path))
    assert not _cache(tmp_path).exists()  # the failed write's temporary too


def test_a_worker_that_is_not_the_chief_writes_no_cache(tmp_path):
    _features(tmp_path, _Extractor(), write_cache=False)
    assert not _cache(tmp_path).exists()


def test_removal_takes_only_tfdp_s_own_files(tmp_path):
    _features(tmp_path, _Extractor())
    (_cache(tmp_path) / "notes.txt").write_text("the user's")
    features.remove_feature_cache(str(tmp_path))
    assert os.listdir(_cache(tmp_path)) == ["notes.txt"]
    (_cache(tmp_path) / "notes.txt").unlink()
    features.remove_feature_cache(str(tmp_path))
    assert not _cache(tmp_path).exists()
    features.remove_feature_cache(str(tmp_path))  # nothing there: nothing happens


def test_the_cache_works_on_an_object_store_url():
    workdir = "ram://feature_cache_test/run"
    first = _Extractor()
    _features(workdir, first)
    assert storage.exists(storage.join(workdir, features.FEATURE_CACHE_DIR, "cache.json"))
    again = _Extractor()
    _features(workdir, again)
    assert again.computed == [features.PROBE_EXAMPLES]
    features.remove_feature_cache(workdir)
    assert not storage.exists(storage.join(workdir, features.FEATURE_CACHE_DIR, "cache.json"))
