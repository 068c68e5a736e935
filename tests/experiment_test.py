"""End to end under smoke.gin on mock data: every workdir output is written."""

import dataclasses
import glob
import json
import os
import shutil

import gin
import numpy as np
import pytest
import tensorflow as tf

from tfdp import models


MOCK_EXAMPLES = 64  # the N that conftest.py's run_smoke trains on


@pytest.mark.slow
def test_smoke_run_writes_every_output(tmp_path, run_smoke, caplog):
    with caplog.at_level("INFO", logger="absl"):  # absl logs the progress lines
        report = run_smoke(tmp_path, ["fashion_mnist.gin"])
    assert report["steps"] == 2
    assert 0 < report["epsilon"] <= 3.0

    config = (tmp_path / "operative_config.gin").read_text()
    assert "NUM_STEPS" in config or "num_steps" in config

    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] == 2
    assert {"step", "epsilon", "delta", "test_accuracy"} <= set(records[-1])
    assert records[-1]["epsilon"] == pytest.approx(report["epsilon"])
    # smoke.gin's eval_examples = 200 on a test split of 64 is evaluated on 64, and the log
    # and every metrics line say so.
    assert records[-1]["test_examples"] == MOCK_EXAMPLES
    assert (f"eval_examples=200 is more than the {MOCK_EXAMPLES} examples of the test split "
            f"'test' of fashion_mnist: every evaluation uses all {MOCK_EXAMPLES}") in caplog.text

    steps = {}  # tag -> the steps it was logged at
    for path in glob.glob(str(tmp_path / "tensorboard" / "*" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                steps.setdefault(value.tag, set()).add(event.step)
    assert steps["epsilon"] == {2} and steps["accuracy"] == {2}  # the optimizer step, not 0
    assert os.path.isdir(tmp_path / "tensorboard" / "validation")
    # Progress: steps of the whole run and the exact epsilon, not "Epoch 1/1".
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines and lines[-1].startswith("step 2/2")
    assert f"epsilon {report['epsilon']:.3f}" in lines[-1]

    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
    saved = json.loads((tmp_path / "privacy_report.json").read_text())
    for key in ("epsilon", "delta", "accountant", "noise_multiplier", "l2_clip_norm",
                "batch_size", "num_examples", "steps", "sampling", "neighbouring_relation",
                "privacy_unit"):
        assert key in saved
    assert saved["num_examples"] == MOCK_EXAMPLES and saved["batch_size"] == 16
    loaded = tf.saved_model.load(str(tmp_path / "export"))
    logits = loaded.serve(tf.zeros([3, 28, 28, 1], tf.uint8))["logits"]
    assert logits.shape == (3, 10)
    assert os.path.exists(tmp_path / "export" / "assets" / "privacy_report.json")


@pytest.mark.slow
def test_num_examples_must_match_the_data(tmp_path, run_smoke):
    with pytest.raises(ValueError, match=f"set NUM_EXAMPLES = {MOCK_EXAMPLES}"):
        run_smoke(tmp_path, ["fashion_mnist.gin"], [f"NUM_EXAMPLES = {MOCK_EXAMPLES + 1}"])
    assert not os.path.exists(tmp_path / "privacy_report.json")


def test_augmenting_precomputed_features_is_refused_before_any_output(tmp_path, run_smoke):
    with pytest.raises(ValueError, match="Set augmult = 0 and augmentation = None"):
        run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"], [
            "tfdp.AugmentationConfig.augmentation = 'mnist_crop'",
            "tfdp.AugmentationConfig.augmult = 4"])
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_recipe_smoke_run_reports_ema_and_augtest_and_the_same_epsilon(tmp_path, run_smoke):
    # augmult changes nothing in the accounting: same epsilon as one view.
    base = run_smoke(tmp_path / "k1", ["fashion_mnist.gin"], [
        "tfdp.AugmentationConfig.augmentation = 'mnist_crop'",
        "tfdp.AugmentationConfig.augmult = 1"])
    recipe = run_smoke(tmp_path / "k8", ["fashion_mnist.gin"], [
        "tfdp.AugmentationConfig.augmentation = 'mnist_crop'",
        "tfdp.AugmentationConfig.augmult = 8",
        "tfdp.OptimizationConfig.accumulation_steps = 2",
        "tfdp.OptimizationConfig.ema_decay = 0.999",
        "tfdp.AugmentationConfig.augtest = True",
        "tfdp.PrivacyConfig.normalize_update = True"])
    assert recipe["epsilon"] == base["epsilon"]
    assert recipe["steps"] == base["steps"] == 2
    assert recipe["exported_parameters"] == "ema"
    last = json.loads((tmp_path / "k8" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("test_accuracy", "test_ema_accuracy", "test_augtest_accuracy"):
        assert 0.0 <= last[key] <= 1.0


@pytest.mark.slow
def test_microbatched_run_states_it_in_the_report(tmp_path, run_smoke):
    report = run_smoke(tmp_path, ["fashion_mnist.gin"], [
        "tfdp.PrivacyConfig.num_microbatches = 4"])
    # fashion_mnist.gin's C = 0.1: the clipped microbatch means give sensitivity 2C.
    assert report["microbatching"] == {"num_microbatches": 4, "sensitivity": pytest.approx(0.2)}
    assert report["noise_stddev"] == pytest.approx(0.2 * report["noise_multiplier"])


@pytest.mark.slow
def test_simulation_is_labelled_in_metrics_and_report(tmp_path, run_smoke):
    simulation = {"reference": "B=2048 sigma=1.93", "reference_batch_size": 2048,
                  "reference_noise_multiplier": 1.93, "reference_epsilon": 3.0}
    report = run_smoke(tmp_path, ["fashion_mnist.gin"], [
        "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 0.5",
        f"tfdp.PrivacyConfig.simulation = {simulation!r}"])
    assert report["simulation"] == simulation
    card = (tmp_path / "privacy_report.md").read_text()
    assert "SIMULATION, NOT A PRIVATE RUN AT THE REFERENCE EPSILON" in card
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["simulation"] is True


@pytest.mark.slow
def test_runs_of_a_study_compose_in_the_ledger(tmp_path, run_smoke):
    from tfdp import accounting  # pylint: disable=g-import-not-at-top

    study = tmp_path / "study"
    reports = [
        run_smoke(tmp_path / name, ["fashion_mnist.gin"], [
            "TARGET_EPSILON = None", f"NOISE_MULTIPLIER = {sigma}",
            f"tfdp.PrivacyConfig.study_dir = '{study}'"])
        for name, sigma in (("run_a", 1.0), ("run_b", 2.0))
    ]
    events = [accounting.dp_sgd_event(noise_multiplier=s, sampling_prob=16 / MOCK_EXAMPLES,
                                      num_steps=2) for s in (1.0, 2.0)]
    import dp_accounting  # pylint: disable=g-import-not-at-top

    expected = accounting.epsilon_of_event(dp_accounting.ComposedDpEvent(events), delta=1e-5)
    assert reports[1]["study"]["epsilon"] == pytest.approx(expected)
    assert set(reports[1]["study"]["runs"]) == {str(tmp_path / "run_a"), str(tmp_path / "run_b")}
    assert reports[1]["study"]["epsilon"] > reports[1]["epsilon"]


def _study_runs(study):
    from tfdp import accounting  # pylint: disable=g-import-not-at-top

    return {r["run"]: r["mechanism"] for r in accounting.read_runs(str(study))}


def test_a_study_run_that_stops_after_starting_is_in_the_study(tmp_path, run_smoke, monkeypatch):
    # Its checkpoints and evaluations are functions of the private data: the study counts it
    # at its planned steps from the start, not only once it has finished.
    from tfdp import experiment  # pylint: disable=g-import-not-at-top

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt("stopped during training")

    monkeypatch.setattr(experiment, "_fit", stopped)
    study = tmp_path / "study"
    with pytest.raises(KeyboardInterrupt):
        run_smoke(tmp_path / "stopped", ["fashion_mnist.gin"], [
            f"tfdp.PrivacyConfig.study_dir = '{study}'"])
    # Named by its workdir's real path, as modes.study_run_name says (unit tests below).
    assert _study_runs(study).keys() == {os.path.realpath(tmp_path / "stopped")}
    (mechanism,) = _study_runs(study).values()
    assert (mechanism.num_steps, mechanism.batch_size) == (2, 16)


# End to end (two ScatterNet smoke runs, 20-50 s on 2 cores): under -m slow. The default suite
# checks the same properties on tfdp.features.cached_features and the report
# (tests/data_normalization_release_test.py).
@pytest.mark.slow
def test_private_normalization_is_released_once_and_reused_on_restart(tmp_path, run_smoke):
    pytest.importorskip("kymatio")
    params = ["tfdp.models.build_scatternet_linear.groups = None",
              "tfdp.PrivacyConfig.data_normalization = {'l2_clip_norm_mean': 1.0, "
              "'l2_clip_norm_square': 1.5, 'noise_multiplier': 8.0, 'threshold': 1e-4}"]
    first = run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"], params)
    released = (tmp_path / "data_normalization.json").read_text()
    again = run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"], params)
    assert (tmp_path / "data_normalization.json").read_text() == released
    assert again["epsilon"] == first["epsilon"]
    assert "private data normalization" in first["extra_mechanisms"][0]["mechanism"]


def _checkpoint_tensor(workdir, name):
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(workdir / "checkpoints")))
    return reader.get_tensor(f"ledger/{name}/.ATTRIBUTES/VARIABLE_VALUE")


