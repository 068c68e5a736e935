"""The private data normalization is released once per workdir, and stated in the report.

Unit-level tests of `tfdp.features.cached_features` (the release, saved to
`data_normalization.json`) and of the privacy report's extra mechanisms, on
small in-memory splits and a stand-in extractor: the same properties that
tests/experiment_test.py's end-to-end runs of fashion_mnist_scatternet_linear.gin
check under `-m slow` (two ScatterNet smoke runs, 20-50 s on 2 cores):
  - a restarted run reuses the saved release: no second noisy draw (which
    would spend privacy twice), the file and the statistics unchanged;
  - a release saved under other settings is refused, never reused, and before
    any feature is computed;
  - the report lists the release as a mechanism composed besides DP-SGD.
"""

import dataclasses
import json

import numpy as np
import pytest

from tfdp import accounting
from tfdp import data
from tfdp import features
from tfdp.dp import data_normalization as data_norm
from tfdp.export import privacy_report


class _Extractor:
    """A stand-in for the ScatterNet extractor (no head): features = images / 255."""

    name = "a stand-in extractor"
    head = None

    def __init__(self):
        self.calls = 0

    def compute_features(self, images):
        self.calls += 1
        return np.asarray(images, np.float32) / 255.0


def _split(seed, n=32):
    rng = np.random.default_rng(seed)
    return data.ArraySource(rng.integers(0, 256, (n, 4, 4, 3)).astype(np.uint8),
                            rng.integers(0, 10, n).astype(np.int32), 10)


def _normalization(noise_multiplier=8.0):
    return accounting.DataNormalization(l2_clip_norm_mean=1.0, l2_clip_norm_square=1.5,
                                        noise_multiplier=noise_multiplier, threshold=1e-4)


@pytest.fixture
def draws(monkeypatch):
    """The noise multiplier of every private release drawn during the test."""
    drawn = []
    real = data_norm.private_channel_mean_and_var

    def counting(*args, **kwargs):
        drawn.append(kwargs["noise_multiplier"])
        return real(*args, **kwargs)

    monkeypatch.setattr(data_norm, "private_channel_mean_and_var", counting)
    return drawn


def test_the_release_is_drawn_once_and_reused_on_restart(tmp_path, draws):
    train, test = _split(0), _split(1)
    workdir = tmp_path / "run"
    first = features.cached_features(train, test, _Extractor(), _normalization(),
                                     str(workdir))
    path = workdir / features.DATA_NORMALIZATION_FILE
    released = path.read_text()
    assert json.loads(released)["released_with"] == dataclasses.asdict(_normalization())
    assert draws == [8.0]
    assert first.train.num_examples == 32
    first = first.head_kwargs
    assert set(first) == {"feature_mean", "feature_variance"}
    # The restart: the same settings, the same workdir.
    again = features.cached_features(train, test, _Extractor(), _normalization(),
                                     str(workdir)).head_kwargs
    assert draws == [8.0]  # no second noisy release
    assert path.read_text() == released
    for name in first:
        np.testing.assert_array_equal(again[name], first[name])
    # The check can fail: a new workdir draws a release of its own, and it is noisy.
    other = features.cached_features(train, test, _Extractor(), _normalization(),
                                     str(tmp_path / "other")).head_kwargs
    assert draws == [8.0, 8.0]
    assert not np.array_equal(other["feature_mean"], first["feature_mean"])


def test_a_release_saved_under_other_settings_is_refused_before_any_feature(tmp_path, draws):
    train, test = _split(0), _split(1)
    features.cached_features(train, test, _Extractor(), _normalization(8.0), str(tmp_path))
    released = (tmp_path / features.DATA_NORMALIZATION_FILE).read_text()
    extractor = _Extractor()
    with pytest.raises(ValueError, match=r"released with .*'noise_multiplier': 8\.0.*asks for "
                                         r".*'noise_multiplier': 4\.0"):
        features.cached_features(train, test, extractor, _normalization(4.0), str(tmp_path))
    assert extractor.calls == 0 and draws == [8.0]
    assert (tmp_path / features.DATA_NORMALIZATION_FILE).read_text() == released


def test_the_report_lists_the_release_besides_dp_sgd():
    normalization = _normalization()
    mechanism = accounting.DPMechanism(num_examples=60000, batch_size=600, num_steps=100,
                                       l2_clip_norm=1.0, delta=1e-5, noise_multiplier=1.0,
                                       data_normalization=normalization)
    report = privacy_report.build_privacy_report(mechanism, steps_completed=100,
                                                 hyperparameters={})
    [extra] = report["extra_mechanisms"]
    assert "private data normalization" in extra["mechanism"]
    assert extra["noise_multiplier"] == 8.0
    assert report["epsilon"] == mechanism.epsilon(100)
    plain = privacy_report.build_privacy_report(
        dataclasses.replace(mechanism, data_normalization=None), steps_completed=100,
        hyperparameters={})
    assert not plain.get("extra_mechanisms")
    assert report["epsilon"] > plain["epsilon"]  # the release is composed, once


def test_the_trainer_checks_a_saved_release_before_computing_features(tmp_path, run_smoke):
    # The wiring, cheaply: a workdir that holds only a release under sigma = 8 (as after a
    # kill between the release and the first checkpoint) is refused by a run that asks for
    # sigma = 4, before its ScatterNet features are computed.
    pytest.importorskip("kymatio")
    release = {"feature_mean": [0.0], "feature_variance": [1.0],
               "released_with": dataclasses.asdict(_normalization(8.0))}
    (tmp_path / features.DATA_NORMALIZATION_FILE).write_text(json.dumps(release))
    norm = ("tfdp.PrivacyConfig.data_normalization = {'l2_clip_norm_mean': 1.0, "
            "'l2_clip_norm_square': 1.5, 'noise_multiplier': 4.0, 'threshold': 1e-4}")
    with pytest.raises(ValueError, match=r"released with .*'noise_multiplier': 8\.0"):
        run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"],
                  ["tfdp.models.build_scatternet_linear.groups = None", norm])
    assert sorted(p.name for p in tmp_path.iterdir()) == [features.DATA_NORMALIZATION_FILE]
