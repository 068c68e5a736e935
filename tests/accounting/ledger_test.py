"""Tests for tfdp.accounting.ledger (How to DP-fy ML, Sec. 5.4.2)."""

import dataclasses
import json
import math
import os

import dp_accounting
import pytest

from tfdp import accounting
from tfdp.accounting import ledger

NORM = accounting.DataNormalization(noise_multiplier=8.0, l2_clip_norm_mean=0.3,
                                    l2_clip_norm_square=0.15, threshold=1e-4)


def _mechanism(sigma, steps, **kwargs):
    # De et al. 2022, Table 12: N = 50,000, B = 4096 (q = 0.08192).
    return accounting.DPMechanism(num_examples=50000, batch_size=4096, num_steps=steps,
                                  noise_multiplier=sigma, l2_clip_norm=1.0, delta=1e-5, **kwargs)


RUNS = [
    dict(run_name="a", mechanism=_mechanism(3.0, 1843)),
    dict(run_name="b", mechanism=_mechanism(5.0, 1593)),
    dict(run_name="c", mechanism=_mechanism(4.0, 1000, data_normalization=NORM)),
]


def _sgd(sigma, q, steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )


def _explicit_study_event():
    return dp_accounting.ComposedDpEvent(
        [
            _sgd(3.0, 0.08192, 1843),
            _sgd(5.0, 0.08192, 1593),
            dp_accounting.ComposedDpEvent(
                [
                    _sgd(4.0, 0.08192, 1000),
                    dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(8.0), 2),
                ]
            ),
        ]
    )


def _write_study(study_dir):
    for run in RUNS:
        accounting.append_run(study_dir, **run)


def test_append_run_creates_dir_and_writes_one_line_per_run(tmp_path):
    study_dir = tmp_path / "study" / "nested"
    _write_study(study_dir)
    lines = (study_dir / "ledger.jsonl").read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["run"] == "a"
    assert first["mechanism"] == RUNS[0]["mechanism"].to_dict()
    assert first["sampling_coins"] == "secret"
    assert "timestamp" in first
    assert json.loads(lines[2])["mechanism"]["data_normalization"]["noise_multiplier"] == 8.0


def test_study_event_is_the_composition_of_the_runs(tmp_path):
    _write_study(tmp_path)
    assert accounting.study_event(tmp_path) == _explicit_study_event()


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_study_epsilon_equals_epsilon_of_the_composed_event(tmp_path, acc):
    _write_study(tmp_path)
    total, per_run = accounting.study_epsilon(tmp_path, delta=1e-5, accountant=acc)
    assert total == pytest.approx(
        accounting.epsilon_of_event(_explicit_study_event(), delta=1e-5, accountant=acc), rel=1e-9
    )
    assert [name for name, _ in per_run] == ["a", "b", "c"]
    # Run "a" alone is De et al. 2022 Table 12, eps=6 (RDP 5.952).
    assert per_run[0][1] == pytest.approx(
        accounting.compute_epsilon(
            noise_multiplier=3.0, sampling_prob=0.08192, num_steps=1843, delta=1e-5, accountant=acc
        )
    )
    # Composition costs more than the worst run, less than the sum.
    epsilons = [eps for _, eps in per_run]
    assert max(epsilons) < total < sum(epsilons)


def test_data_normalization_adds_privacy_cost(tmp_path):
    _write_study(tmp_path)
    _, per_run = accounting.study_epsilon(tmp_path, delta=1e-5)
    without_norm = accounting.compute_epsilon(
        noise_multiplier=4.0, sampling_prob=0.08192, num_steps=1000, delta=1e-5
    )
    assert per_run[2][1] > without_norm


def test_reappending_a_run_replaces_it(tmp_path):
    _write_study(tmp_path)
    before, _ = accounting.study_epsilon(tmp_path, delta=1e-5)
    # Same run appended again after a resume: not counted twice.
    accounting.append_run(tmp_path, **RUNS[0])
    after, per_run = accounting.study_epsilon(tmp_path, delta=1e-5)
    assert after == pytest.approx(before, rel=1e-12)
    assert len(per_run) == 3
    # A resumed run that ran longer replaces the old record, in place.
    accounting.append_run(tmp_path, run_name="a", mechanism=_mechanism(3.0, 2468))
    records = accounting.read_runs(tmp_path)
    assert [r["run"] for r in records] == ["a", "b", "c"]
    assert records[0]["mechanism"].num_steps == 2468
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_runs_sharing_a_fixed_sampling_seed_train_on_the_same_batches(tmp_path):
    # Two runs with the same fixed seed, N and B see the same Poisson batch at every shared
    # step: one subsampled mechanism per step, sigma_eff = (3^-2 + 5^-2)^(-1/2), not two
    # independently subsampled ones.
    accounting.append_run(tmp_path, run_name="a", mechanism=_mechanism(3.0, 1000),
                          sampling_seed=7)
    accounting.append_run(tmp_path, run_name="b", mechanism=_mechanism(5.0, 600),
                          sampling_seed=7)
    accounting.append_run(tmp_path, run_name="c", mechanism=_mechanism(4.0, 500))
    records = accounting.read_runs(tmp_path)
    assert records[0]["sampling_coins"] == records[1]["sampling_coins"] != "secret"
    assert "7" not in records[0]["sampling_coins"].split(":")[0]  # a fingerprint, not the seed
    joint = (3.0 ** -2 + 5.0 ** -2) ** -0.5
    assert accounting.study_event(tmp_path) == dp_accounting.ComposedDpEvent([
        _sgd(4.0, 0.08192, 500),
        dp_accounting.ComposedDpEvent([_sgd(joint, 0.08192, 600), _sgd(3.0, 0.08192, 400)]),
    ])
    # With other seeds the two runs would be independent: a different total.
    independent = accounting.epsilon_of_event(dp_accounting.ComposedDpEvent(
        [_sgd(3.0, 0.08192, 1000), _sgd(5.0, 0.08192, 600), _sgd(4.0, 0.08192, 500)]),
        delta=1e-5)
    total, _ = accounting.study_epsilon(tmp_path, delta=1e-5)
    assert not math.isclose(total, independent, rel_tol=1e-6)