FIXED_SIGMA = ["TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0"]


def test_sampling_and_noise_seeds_are_secret_by_default(tmp_path, run_smoke):
    # The same config twice, the noise fixed: the batches differ, because the sampling
    # seed comes from OS entropy (before, seed = 0 made them public and identical). At a
    # fixed sigma: the seeds do not depend on how sigma is found.
    fixed_noise = ["tfdp.PrivacyConfig.noise_seed = 11", *FIXED_SIGMA]
    reports = [run_smoke(tmp_path / name, ["fashion_mnist.gin"], fixed_noise)
               for name in ("a", "b")]
    seeds = [int(_checkpoint_tensor(tmp_path / name, "sampling_seed")) for name in ("a", "b")]
    assert seeds[0] != seeds[1]
    weights = [tf.train.load_checkpoint(tf.train.latest_checkpoint(
        str(tmp_path / name / "checkpoints"))) for name in ("a", "b")]
    kernel = "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
    assert not np.array_equal(weights[0].get_tensor(kernel), weights[1].get_tensor(kernel))
    # The seed is written nowhere but the checkpoint.
    for name, seed in zip(("a", "b"), seeds):
        workdir = tmp_path / name
        for path in glob.glob(str(workdir / "**" / "*"), recursive=True):
            if os.path.isfile(path) and "/checkpoints/" not in path:
                content = open(path, "rb").read()
                assert str(seed).encode() not in content, path
    assert reports[0]["seeds"]["sampling_seed"].startswith("secret")
    assert reports[0]["seeds"]["noise_seed"].startswith("fixed by the user")


