"""A whole run in a ram:// workdir: TensorFlow's in-memory file system stands in for gs://.

Every output goes through `tf.io.gfile` (checkpoints, metrics, TensorBoard,
operative config, report, export, FINISHED), the lock is a lease object,
and FINISHED stays the one fact that says the run is complete: written
last, whole, after what it vouches for was read back; a failed export
leaves none, and the same command finishes the run.
"""

import json
import uuid

import pytest
import tensorflow as tf

from tfdp import workdir as workdir_lib
from tfdp.export import saved_model

PARAMS = ["TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0",
          "tfdp.PrivacyConfig.noise_seed = 3"]
gfile = tf.io.gfile


def _url():
    return f"ram://ram_workdir_test/{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def finished_run(run_smoke_module):
    url = _url()
    report = run_smoke_module(url, ["fashion_mnist.gin"], PARAMS)
    return url, report


def _text(path):
    return gfile.GFile(path, "rb").read().decode()


def test_every_output_is_in_the_url_workdir_and_finished_is_written_last(finished_run):
    url, report = finished_run
    names = set(gfile.listdir(url))
    assert {"FINISHED", "privacy_report.json", "privacy_report.md", "metrics.jsonl",
            "operative_config.gin"} <= names
    assert {"checkpoints/", "tensorboard/", "export/"} <= names or {
        "checkpoints", "tensorboard", "export"} <= {n.rstrip("/") for n in names}
    assert workdir_lib.LOCK_FILE not in names  # the lease is released
    assert not [n for n in names if ".tmp-" in n]
    record = workdir_lib.finished(url)
    assert record is not None and record["steps"] == report["steps"] == 2
    assert record["epsilon"] == report["epsilon"]
    assert json.loads(_text(f"{url}/privacy_report.json"))["epsilon"] == report["epsilon"]
    assert [json.loads(line)["step"] for line in _text(f"{url}/metrics.jsonl").splitlines()] == [2]
    assert tf.train.latest_checkpoint(f"{url}/checkpoints").endswith("ckpt-2")
    assert gfile.glob(f"{url}/tensorboard/*/events.out.tfevents.*")
    assert "NUM_STEPS" in _text(f"{url}/operative_config.gin") or "num_steps" in _text(
        f"{url}/operative_config.gin")
    loaded = tf.saved_model.load(f"{url}/export")
    assert loaded.serve(tf.zeros([3, 28, 28, 1], tf.uint8))["logits"].shape == (3, 10)
    assert _text(f"{url}/export/assets/privacy_report.json") == _text(
        f"{url}/privacy_report.json")


def test_the_same_command_returns_the_finished_report_untouched(finished_run, run_smoke):
    url, report = finished_run
    before = _text(f"{url}/FINISHED")
    again = run_smoke(url, ["fashion_mnist.gin"], PARAMS)
    assert again == json.loads(_text(f"{url}/privacy_report.json"))
    assert again["epsilon"] == report["epsilon"]
    assert _text(f"{url}/FINISHED") == before


@pytest.mark.slow
def test_more_steps_resume_from_the_url_checkpoint(finished_run, run_smoke):
    url, _ = finished_run
    longer = run_smoke(url, ["fashion_mnist.gin"], [*PARAMS, "NUM_STEPS = 4"])
    assert longer["steps"] == 4 and workdir_lib.finished(url)["steps"] == 4
    assert [json.loads(line)["step"] for line in _text(f"{url}/metrics.jsonl").splitlines()] == [
        2, 4]


@pytest.mark.slow
def test_a_failed_export_leaves_no_finished_and_the_same_command_finishes(run_smoke,
                                                                          monkeypatch):
    url = _url()
    real_export = saved_model.export_saved_model

    def export_then_fail(model, export_dir, **kwargs):
        real_export(model, export_dir, **kwargs)  # the export is written ...
        raise OSError(28, "No space left on device")  # ... then the disk fills up

    monkeypatch.setattr(saved_model, "export_saved_model", export_then_fail)
    with pytest.raises(workdir_lib.WorkdirError, match=r"failed write.*not finished"):
        run_smoke(url, ["fashion_mnist.gin"], PARAMS)
    assert not gfile.exists(f"{url}/FINISHED") and workdir_lib.finished(url) is None
    assert not gfile.exists(f"{url}/{workdir_lib.LOCK_FILE}")
    monkeypatch.undo()
    report = run_smoke(url, ["fashion_mnist.gin"], PARAMS)
    assert workdir_lib.finished(url)["steps"] == report["steps"] == 2


def test_a_workdir_leased_by_another_run_is_refused_before_anything_is_written(run_smoke):
    url = _url()
    with workdir_lib.locked(url):
        with pytest.raises(workdir_lib.WorkdirLockedError, match=r"in use by another run"):
            run_smoke(url, ["fashion_mnist.gin"], PARAMS)
        assert gfile.listdir(url) == [workdir_lib.LOCK_FILE]
