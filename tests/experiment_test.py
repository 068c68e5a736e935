"""End to end under smoke.gin on mock data: every workdir output is written."""

import glob
import json
import os

import pytest
import tensorflow as tf


MOCK_EXAMPLES = 64  # the N that conftest.py's run_smoke trains on


def test_smoke_run_writes_every_output(tmp_path, run_smoke):
    report = run_smoke(tmp_path, ["fashion_mnist.gin"])
    assert report["steps"] == 2
    assert 0 < report["epsilon"] <= 3.0

    config = (tmp_path / "operative_config.gin").read_text()
    assert "NUM_STEPS" in config or "num_steps" in config

    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] == 2
    assert {"step", "epsilon", "delta", "test_accuracy"} <= set(records[-1])
    assert records[-1]["epsilon"] == pytest.approx(report["epsilon"])

    tags = set()
    for path in glob.glob(str(tmp_path / "tensorboard" / "*" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert any("epsilon" in t for t in tags), tags
    assert any("accuracy" in t for t in tags), tags
    assert os.path.isdir(tmp_path / "tensorboard" / "validation")

    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
    saved = json.loads((tmp_path / "privacy_report.json").read_text())
    for key in ("epsilon", "delta", "accountant", "noise_multiplier", "l2_clip_norm",
                "batch_size", "num_examples", "steps", "sampling", "neighbouring_relation",
                "privacy_unit"):
        assert key in saved
    assert saved["num_examples"] == MOCK_EXAMPLES and saved["batch_size"] == 16
    loaded = tf.saved_model.load(str(tmp_path / "export"))
    logits = loaded.serve(tf.zeros([3, 28, 28, 1], tf.uint8))
    assert logits.shape == (3, 10)
    assert os.path.exists(tmp_path / "export" / "assets" / "privacy_report.json")


def test_num_examples_must_match_the_data(tmp_path, run_smoke):
    with pytest.raises(ValueError, match=f"set NUM_EXAMPLES = {MOCK_EXAMPLES}"):
        run_smoke(tmp_path, ["fashion_mnist.gin"], [f"NUM_EXAMPLES = {MOCK_EXAMPLES + 1}"])
    assert not os.path.exists(tmp_path / "privacy_report.json")


def test_augmenting_precomputed_features_is_refused_before_any_output(tmp_path, run_smoke):
    with pytest.raises(ValueError, match="Set augmult = 0 and augmentation = None"):
        run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"], [
            "tfdp.train_and_evaluate.augmentation = 'mnist_crop'",
            "tfdp.train_and_evaluate.augmult = 4"])
    assert not os.listdir(tmp_path)


def test_recipe_smoke_run_reports_ema_and_augtest_and_the_same_epsilon(tmp_path, run_smoke):
    # augmult changes nothing in the accounting: same epsilon as one view.
    base = run_smoke(tmp_path / "k1", ["fashion_mnist.gin"], [
        "tfdp.train_and_evaluate.augmentation = 'mnist_crop'",
        "tfdp.train_and_evaluate.augmult = 1"])
    recipe = run_smoke(tmp_path / "k8", ["fashion_mnist.gin"], [
        "tfdp.train_and_evaluate.augmentation = 'mnist_crop'",
        "tfdp.train_and_evaluate.augmult = 8",
        "tfdp.train_and_evaluate.accumulation_steps = 2",
        "tfdp.train_and_evaluate.ema_decay = 0.999",
        "tfdp.train_and_evaluate.augtest = True",
        "tfdp.train_and_evaluate.normalize_update = True"])
    assert recipe["epsilon"] == base["epsilon"]
    assert recipe["steps"] == base["steps"] == 2
    assert recipe["exported_parameters"] == "ema"
    last = json.loads((tmp_path / "k8" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("test_accuracy", "test_ema_accuracy", "test_augtest_accuracy"):
        assert 0.0 <= last[key] <= 1.0


def test_microbatched_run_states_it_in_the_report(tmp_path, run_smoke):
    report = run_smoke(tmp_path, ["fashion_mnist.gin"], [
        "tfdp.train_and_evaluate.num_microbatches = 4"])
    assert report["microbatching"] == {"num_microbatches": 4, "sensitivity": "2 * l2_clip_norm"}


def test_simulation_is_labelled_in_metrics_and_report(tmp_path, run_smoke):
    simulation = {"reference": "B=2048 sigma=1.93", "reference_batch_size": 2048,
                  "reference_noise_multiplier": 1.93, "reference_epsilon": 3.0}
    report = run_smoke(tmp_path, ["fashion_mnist.gin"], [
        "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 0.5",
        f"tfdp.train_and_evaluate.simulation = {simulation!r}"])
    assert report["simulation"] == simulation
    card = (tmp_path / "privacy_report.md").read_text()
    assert "SIMULATION, NOT A PRIVATE RUN AT THE REFERENCE EPSILON" in card
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["simulation"] is True


def test_runs_of_a_study_compose_in_the_ledger(tmp_path, run_smoke):
    from tfdp import accounting  # pylint: disable=g-import-not-at-top

    study = tmp_path / "study"
    reports = [
        run_smoke(tmp_path / name, ["fashion_mnist.gin"], [
            "TARGET_EPSILON = None", f"NOISE_MULTIPLIER = {sigma}",
            f"tfdp.train_and_evaluate.study_dir = '{study}'"])
        for name, sigma in (("run_a", 1.0), ("run_b", 2.0))
    ]
    events = [accounting.dp_sgd_event(noise_multiplier=s, sampling_prob=16 / MOCK_EXAMPLES,
                                      num_steps=2) for s in (1.0, 2.0)]
    import dp_accounting  # pylint: disable=g-import-not-at-top

    expected = accounting.epsilon_of_event(dp_accounting.ComposedDpEvent(events), delta=1e-5)
    assert reports[1]["study"]["epsilon"] == pytest.approx(expected)
    assert set(reports[1]["study"]["runs"]) == {"run_a", "run_b"}
    assert reports[1]["study"]["epsilon"] > reports[1]["epsilon"]


def test_private_normalization_is_released_once_and_reused_on_restart(tmp_path, run_smoke):
    pytest.importorskip("kymatio")
    params = ["tfdp.models.build_scatternet_linear.groups = None",
              "tfdp.train_and_evaluate.data_normalization = {'l2_clip_norm_mean': 1.0, "
              "'l2_clip_norm_square': 1.5, 'noise_multiplier': 8.0, 'threshold': 1e-4}"]
    first = run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"], params)
    released = (tmp_path / "data_normalization.json").read_text()
    again = run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"], params)
    assert (tmp_path / "data_normalization.json").read_text() == released
    assert again["epsilon"] == first["epsilon"]
    assert "private data normalization" in first["extra_mechanisms"][0]["mechanism"]
