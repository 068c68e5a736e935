"""Tests for tfdp.accounting.checkpoint_record: what a checkpoint states, what a resume may change.

Pure Python, on records as `tfdp.training.record_variables.read_record` gives them
(strings as bytes, numbers as Python numbers); the saved checkpoints themselves are
tested end to end in tests/resume_test.py and tests/non_private_test.py.
"""

import json

import pytest

from tfdp import accounting
from tfdp.accounting import checkpoint_record


def _mechanism(**overrides):
    fields = dict(num_examples=60000, batch_size=600, num_steps=100, noise_multiplier=1.0,
                  l2_clip_norm=0.5, delta=1e-5)
    return accounting.DPMechanism(**{**fields, **overrides})


def _saved(record):
    """A record as read back from a checkpoint file: text fields as bytes."""
    return {k: v.encode() if isinstance(v, str) else v for k, v in record.items()}


def _private(steps=40, **kwargs):
    record = checkpoint_record.private_record(_mechanism(), sampling_seed=7, config="C = 1",
                                              data='{"train": "abc"}', **kwargs)
    return _saved({**record, **checkpoint_record.at_step(_mechanism(), steps)})


def test_the_saved_names_are_the_ones_older_checkpoints_have():
    # The keys on disk are `ledger/<field>/.ATTRIBUTES/VARIABLE_VALUE`: a rename would
    # leave every existing checkpoint unresumable.
    assert checkpoint_record.CHECKPOINT_NAME == "ledger"
    assert set(checkpoint_record.PRIVATE_FIELDS) == {
        "mechanism_json", "steps", "epsilon", "sampling_seed", "noise_seed", "config", "data"}
    assert set(checkpoint_record.NON_PRIVATE_FIELDS) == {
        "privacy", "steps", "sampling_seed", "config", "data"}
    assert set(checkpoint_record.private_record(_mechanism(), sampling_seed=1)) == set(
        checkpoint_record.PRIVATE_FIELDS)
    assert set(checkpoint_record.non_private_record(sampling_seed=1)) == set(
        checkpoint_record.NON_PRIVATE_FIELDS)


def test_a_private_record_holds_the_whole_mechanism_and_the_seeds():
    record = checkpoint_record.private_record(_mechanism(), sampling_seed=7)
    assert accounting.DPMechanism.from_dict(json.loads(record["mechanism_json"])) == _mechanism()
    assert record["noise_seed"] == -1  # drawn from OS entropy
    assert checkpoint_record.private_record(_mechanism(), sampling_seed=7,
                                            noise_seed=3)["noise_seed"] == 3
    assert checkpoint_record.at_step(_mechanism(), 40) == {
        "steps": 40, "epsilon": _mechanism().epsilon(40)}
    assert checkpoint_record.at_step(None, 40) == {"steps": 40}


def test_the_same_mechanism_resumes():
    assert checkpoint_record.check_private(_private(), _mechanism(), where="ckpt",
                                           sampling_seed=7) == (40, "C = 1")


def test_another_mechanism_or_a_fixed_seed_that_differs_is_refused():
    with pytest.raises(ValueError, match=r"(?s)noise_multiplier.*sampling_seed: this run fixes"):
        checkpoint_record.check_private(_private(), _mechanism(noise_multiplier=1.1),
                                        where="ckpt", sampling_seed=8)
    with pytest.raises(ValueError) as error:
        checkpoint_record.check_private(_private(noise_seed=123), _mechanism(), where="ckpt",
                                        noise_seed=456)
    assert "noise_seed" in str(error.value) and "123" not in str(error.value)  # secret


def test_more_steps_than_planned_are_refused():
    with pytest.raises(ValueError, match="already holds 40 steps, more than the 30"):
        checkpoint_record.check_private(_private(), _mechanism(num_steps=30), where="ckpt")
    non_private = _saved(checkpoint_record.non_private_record(sampling_seed=1) | {"steps": 5})
    assert checkpoint_record.check_non_private(non_private, 5, where="ckpt") == (5, "")
    with pytest.raises(ValueError, match="already holds 5 steps, more than the 4"):
        checkpoint_record.check_non_private(non_private, 4, where="ckpt")


def test_the_modes_never_resume_each_other():
    non_private = _saved(checkpoint_record.non_private_record(sampling_seed=1))
    assert checkpoint_record.is_non_private(non_private)
    assert not checkpoint_record.is_non_private(_private())
    with pytest.raises(ValueError, match="ckpt is of a NON-PRIVATE run"):
        checkpoint_record.check_private(non_private, _mechanism(), where="ckpt")
    with pytest.raises(ValueError, match=r"ckpt is of a PRIVATE \(DP-SGD\) run"):
        checkpoint_record.check_non_private(_private(), 100, where="ckpt")
    with pytest.raises(ValueError, match="recorded no privacy mode"):
        checkpoint_record.check_non_private({"steps": 1, "config": b""}, 100, where="ckpt")
    with pytest.raises(ValueError, match="did not record the whole privacy mechanism"):
        checkpoint_record.check_private({"steps": 1, "config": b""}, _mechanism(), where="ckpt")


@pytest.mark.parametrize("data, expected", [
    (b'{"train": "abc"}', {"train": "abc"}),
    (b"{}", None),  # nothing recorded
    (b"not json", None),
    (b'["train"]', None),
    (None, None),  # an older checkpoint: no field
])
def test_the_data_fingerprints_are_read_or_none(data, expected):
    saved = {} if data is None else {"data": data}
    assert checkpoint_record.data_fingerprints(saved) == expected