@pytest.mark.slow
def test_a_fixed_sampling_seed_reproduces_the_batches_and_is_reported(tmp_path, run_smoke):
    fixed = ["tfdp.PrivacyConfig.noise_seed = 11", "tfdp.PrivacyConfig.sampling_seed = 5"]
    reports = [run_smoke(tmp_path / name, ["fashion_mnist.gin"], fixed) for name in ("a", "b")]
    kernel = "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
    a, b = (tf.train.load_checkpoint(tf.train.latest_checkpoint(
        str(tmp_path / name / "checkpoints"))).get_tensor(kernel) for name in ("a", "b"))
    np.testing.assert_array_equal(a, b)
    assert reports[0]["seeds"]["sampling_seed"].startswith("fixed by the user")
    assert "assumes this seed stays secret" in (tmp_path / "a" / "privacy_report.md").read_text()



@pytest.fixture(scope="module")
def fixed_sigma_run(tmp_path_factory, run_smoke_module):
    """A finished 2-step run of fashion_mnist.gin at sigma = 1 (copy it before changing it)."""
    workdir = tmp_path_factory.mktemp("fixed_sigma") / "wd"
    run_smoke_module(workdir, ["fashion_mnist.gin"], FIXED_SIGMA)
    return workdir


@pytest.mark.parametrize("change, field", [
    ("tfdp.PrivacyConfig.accountant = 'pld'", "accountant"),
    ("tfdp.PrivacyConfig.normalize_update = True", "normalize_update"),
    ("tfdp.PrivacyConfig.num_microbatches = 4", "num_microbatches"),
    ("tfdp.PrivacyConfig.sampling_seed = 3", "fixed_seeds"),
])
def test_resuming_under_another_mechanism_is_refused_naming_the_field(
        tmp_path, run_smoke, fixed_sigma_run, change, field):
    # Before, only sigma, q, C and delta were compared: a switch from RDP to PLD on a
    # half-finished run silently changed the epsilon series in metrics.jsonl.
    params = FIXED_SIGMA
    tmp_path = tmp_path / "wd"
    shutil.copytree(fixed_sigma_run, tmp_path)  # one finished 2-step run, a copy per case
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=rf"another privacy mechanism:\n  {field}"):
        run_smoke(tmp_path, ["fashion_mnist.gin"], [*params, "NUM_STEPS = 4", change])
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing written
    assert (tmp_path / "privacy_report.json").exists()  # nothing deleted


