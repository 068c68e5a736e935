"""Tests for tfdp.training.record_variables: the privacy record in a checkpoint, and back.

The saved keys are the ones every checkpoint has had, so that older checkpoints
resume; what is compared on a resume is tests/accounting/checkpoint_record_test.py's.
"""

import json

import pytest
import tensorflow as tf

from tfdp import accounting
from tfdp.training import record_variables

MECHANISM = accounting.DPMechanism(num_examples=60000, batch_size=600, num_steps=100,
                                   noise_multiplier=1.0, l2_clip_norm=0.5, delta=1e-5)


def _save(tmp_path, record, step):
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(ledger=record), str(tmp_path),
                                         max_to_keep=1)
    record_variables.save_checkpoint(manager, record, step)
    return manager.latest_checkpoint


def _keys(path):
    return {name for name, _ in tf.train.list_variables(path) if name.startswith("ledger/")}


def test_a_private_record_saves_under_the_keys_older_checkpoints_have(tmp_path):
    record = record_variables.make_privacy_record(
        MECHANISM, sampling_seed=7, noise_seed=3, config="C = 1", data='{"train": "abc"}')
    path = _save(tmp_path, record, 40)
    assert _keys(path) == {f"ledger/{name}/.ATTRIBUTES/VARIABLE_VALUE" for name in (
        "mechanism_json", "steps", "epsilon", "sampling_seed", "noise_seed", "config", "data")}
    reader = tf.train.load_checkpoint(path)
    assert reader.get_tensor("ledger/epsilon/.ATTRIBUTES/VARIABLE_VALUE") == pytest.approx(
        MECHANISM.epsilon(40), rel=1e-12)
    saved = record_variables.read_record(path)
    assert saved["steps"] == 40 and saved["sampling_seed"] == 7 and saved["noise_seed"] == 3
    assert accounting.DPMechanism.from_dict(json.loads(saved["mechanism_json"])) == MECHANISM
    assert record_variables.check_privacy_record(path, MECHANISM, sampling_seed=7) == (
        40, "C = 1")
    assert record_variables.saved_data_fingerprint(path) == {"train": "abc"}


def test_a_non_private_record_carries_the_mark_and_no_epsilon(tmp_path):
    record = record_variables.make_non_private_record(10, sampling_seed=5, config="C = 2")
    path = _save(tmp_path, record, 4)
    assert _keys(path) == {f"ledger/{name}/.ATTRIBUTES/VARIABLE_VALUE" for name in (
        "privacy", "steps", "sampling_seed", "config", "data")}
    assert record.mechanism is None and record.num_steps == 10
    assert record_variables.check_non_private_record(path, 10) == (4, "C = 2")
    assert record_variables.saved_data_fingerprint(path) is None  # data "": none recorded
    with pytest.raises(ValueError, match="NON-PRIVATE run"):
        record_variables.check_privacy_record(path, MECHANISM)
