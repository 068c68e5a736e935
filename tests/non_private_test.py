"""privacy=None: non-private training through the same trainer."""

import json
import os
import shutil

import pytest
import tensorflow as tf

from tfdp.export import privacy_report
from tfdp.training import DPModel

NOT_PRIVATE = ["tfdp.train_and_evaluate.privacy = None"]
NOT_PRIVATE_FILES = {"NOT_PRIVATE.json", "NOT_PRIVATE.md"}
REPORT_FILES = {"privacy_report.json", "privacy_report.md"}


@pytest.fixture(scope="module")
def non_private_run(tmp_path_factory, run_smoke_module):
    """One 2-step non-private run of fashion_mnist.gin, with its warnings."""
    workdir = tmp_path_factory.mktemp("non_private")
    with _absl_warnings() as warnings:
        report = run_smoke_module(workdir, ["fashion_mnist.gin"], [
            *NOT_PRIVATE, "tfdp.PrivacyConfig.num_microbatches = 4",
            "tfdp.PrivacyConfig.normalize_update = True"])
    return workdir, report, warnings


class _absl_warnings:
    """Collects the absl WARNING messages of a block (caplog is function-scoped)."""

    def __enter__(self):
        import logging  # pylint: disable=g-import-not-at-top

        self.messages = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        logging.getLogger("absl").addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc):
        import logging  # pylint: disable=g-import-not-at-top

        logging.getLogger("absl").removeHandler(self.handler)


@pytest.mark.slow
def test_non_private_run_trains_and_exports_not_private(non_private_run):
    workdir, report, _ = non_private_run
    assert report["privacy"] == "NOT PRIVATE" and "epsilon" not in report
    assert report["steps"] == 2 and report["num_examples"] == 64
    files = set(os.listdir(workdir))
    assert NOT_PRIVATE_FILES <= files and not files & REPORT_FILES
    assets = set(os.listdir(workdir / "export" / "assets"))
    assert assets == NOT_PRIVATE_FILES  # no privacy report in the export either
    for name in NOT_PRIVATE_FILES:
        assert (workdir / name).read_bytes() == (workdir / "export" / "assets" / name).read_bytes()
    assert (workdir / "NOT_PRIVATE.md").read_text().startswith("# NOT PRIVATE")
    finished = json.loads((workdir / "FINISHED").read_text())
    assert finished["privacy"] == "NOT PRIVATE" and "epsilon" not in finished
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert records and all(r["privacy"] == "NOT PRIVATE" for r in records)
    assert not any("epsilon" in r or "delta" in r for r in records)
    assert records[-1]["step"] == 2 and "test_accuracy" in records[-1]
    loaded = tf.saved_model.load(str(workdir / "export"))
    assert loaded.serve(tf.zeros([3, 28, 28, 1], tf.uint8))["logits"].shape == (3, 10)
    # The checkpoint holds no private record (no mechanism), and its mark says so.
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(workdir / "checkpoints")))
    assert reader.get_tensor("ledger/privacy/.ATTRIBUTES/VARIABLE_VALUE") == b"NOT PRIVATE"
    assert not reader.has_tensor("ledger/mechanism_json/.ATTRIBUTES/VARIABLE_VALUE")


def test_unused_privacy_settings_are_warned_and_recorded(non_private_run):
    workdir, report, warnings = non_private_run
    unused = report["unused_privacy_settings"]
    # fashion_mnist.gin binds these; the test added the last two.
    assert unused["l2_clip_norm"] == 0.1 and unused["target_epsilon"] == 3.0
    assert unused["target_delta"] == 1e-5 and unused["accountant"] == "rdp"
    assert unused["num_microbatches"] == 4 and unused["normalize_update"] is True
    assert "clipping" not in unused and "noise_seed" not in unused  # not given
    warning = next(m for m in warnings if m.startswith("NOT PRIVATE:"))
    for text in ("l2_clip_norm=0.1", "target_epsilon=3.0", "num_microbatches=4",
                 "normalize_update=True", "NOT used"):
        assert text in warning
    md = (workdir / "NOT_PRIVATE.md").read_text()
    assert "`num_microbatches`: 4" in md and "`l2_clip_norm`: 0.1" in md
    assert any(m.startswith("Done: NOT PRIVATE") for m in warnings)


@pytest.mark.parametrize("name, value", [
    ("data_normalization", "{'l2_clip_norm_mean': 1.0, 'l2_clip_norm_square': 1.5, "
                           "'noise_multiplier': 8.0, 'threshold': 1e-4}"),
    ("study_dir", "'STUDY'"),
])
def test_settings_without_a_non_private_meaning_are_refused(tmp_path, run_smoke, name, value):
    value = value.replace("STUDY", str(tmp_path / "study"))
    with pytest.raises(ValueError, match=f"privacy=None .NOT PRIVATE. does not take {name}"):
        run_smoke(tmp_path / "w", ["fashion_mnist_scatternet_linear.gin"],
                  [*NOT_PRIVATE, f"tfdp.PrivacyConfig.{name} = {value}"])
    assert not os.listdir(tmp_path)