# End to end (two ScatterNet smoke runs, 20-50 s on 2 cores): under -m slow. The default suite
# checks the same properties on tfdp.features.cached_features and the report
# (tests/data_normalization_release_test.py).
@pytest.mark.slow
def test_a_normalization_released_under_other_settings_is_refused(tmp_path, run_smoke):
    pytest.importorskip("kymatio")
    norm = ("tfdp.PrivacyConfig.data_normalization = {'l2_clip_norm_mean': 1.0, "
            "'l2_clip_norm_square': 1.5, 'noise_multiplier': %s, 'threshold': 1e-4}")
    params = ["tfdp.models.build_scatternet_linear.groups = None", "NUM_STEPS = 1"]
    run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"], [*params, norm % 8.0])
    released = json.loads((tmp_path / "data_normalization.json").read_text())
    assert released["released_with"]["noise_multiplier"] == 8.0
    # Even without a checkpoint to compare with: only the release is left, as after a kill
    # between the release and the first checkpoint (any other output would refuse the
    # workdir as used, tests/workdir_test.py).
    for path in tmp_path.iterdir():
        if path.name != "data_normalization.json":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(ValueError, match="released with .*'noise_multiplier': 8.0"):
        run_smoke(tmp_path, ["fashion_mnist_scatternet_linear.gin"], [*params, norm % 4.0])


@gin.configurable(module="tests")
def five_logits(num_classes, input_shape):
    """A builder that ignores num_classes: 5 logits whatever the dataset."""
    del num_classes
    return models.build_tramer_cnn(5, input_shape=input_shape)


def test_a_model_narrower_than_the_classes_is_refused_before_training(tmp_path, run_smoke):
    # 5 logits for Fashion-MNIST's 10 classes: labels 5-9 used to end in a 25 KB traceback
    # from inside the loss.
    with pytest.raises(ValueError, match=r"has 10 classes: the model must return logits "
                                         r"\[batch, 10\]"):
        run_smoke(tmp_path, ["fashion_mnist.gin"], [
            "tfdp.train_and_evaluate.model_fn = @tests.five_logits"])
    assert not os.path.exists(tmp_path / "checkpoints")


def test_binding_what_the_trainer_sets_is_refused_not_ignored(tmp_path, run_smoke):
    with pytest.raises(ValueError, match="num_classes is bound in the gin config"):
        run_smoke(tmp_path, ["fashion_mnist.gin"], ["tfdp.models.build_tramer_cnn.num_classes = 5"])


