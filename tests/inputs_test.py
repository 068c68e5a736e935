"""Tests for tfdp.data.open_split: the input sources, and that the pure-TF ones call no Python.

A TPU pod runs its other hosts' input pipelines as graphs, without a Python
interpreter (tensorflow/tensorflow#38762), so the per-host input of the
pure-TF path must hold no PyFunc, EagerPyFunc or numpy_function op. The
graph a host's pipeline runs is read from the dataset's serialized GraphDef
with `tfdp.graph_checks`; the ArrayRecord path is the negative control.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdp import accounting
from tfdp import augment
from tfdp import data
from tfdp import inputs
from tfdp import graph_checks

NUM_EXAMPLES = 48


def _graph_nodes(dataset):
    graph = dataset._as_serialized_graph().numpy()  # pylint: disable=protected-access
    return graph_checks.graph_nodes(tf.compat.v1.GraphDef.FromString(graph))


def _open(source, split="train"):
    with data.mock_data(num_examples=NUM_EXAMPLES):
        return data.open_split("fashion_mnist", split, source=source)


def _host_pipeline(source, replicas, *, static_batch_size=24, augmult=2):
    """The chunks one host reads, as the trainer builds them (augmult views included)."""
    mechanism = accounting.DPMechanism(
        num_examples=source.num_examples, batch_size=12, num_steps=3, noise_multiplier=1.0,
        l2_clip_norm=1.0, delta=1e-5)
    make_chunks = inputs.train_dataset(
        source, mechanism, seed=123456789, start_step=0,
        augment_fn=augment.get_augmentation("mnist_crop"), augment_seed=[0, 1],
        augmult=augmult, static_batch_size=static_batch_size, num_replicas=4,
        accumulation_steps=2)
    return make_chunks(replicas)


def test_an_unknown_source_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown input source 'tfrecord'; use one of "
                                         r"array_record, in_memory, jpeg_folder"):
        data.open_split("fashion_mnist", "train", source="tfrecord")


def test_in_memory_holds_the_array_record_split_and_is_pure_tf():
    disk, memory = _open("array_record"), _open("in_memory")
    assert not disk.pure_tf and memory.pure_tf
    assert (memory.num_examples, memory.num_classes, memory.image_shape) == (
        disk.num_examples, disk.num_classes, disk.image_shape)
    assert (memory.name, memory.split) == ("fashion_mnist", "train")
    indices = tf.constant([5, 0, 47, 5], tf.int64)
    with data.mock_data(num_examples=NUM_EXAMPLES):
        expected = disk.read(indices)
    got = memory.read(indices)
    for x, y in zip(got, expected):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


def test_the_per_host_input_of_the_pure_tf_path_calls_no_python():
    source = _open("in_memory")
    nodes = _graph_nodes(_host_pipeline(source, range(2, 4)))
    ops = {n.op for n in nodes}
    # The graph is the real one: in-graph sampling, a gather, the augmult views.
    assert {"StatelessRandomUniformFullIntV2", "ResourceGather"} <= ops, sorted(ops)
    assert graph_checks.host_callbacks(nodes) == []
    assert not {op for op in ops if "PyFunc" in op or "numpy" in op.lower()}
    eval_nodes = _graph_nodes(data.eval_batches(_open("in_memory", "test"), batch_size=10))
    assert graph_checks.host_callbacks(eval_nodes) == []


def test_the_graph_check_sees_the_python_calls_of_the_array_record_path():
    with data.mock_data(num_examples=NUM_EXAMPLES):
        source = data.open_split("fashion_mnist", "train", source="array_record")
        callbacks = graph_checks.host_callbacks(_graph_nodes(_host_pipeline(source, range(2))))
    # The numpy sampler and the ArrayRecord fetch.
    assert len(callbacks) >= 2 and {n.op for n in callbacks} <= {"PyFunc", "PyFuncStateless",
                                                                 "EagerPyFunc"}


def test_pure_tf_hosts_read_disjoint_chunks_whose_union_is_the_truncated_graph_batch():
    # Labels equal to the example index show which examples each host read.
    images = np.zeros([NUM_EXAMPLES, 4, 4, 1], np.uint8)
    source = data.ArraySource(images, np.arange(NUM_EXAMPLES), NUM_EXAMPLES, pure_tf=True)
    static, num_replicas, chunks, steps, seed = 16, 4, 2, 4, 99

    def host(replicas):
        ds = data.train_chunks(source, sampling="poisson", batch_size=12, num_steps=steps,
                               seed=seed, num_replicas=num_replicas,
                               accumulation_steps=chunks, replicas=replicas,
                               static_batch_size=static)
        return [(labels[mask > 0].tolist()) for _, labels, mask in ds.as_numpy_iterator()]

    hosts = [host(range(0, 2)), host(range(2, 4))]
    per_step = 2 * chunks  # chunks per host and step
    for step in range(steps):
        batch = data.poisson_indices_in_graph(seed, step, num_examples=NUM_EXAMPLES,
                                              sampling_prob=12 / NUM_EXAMPLES).numpy()
        read = [sum(h[step * per_step:(step + 1) * per_step], []) for h in hosts]
        assert not set(read[0]) & set(read[1])
        assert sorted(read[0] + read[1]) == batch[:static].tolist()