def test_unknown_privacy_mode_is_refused(tmp_path, run_smoke):
    with pytest.raises(ValueError, match="use 'dp' .* or None"):
        run_smoke(tmp_path / "w", ["fashion_mnist.gin"],
                  ["tfdp.train_and_evaluate.privacy = 'none'"])
    assert not os.listdir(tmp_path)


def test_a_private_workdir_is_not_resumed_without_privacy(tmp_path, run_smoke):
    run_smoke(tmp_path, ["fashion_mnist.gin"])
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match=r"is of a PRIVATE \(DP-SGD\) run; this run has "
                                         r"privacy=None"):
        run_smoke(tmp_path, ["fashion_mnist.gin"], [*NOT_PRIVATE, "NUM_STEPS = 4"])
    assert sorted(os.listdir(tmp_path)) == before


def test_a_non_private_workdir_is_not_resumed_privately(tmp_path, run_smoke, non_private_run):
    workdir = tmp_path / "wd"  # a copy of the module's non-private run
    shutil.copytree(non_private_run[0], workdir)
    before = sorted(os.listdir(workdir))
    with pytest.raises(ValueError, match="is of a NON-PRIVATE run"):
        run_smoke(workdir, ["fashion_mnist.gin"], ["NUM_STEPS = 4"])
    assert sorted(os.listdir(workdir)) == before
    assert not REPORT_FILES & set(before)


@pytest.mark.slow
def test_a_non_private_run_resumes_and_a_finished_one_is_returned(tmp_path, run_smoke):
    run_smoke(tmp_path, ["fashion_mnist.gin"], NOT_PRIVATE)
    again = run_smoke(tmp_path, ["fashion_mnist.gin"], NOT_PRIVATE)  # finished: untouched
    assert again == json.loads((tmp_path / "NOT_PRIVATE.json").read_text())
    more = run_smoke(tmp_path, ["fashion_mnist.gin"], [*NOT_PRIVATE, "NUM_STEPS = 4",
                                                       "tfdp.EvaluationConfig.eval_every_steps = 4"])
    assert more["steps"] == 4 and more["privacy"] == "NOT PRIVATE"


def test_a_private_run_keeps_the_dp_model_and_its_report(tmp_path, run_smoke, monkeypatch):
    built = []
    # Every update of the trainer's (chunked) input ends in _update_from_total.
    monkeypatch.setattr(DPModel, "_update_from_total",
                        lambda self, total, _update=DPModel._update_from_total: (
                            built.append(self), _update(self, total))[1])
    report = run_smoke(tmp_path, ["fashion_mnist.gin"],
                       ["tfdp.DataConfig.train_split = 'train[:64]'"])
    assert built and all(type(m) is DPModel for m in built)  # not NonPrivateModel
    assert 0 < report["epsilon"] <= 3.0 and "privacy" not in report
    assert report["hyperparameters"]["train_split"] == "train[:64]"
    files = set(os.listdir(tmp_path))
    assert REPORT_FILES <= files and not files & NOT_PRIVATE_FILES
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("epsilon" in r and "privacy" not in r for r in records)
    md = (tmp_path / "privacy_report.md").read_text()
    assert "the slice `train[:64]`" in md and "N = 64 counts only the examples of this slice" in md


def test_a_private_run_still_needs_a_clip_norm(tmp_path, run_smoke):
    with pytest.raises(ValueError, match="needs l2_clip_norm: set tfdp.PrivacyConfig.l2_clip_norm"):
        run_smoke(tmp_path / "w", ["fashion_mnist.gin"], ["L2_CLIP_NORM = None"])


def test_the_report_of_a_whole_split_has_no_slice_sentence():
    report = {"hyperparameters": {"train_split": "train", "dataset": "d"}, "num_examples": 5}
    assert privacy_report._split_lines(report) == []
    report["hyperparameters"]["train_split"] = "train[2000:]"
    (line, _) = privacy_report._split_lines(report)
    assert "`train[2000:]`" in line and "N = 5 counts only" in line


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    "fashion_mnist.gin",
    pytest.param("fashion_mnist_recipe.gin", marks=pytest.mark.slow),
    "fashion_mnist_recipe_cnn.gin",  # augmult views, EMA, AugTest
    pytest.param("fashion_mnist_scatternet_cnn.gin", marks=pytest.mark.slow),
    pytest.param("fashion_mnist_scatternet_linear.gin", marks=pytest.mark.slow),
    pytest.param("fashion_mnist_best.gin", marks=pytest.mark.slow),
    "fashion_mnist_public_pretrain.gin",
])
def test_every_fashion_mnist_config_runs_without_privacy(tmp_path, run_smoke, config):
    params = [*NOT_PRIVATE]
    if config == "fashion_mnist_public_pretrain.gin":
        params.append("tfdp.DataConfig.train_split = 'train'")  # the mock has 64
    report = run_smoke(tmp_path, [config], params)
    assert report["privacy"] == "NOT PRIVATE" and report["steps"] == 2
    assert set(os.listdir(tmp_path / "export" / "assets")) == NOT_PRIVATE_FILES