def _study_mechanism(batch_size=16):
    from tfdp import accounting  # pylint: disable=g-import-not-at-top

    return accounting.DPMechanism(num_examples=64, batch_size=batch_size, num_steps=2,
                                  noise_multiplier=1.0, l2_clip_norm=0.1, delta=1e-5)


def test_two_runs_whose_workdirs_share_a_name_are_two_runs_of_the_study(tmp_path):
    # Keyed by the folder's last name, b/run was one line with a/run: a/run's epsilon was lost.
    from tfdp import modes  # pylint: disable=g-import-not-at-top

    study = tmp_path / "study"
    for parent, sigma in (("a", 1.0), ("b", 2.0)):
        mechanism = dataclasses.replace(_study_mechanism(), noise_multiplier=sigma)
        result = modes._record_in_study(study, tmp_path / parent / "run", mechanism,
                                        sampling_seed=None, fresh=True)
    runs = _study_runs(study)
    assert {path: m.noise_multiplier for path, m in runs.items()} == {
        str(tmp_path / "a" / "run"): 1.0, str(tmp_path / "b" / "run"): 2.0}
    assert len(result["runs"]) == 2
    assert result["epsilon"] > max(result["runs"].values())


def test_a_fresh_run_in_a_workdir_the_study_counts_already_is_refused(tmp_path):
    # The workdir of an earlier run was removed and the name used again: replacing that
    # run's line would forget its privacy. A resume of the same workdir replaces its own line.
    from tfdp import modes  # pylint: disable=g-import-not-at-top

    study, workdir = tmp_path / "study", tmp_path / "trial"
    modes._record_in_study(study, workdir, _study_mechanism(), sampling_seed=None, fresh=True)
    ledger = (study / "ledger.jsonl").read_text()
    with pytest.raises(ValueError, match="already counts a run in .*trial.*new workdir"):
        modes._record_in_study(study, workdir, _study_mechanism(), sampling_seed=None,
                               fresh=True)
    assert (study / "ledger.jsonl").read_text() == ledger
    modes._record_in_study(study, workdir, _study_mechanism(), sampling_seed=None, fresh=False)
    assert len(_study_runs(study)) == 1


def test_a_run_the_study_cannot_compose_leaves_the_ledger_as_it_was(tmp_path):
    # Two runs with one fixed sampling seed and other batch sizes cannot be composed: the
    # refused run's line must not stay behind, or every later run of the study would fail.
    from tfdp import modes  # pylint: disable=g-import-not-at-top

    study = tmp_path / "study"
    modes._record_in_study(study, tmp_path / "a", _study_mechanism(), sampling_seed=7)
    before = (study / "ledger.jsonl").read_text()
    with pytest.raises(ValueError, match="share a fixed sampling seed"):
        modes._record_in_study(study, tmp_path / "b", _study_mechanism(8), sampling_seed=7)
    assert (study / "ledger.jsonl").read_text() == before
    modes._record_in_study(study, tmp_path / "c", _study_mechanism(8), sampling_seed=None)
    assert len(_study_runs(study)) == 2


def test_a_run_refused_before_its_first_step_leaves_no_study_line(tmp_path, run_smoke):
    # Refused while its model was built: its study line stayed, and the same command without
    # the bad binding was refused as "an earlier run in this workdir, since removed".
    study, workdir = tmp_path / "study", tmp_path / "trial"
    with pytest.raises(ValueError, match="num_classes is bound"):
        run_smoke(workdir, ["fashion_mnist.gin"], [
            f"tfdp.PrivacyConfig.study_dir = '{study}'",
            "tfdp.models.build_tramer_cnn.num_classes = 5"])
    assert not (study / "ledger.jsonl").exists()
    run_smoke(workdir, ["fashion_mnist.gin"], [f"tfdp.PrivacyConfig.study_dir = '{study}'"])
    assert set(_study_runs(study)) == {os.path.realpath(workdir)}