def test_a_shared_fixed_seed_with_another_batch_size_is_refused(tmp_path):
    accounting.append_run(tmp_path, run_name="a", mechanism=_mechanism(3.0, 100),
                          sampling_seed=7)
    other = dataclasses.replace(_mechanism(3.0, 100), batch_size=2048)
    accounting.append_run(tmp_path, run_name="b", mechanism=other, sampling_seed=7)
    with pytest.raises(ValueError, match="share a fixed sampling seed"):
        accounting.study_epsilon(tmp_path, delta=1e-5)


def test_run_event_is_the_mechanism_event(tmp_path):
    _write_study(tmp_path)
    record = accounting.read_runs(tmp_path)[0]
    assert accounting.run_event(record) == _sgd(3.0, 0.08192, 1843)


def test_missing_ledger_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="No ledger at .*ledger.jsonl"):
        accounting.study_epsilon(tmp_path, delta=1e-5)


def test_malformed_ledger_lines_raise(tmp_path):
    path = tmp_path / ledger.LEDGER_FILENAME
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"ledger.jsonl:1 is not valid JSON"):
        accounting.read_runs(tmp_path)
    path.write_text(json.dumps({"run": "x", "mechanism": {}}) + "\n")
    with pytest.raises(ValueError, match=r"misses the keys \['sampling_coins'\]"):
        accounting.read_runs(tmp_path)
    path.write_text(json.dumps({"run": "x", "noise_multiplier": 1.0, "sampling_prob": 0.1,
                                "num_steps": 3}) + "\n")
    with pytest.raises(ValueError, match="written by an older tfdp"):
        accounting.read_runs(tmp_path)
    path.write_text(json.dumps({"run": "x", "sampling_coins": "secret", "mechanism": {
        **_mechanism(3.0, 10).to_dict(), "noise_multiplier": 0.0}}) + "\n")
    with pytest.raises(ValueError, match="ledger.jsonl:1: invalid mechanism: noise_multiplier"):
        accounting.read_runs(tmp_path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(run_name=""), "run_name must be a non-empty string"),
        (dict(mechanism={"noise_multiplier": 1.0}), "mechanism must be a DPMechanism"),
    ],
)
def test_append_run_errors(tmp_path, kwargs, match):
    args = {**RUNS[0], **kwargs}
    with pytest.raises(ValueError, match=match):
        accounting.append_run(tmp_path, **args)
    assert not (tmp_path / ledger.LEDGER_FILENAME).exists()


# -- Concurrent runs of one study ---------------------------------------------------------

CONCURRENT = """
import sys
from tfdp import accounting
from tfdp.accounting import ledger
study, worker, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
planned = accounting.DPMechanism(num_examples=50000, batch_size=4096, num_steps=1000,
                                 noise_multiplier=3.0, l2_clip_norm=1.0, delta=1e-5)
taken = accounting.DPMechanism(num_examples=50000, batch_size=4096, num_steps=7,
                               noise_multiplier=3.0, l2_clip_norm=1.0, delta=1e-5)
for i in range(runs):
    name = f"{worker}/{i}"
    ledger.append_run(study, run_name=name, mechanism=planned)  # the start of a run
    ledger.append_run(study, run_name=name, mechanism=taken)  # its finish: replaces its line
"""


def _workers(script, args_per_worker):
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env,
                              stderr=subprocess.PIPE, text=True) for args in args_per_worker]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]


def test_concurrent_runs_lose_no_line(tmp_path):
    # Without the study's lock, 4 processes x 200 start/finish pairs lost 450-557 of 800
    # lines: a finishing run's rewrite dropped the lines others appended meanwhile.
    study = tmp_path / "study"
    _workers(CONCURRENT, [(study, w, 200) for w in range(4)])
    records = ledger.read_runs(str(study))
    names = [r["run"] for r in records]
    assert sorted(names) == sorted(f"{w}/{i}" for w in range(4) for i in range(200))
    assert {r["mechanism"].num_steps for r in records} == {7}  # every finish replaced its start
    assert sorted(os.listdir(study)) == ["ledger.jsonl", "ledger.jsonl.lock"]  # no temp left


def test_a_linked_ledger_or_lock_is_refused(tmp_path):
    user_file = tmp_path / "notes.txt"
    user_file.write_text("mine")
    for name in (ledger.LEDGER_FILENAME, ledger.LOCK_FILENAME):
        study = tmp_path / name.replace(".", "_")
        study.mkdir()
        (study / name).symlink_to(user_file)
        with pytest.raises(ValueError, match="symbolic link"):
            ledger.append_run(str(study), **RUNS[0])
    assert user_file.read_text() == "mine"


def test_threads_share_one_lock_per_study(tmp_path):
    # Two FileLocks of one file block each other even in one thread: the cache must give one.
    import threading  # pylint: disable=g-import-not-at-top

    study = str(tmp_path / "study")
    locks = []
    threads = [threading.Thread(target=lambda: locks.append(ledger.study_lock(study)))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(lock) for lock in locks}) == 1
    with ledger.study_lock(study):
        ledger.append_run(study, **RUNS[0])  # reentrant in the holding thread
    assert [r["run"] for r in ledger.read_runs(study)] == ["a"]