@pytest.mark.slow
def test_the_model_is_checkpointed_where_a_private_run_keeps_it(non_private_run, tmp_path,
                                                                run_smoke):
    # A workdir used as a pretrained backbone (tfdp.models.build_finetune_model) reads the
    # model's variables at the same checkpoint keys whichever mode trained it.
    def model_keys(workdir):
        path = tf.train.latest_checkpoint(str(workdir / "checkpoints"))
        return {k for k, _ in tf.train.list_variables(path) if k.startswith("model/")}

    run_smoke(tmp_path, ["fashion_mnist.gin"])
    assert model_keys(non_private_run[0]) == model_keys(tmp_path)


def test_static_batches_and_the_progress_bar_work_without_privacy(tmp_path, run_smoke, capsys):
    report = run_smoke(tmp_path, ["fashion_mnist.gin"], [
        *NOT_PRIVATE, "tfdp.RuntimeConfig.static_batch_size = 'auto'",
        "tfdp.RuntimeConfig.progress_bar = True"])
    # N = 64, B = 16, 2 steps: the smallest S with truncation probability <= 1e-6.
    truncation = report["truncation"]
    assert 16 < truncation["static_batch_size"] <= 64
    assert truncation["truncation_probability"] <= 1e-6
    out = capsys.readouterr().out
    assert "NOT PRIVATE" in out and "epsilon" not in out


def _plan_without_privacy(params):
    """The non-private mode's plan of fashion_mnist.gin with `params` (no I/O)."""
    import gin  # pylint: disable=g-import-not-at-top

    from tfdp import configs, main, modes  # pylint: disable=g-import-not-at-top

    gin.clear_config()
    try:
        main.parse_config(["fashion_mnist.gin"], [*NOT_PRIVATE, *params])
        config = configs.RunConfig.from_gin(privacy=None)
        return modes.make_mode(None).plan(config, tf.distribute.get_strategy())
    finally:
        gin.clear_config()


def test_an_unknown_clipping_is_refused_without_privacy_too():
    with pytest.raises(ValueError, match="clipping='bogus': clipping must be one of"):
        _plan_without_privacy(["tfdp.PrivacyConfig.clipping = 'bogus'"])
    plan = _plan_without_privacy(["tfdp.PrivacyConfig.clipping = 'ghost'"])
    assert plan.unused_privacy_settings["clipping"] == "ghost"


def test_refused_settings_bound_to_nothing_are_not_listed_as_unused():
    plan = _plan_without_privacy(["tfdp.PrivacyConfig.data_normalization = None",
                                  "tfdp.PrivacyConfig.study_dir = None",
                                  "tfdp.PrivacyConfig.sampling_seed = 5"])
    unused = plan.unused_privacy_settings
    assert "data_normalization" not in unused and "study_dir" not in unused
    assert unused["sampling_seed"] == 5 and unused["l2_clip_norm"] == 0.1


def test_the_statement_gives_the_seed_the_batches_used():
    """The record's seed (a resumed checkpoint's), not the config's, is what sampled the batches."""
    import types  # pylint: disable=g-import-not-at-top

    import keras  # pylint: disable=g-import-not-at-top

    from tfdp import modes  # pylint: disable=g-import-not-at-top
    from tfdp import planning  # pylint: disable=g-import-not-at-top

    plan = planning.NonPrivatePlan(num_examples=10, batch_size=2, num_steps=3)
    config = types.SimpleNamespace(
        data=types.SimpleNamespace(dataset="d", train_split="train"),
        augmentation=types.SimpleNamespace(augmentation=None, augmult=0, augtest=False),
        optimization=types.SimpleNamespace(accumulation_steps=1, ema_decay=None),
        runtime=types.SimpleNamespace(seed=0))
    dp_model = types.SimpleNamespace(optimizer=keras.optimizers.SGD(0.1))
    record = types.SimpleNamespace(sampling_seed=tf.constant(5, tf.int64))
    report = modes.NonPrivateMode().report(plan, config=config, dp_model=dp_model,
                                           checkpoint_record=record, steps_done=3, workdir="w",
                                           chief=True)
    assert report["hyperparameters"]["sampling_seed"] == 5