def test_the_study_refusals_come_before_anything_is_written(tmp_path):
    from tfdp import modes  # pylint: disable=g-import-not-at-top

    study = tmp_path / "study"
    modes._record_in_study(study, tmp_path / "a", _study_mechanism(), sampling_seed=7)
    before = (study / "ledger.jsonl").read_text()
    check = modes._record_in_study(study, tmp_path / "b", _study_mechanism(), sampling_seed=None,
                                   fresh=True, write=False)
    assert set(check["runs"]) == {str(tmp_path / "a"), str(tmp_path / "b")}
    with pytest.raises(ValueError, match="already counts a run"):
        modes._record_in_study(study, tmp_path / "a", _study_mechanism(), sampling_seed=7,
                               fresh=True, write=False)
    with pytest.raises(ValueError, match="share a fixed sampling seed"):
        modes._record_in_study(study, tmp_path / "c", _study_mechanism(8), sampling_seed=7,
                               write=False)
    assert (study / "ledger.jsonl").read_text() == before


STUDY_WORKER = """
import sys
from tfdp import accounting, modes
study, worker, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
mechanism = accounting.DPMechanism(num_examples=64, batch_size=16, num_steps=2,
                                   noise_multiplier=1.0, l2_clip_norm=0.1, delta=1e-5)
for i in range(runs):
    workdir = f"{study}-runs/{worker}-{i}"
    modes._record_in_study(study, workdir, mechanism, sampling_seed=None, fresh=True)  # start
    if i % 3 == 2:  # a refused start: a run sharing a fixed seed at another batch size
        try:
            modes._record_in_study(study, workdir + "-refused", accounting.DPMechanism(
                num_examples=64, batch_size=8, num_steps=2, noise_multiplier=1.0,
                l2_clip_norm=0.1, delta=1e-5), sampling_seed=7)
            modes._record_in_study(study, workdir + "-fixed", mechanism, sampling_seed=7)
        except ValueError:
            pass
    modes._record_in_study(study, workdir, mechanism, sampling_seed=None)  # finish
"""


@pytest.mark.slow
def test_runs_of_a_study_starting_and_finishing_at_once_are_all_counted(tmp_path):
    # Through the trainer's own read-modify-write, with its epsilon and its restore on a
    # refusal: 4 processes of 4 runs (tests/accounting/ledger_test.py: 4 x 200 appends).
    from tests.accounting.ledger_test import _workers  # pylint: disable=g-import-not-at-top

    study = tmp_path / "study"
    _workers(STUDY_WORKER, [(study, w, 4) for w in range(4)])
    names = set(_study_runs(study))
    expected = {f"{study}-runs/{w}-{i}" for w in range(4) for i in range(4)}
    assert expected <= names
    fixed = names - expected  # the first fixed-seed run of each worker's kind is counted
    assert fixed and all(n.endswith("-fixed") or n.endswith("-refused") for n in fixed)


def test_a_run_that_releases_its_data_normalization_is_in_the_study_first(tmp_path, run_smoke,
                                                                          monkeypatch):
    # The private normalization is released while the model is built, before checkpoint 0:
    # the study line comes before it, so a refusal after the release still counts the run.
    from tfdp import experiment  # pylint: disable=g-import-not-at-top

    def refused(*args, **kwargs):
        raise ValueError("refused while the model is built")

    monkeypatch.setattr(experiment, "_build", refused)
    study = tmp_path / "study"
    with pytest.raises(ValueError, match="refused while the model is built"):
        run_smoke(tmp_path / "trial", ["fashion_mnist.gin"], [
            f"tfdp.PrivacyConfig.study_dir = '{study}'",
            "tfdp.PrivacyConfig.data_normalization = {'l2_clip_norm_mean': 1.0, "
            "'l2_clip_norm_square': 1.5, 'noise_multiplier': 8.0, 'threshold': 1e-4}"])
    assert set(_study_runs(study)) == {os.path.realpath(tmp_path / "trial")}
