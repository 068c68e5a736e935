"""The feature cache: private state of the run, in its workdir, checked before it is reused.

Unit-level tests of `tfdp.features.cached_features` and its cache
(`read_feature_cache`, `write_feature_cache`, `remove_feature_cache`) on small
in-memory splits and a stand-in extractor; `_features` follows the trainer's
order (the features, read or computed; then the chief keeps computed ones
once checkpoint 0 exists). The trainer's wiring (a resume reads the cache; a
finished run leaves none, and none in its export; a rerun of a finished run
removes one left behind) is tests/models/finetune_test.py's end-to-end runs.
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
from tfdp.data import fingerprint


class _Extractor:
    """A stand-in for a frozen extractor: features = images * scale / 255 + offset.

    `scale` and `offset` are scalars or one value per channel (the last axis).
    """

    head = None

    def __init__(self, scale=1.0, offset=0.0, name="a stand-in extractor"):
        self.scale, self.offset, self.name = np.float32(scale), np.float32(offset), name
        self.computed = []  # the number of images of each call

    def compute_features(self, images):
        self.computed.append(len(images))
        return (np.asarray(images, np.float32) * (self.scale / np.float32(255.0))
                + self.offset).astype(np.float32)


def _split(seed, n=32):
    rng = np.random.default_rng(seed)
    return data.ArraySource(rng.integers(0, 256, (n, 4, 4, 3)).astype(np.uint8),
                            rng.integers(0, 10, n).astype(np.int32), 10)


def _features(workdir, extractor, train=None, test=None, chief=True):
    """As the trainer: the features (read or computed), then the chief keeps computed ones."""
    splits = {"train": train or _split(0), "test": test or _split(1, n=16)}
    fingerprints = {role: fingerprint.split_fingerprint(source)
                    for role, source in splits.items()}
    result = features.cached_features(splits["train"], splits["test"], extractor, None,
                                      str(workdir), fingerprints=fingerprints)
    if chief and result.unsaved is not None:
        features.write_feature_cache(str(workdir), extractor, fingerprints, result.unsaved)
    return [source.arrays() for source in (result.train, result.test)]


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
    with pytest.raises(ValueError, match=r"does not hold what this run's a stand-in extractor "
                                         r"computes: on the first 16 training images, 3 of 3 "
                                         r"channels differ.*delete .*feature_cache"):
        _features(tmp_path, _Extractor(scale=1.5))
    assert _snapshot(_cache(tmp_path)) == before
    # Behaviour, not names: the same features under another name are this extractor's.
    renamed = _Extractor(name="another name")
    _features(tmp_path, renamed)
    assert renamed.computed == [features.PROBE_EXAMPLES]


@pytest.mark.slow
@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(relative=st.floats(1e-7, 0.5), channel=st.integers(0, 2),
                  shift=st.booleans())
def test_the_probe_accepts_what_rounding_explains_and_nothing_more(tmp_path_factory, relative,
                                                                   channel, shift):
    # Another device's matmul precision moves features by up to about 1e-2 of their
    # magnitude; another extractor moves them more. One channel of the probe's features is
    # changed by `relative` of that channel's largest cached magnitude (scaled, or shifted):
    # accepted iff relative <= PROBE_TOLERANCE plus the floor's share (`_probe_difference`:
    # 1e-3 of the largest channel's magnitude, for all-zero channels), away from the edge,
    # whichever channel. Channel 1's features are 1e-3 of the others': the floor doubles its
    # tolerance (a draw of relative = 0.03125 there was accepted against a test that
    # expected PROBE_TOLERANCE alone, 2026-11-28).
    workdir = tmp_path_factory.mktemp("probe")
    weights = np.float32([1.0, 1e-3, 0.5])
    _features(workdir, _Extractor(scale=weights))
    cached = np.load(_cache(workdir) / "train.npy")[:features.PROBE_EXAMPLES]
    largest = np.abs(cached).max()
    tolerance = features.PROBE_TOLERANCE * (
        1.0 + 1e-3 * largest / np.abs(cached[..., channel]).max())
    hypothesis.assume(abs(relative - tolerance) > 1e-3)
    this = np.arange(3) == channel
    if shift:
        changed = _Extractor(scale=weights, offset=np.where(
            this, relative * float(np.abs(cached[..., channel]).max()), 0.0))
    else:
        changed = _Extractor(scale=weights * np.where(this, 1.0 + relative, 1.0))
    if relative < tolerance:
        _features(workdir, changed)
    else:
        with pytest.raises(ValueError, match=rf"1 of 3 channels differ .*\(channel {channel}:"):
            _features(workdir, changed)


def test_a_cache_of_other_data_is_refused(tmp_path):
    _features(tmp_path, _Extractor())
    before = _snapshot(_cache(tmp_path))
    extractor = _Extractor()
    with pytest.raises(ValueError, match=r"features of other data than this run reads: "
                                         r"train split: .*sha256.*delete .*feature_cache"):
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
                                         r"cannot be read).*delete .*feature_cache"):
        _features(tmp_path, _Extractor())


@pytest.mark.parametrize("record", ["{not json", "[]", '{"data": {}}',
                                    '{"data": ["train"], "arrays": {"train": {}, "test": {}}}',
                                    '{"data": {}, "arrays": {"train": 1, "test": {}}}'])
def test_an_unreadable_record_is_refused_with_what_to_do(tmp_path, record):
    _features(tmp_path, _Extractor())
    (_cache(tmp_path) / "cache.json").write_text(record)
    with pytest.raises(ValueError, match=r"cache\.json cannot be read .*delete .*feature_cache"):
        _features(tmp_path, _Extractor())


def test_a_cache_without_its_record_is_no_cache_and_is_written_again(tmp_path):
    # As after a kill while the arrays were written: cache.json is written last.
    _features(tmp_path, _Extractor())
    (_cache(tmp_path) / "cache.json").unlink()
    (_cache(tmp_path) / "train.npy").write_bytes(b"half an array")
    (_cache(tmp_path) / "test.npy.tmp-123").write_bytes(b"an interrupted write")
    extractor = _Extractor()
    _features(tmp_path, extractor)
    assert extractor.computed == [32, 16]
    assert sorted(os.listdir(_cache(tmp_path))) == ["cache.json", "test.npy", "train.npy"]
    again = _Extractor()
    _features(tmp_path, again)
    assert again.computed == [features.PROBE_EXAMPLES]


def test_a_full_disk_leaves_no_cache_and_the_features_are_still_returned(tmp_path,
                                                                          monkeypatch):
    real = storage.write_array

    def full(path, array):
        if path.endswith("test.npy"):  # train.npy written, then the disk is full
            with open(path + ".tmp-1", "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, array)

    monkeypatch.setattr(storage, "write_array", full)
    (images, _), _ = _features(tmp_path, _Extractor())
    assert images.shape == (32, 4, 4, 3)
    assert not _cache(tmp_path).exists()  # what the failed write wrote is removed
    monkeypatch.undo()
    extractor = _Extractor()
    _features(tmp_path, extractor)  # the next run computes and writes them
    assert extractor.computed == [32, 16]
    assert (_cache(tmp_path) / "cache.json").exists()


def test_a_worker_that_is_not_the_chief_reads_a_valid_cache_and_writes_none(tmp_path):
    worker = _Extractor()
    _features(tmp_path, worker, chief=False)
    assert worker.computed == [32, 16] and not _cache(tmp_path).exists()
    _features(tmp_path, _Extractor())  # the chief's
    before = _snapshot(_cache(tmp_path))
    worker = _Extractor()
    _features(tmp_path, worker, chief=False)
    assert worker.computed == [features.PROBE_EXAMPLES]
    assert _snapshot(_cache(tmp_path)) == before


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
    _features(workdir, _Extractor())
    assert storage.exists(storage.join(workdir, features.FEATURE_CACHE_DIR, "cache.json"))
    again = _Extractor()
    _features(workdir, again)
    assert again.computed == [features.PROBE_EXAMPLES]
    features.remove_feature_cache(workdir)
    assert not storage.exists(storage.join(workdir, features.FEATURE_CACHE_DIR, "cache.json"))


@pytest.mark.slow  # 7 s (two XLA compilations of the ScatterNet); docs/design/workdir_protocol.md
def test_scatternet_features_of_the_probe_equal_those_of_the_full_batches():
    # What the probe relies on: an image's ScatterNet features do not depend on the batch
    # it was computed in (the probe's images alone; the run's full batches and its
    # zero-padded partial one: batches of 32 here, of 256 in a run).
    pytest.importorskip("kymatio")
    from tfdp import models  # pylint: disable=g-import-not-at-top

    images = np.random.default_rng(0).integers(0, 256, (70, 28, 28, 1)).astype(np.uint8)
    full = models.compute_scatternet_features(images, batch_size=32)
    for start in (0, 60):  # in the first full batch; in the padded partial one
        probe = models.compute_scatternet_features(images[start:start + 10])
        assert features._probe_difference(probe, full[start:start + 10]) is None
        np.testing.assert_allclose(probe, full[start:start + 10], rtol=1e-6, atol=1e-7)


def test_a_linked_feature_cache_is_never_followed(tmp_path):
    # `feature_cache/` as a link to another folder: the run deleted that folder's train.npy
    # and test.npy (a link to another run's cache emptied that cache).
    from tfdp import features as features_lib  # pylint: disable=g-import-not-at-top

    other = tmp_path / "other_cache"
    other.mkdir()
    for name in ("train.npy", "test.npy", "cache.json"):
        (other / name).write_text("theirs")
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / features_lib.FEATURE_CACHE_DIR).symlink_to(other)
    for call in (lambda: features_lib.remove_feature_cache(str(wd)),
                 lambda: features_lib.write_feature_cache(str(wd), None, None, None),
                 lambda: features_lib.read_feature_cache(str(wd), None, None, None, None)):
        with pytest.raises(ValueError, match="symbolic link"):
            call()
    assert sorted(os.listdir(other)) == ["cache.json", "test.npy", "train.npy"]
