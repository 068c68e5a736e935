"""graph_checks reads what a traced graph runs: nested functions, shapes, dtypes, callbacks."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp import graph_checks


def _trace(fn, *specs):
    return tf.function(fn, autograph=False).get_concrete_function(*specs)


def _risky(fn, *specs):
    return [n.op for n in graph_checks.broadcast_batch_matmuls(
        graph_checks.graph_nodes(_trace(fn, *specs)))]


@pytest.mark.parametrize("lhs, rhs, risky", [
    ([8, 1, 5, 4], [4, 6], True),        # the measured bug: rank 4, second batch axis 1
    ([8, 1, 5, 4], [1, 4, 6], True),
    ([8, 1, 5, 4], [1, 1, 4, 6], True),
    ([None, 1, 5, 4], [4, 6], True),     # unknown batch: cannot be proven safe
    ([8, 2, 5, 4], [4, 6], True),        # broadcasts too (measured exact, but same cause)
    ([8, 1, 1, 5, 4], [4, 6], True),     # rank 5
    ([8, 5, 4], [4, 6], False),          # one batch axis: broadcasts correctly
    ([None, 5, 4], [4, 6], False),
    ([8, 1, 5, 4], [8, 1, 4, 6], False),  # equal batch axes: nothing broadcast
    ([1, 1, 5, 4], [4, 6], False),       # batch axes all 1
    ([None, 2, 5, 4], [None, 2, 4, 6], True),  # two unknown sizes are not provably equal
])
def test_batch_matmuls_that_may_broadcast_at_rank_4_are_found(lhs, rhs, risky):
    found = _risky(tf.matmul, tf.TensorSpec(lhs), tf.TensorSpec(rhs))
    assert bool(found) == risky, found


@pytest.mark.parametrize("equation, lhs, rhs, risky", [
    ("...ij,jk->...ik", [8, 1, 5, 4], [4, 6], True),        # measured: heap corruption
    ("...ij,...jk->...ik", [8, 1, 5, 4], [4, 6], True),
    ("...ij,...jk->...ik", [8, 5, 4], [4, 6], False),       # one ellipsis axis
    ("abij,abjk->abik", [8, 1, 5, 4], [8, 1, 4, 6], False),  # named labels never broadcast
    ("abc,cde->abde", [8, 5, 4], [4, 2, 3], False),
    # Named labels shared by both inputs and the output are batch axes too (a segfault at
    # batch 8, garbage at 4 and 5, if not flagged).
    ("...hid,hde->...hie", [8, 1, 5, 4], [1, 4, 6], True),
    ("a...ij,ajk->a...ik", [1, 8, 5, 4], [1, 4, 6], True),
    ("...hid,hde->...hie", [8, 5, 2, 4], [5, 4, 6], True),  # [8, 5] x [5]: rank 2, broadcast
    ("bhid,bhde->bhie", [8, 2, 5, 4], [8, 2, 4, 6], False),  # named batch axes, equal
    ("bhid,hde->bhie", [8, 2, 5, 4], [2, 4, 6], False),  # b only on the left: not batch
])
def test_einsums_whose_ellipsis_may_broadcast_are_found(equation, lhs, rhs, risky):
    found = _risky(lambda a, b: tf.einsum(equation, a, b), tf.TensorSpec(lhs),
                   tf.TensorSpec(rhs))
    assert bool(found) == risky, found


def test_ops_inside_loops_vectorized_map_and_nested_functions_are_seen():
    @tf.function(autograph=False)
    def inner(x):
        return tf.matmul(x[tf.newaxis, tf.newaxis], tf.ones([4, 3]))  # [1, 1, 4, 3]: safe

    def step(x):
        # vectorized_map stacks each example's [1, 1, 4, 3] x [4, 3] into [5, 1, 1, 4, 3]
        mapped = tf.vectorized_map(lambda r: tf.matmul(r[tf.newaxis, tf.newaxis],
                                                       tf.ones([4, 3])), x)
        looped = tf.while_loop(lambda i, a: i < 2,
                               lambda i, a: (i + 1, a + tf.reduce_sum(inner(a[0]))),
                               (0, x))[1]
        return mapped, looped, tf.cast(x, tf.float64)

    nodes = graph_checks.graph_nodes(_trace(step, tf.TensorSpec([5, 4, 4])))
    risky = graph_checks.broadcast_batch_matmuls(nodes)
    assert [n.input_shapes[0] for n in risky] == [(5, 1, 1, 4, 4)], [n.describe() for n in risky]
    functions = {n.function for n in nodes}
    assert any("while_body" in f for f in functions) and any("inner" in f for f in functions)
    # The safe [1, 1, 4, 4] x [4, 3] inside the nested function was read with its shapes.
    inner_matmuls = [n for n in nodes if "inner" in n.function and "MatMul" in n.op]
    assert inner_matmuls and inner_matmuls[0].input_shapes[0] == (1, 1, 4, 4)
    # The one float64 value: the Cast, and the Identity that returns it.
    assert sorted(n.op for n in graph_checks.nodes_of_dtype(nodes, tf.float64)) == [
        "Cast", "Identity"]


def test_host_callbacks_are_found_at_any_depth():
    def step(x):
        y = tf.numpy_function(lambda a: a * 2, [x], tf.float32)
        z = tf.while_loop(lambda i, a: i < 2,
                          lambda i, a: (i + 1, tf.ensure_shape(tf.py_function(
                              lambda b: b + 1, [a], tf.float32), [3])), (0, x))[1]
        return y + z

    nodes = graph_checks.graph_nodes(_trace(step, tf.TensorSpec([3])))
    assert sorted(n.op for n in graph_checks.host_callbacks(nodes)) == ["EagerPyFunc", "PyFunc"]
    clean = graph_checks.graph_nodes(_trace(lambda x: x * 2.0, tf.TensorSpec([3])))
    assert graph_checks.host_callbacks(clean) == []
    assert graph_checks.nodes_of_dtype(clean, tf.float64) == []


def test_a_graph_def_and_bad_arguments():
    cf = _trace(tf.matmul, tf.TensorSpec([8, 1, 5, 4]), tf.TensorSpec([4, 6]))
    nodes = graph_checks.graph_nodes(cf.graph.as_graph_def(add_shapes=True))
    assert len(graph_checks.broadcast_batch_matmuls(nodes)) == 1
    assert "BatchMatMulV2" in graph_checks.broadcast_batch_matmuls(nodes)[0].describe()
    with pytest.raises(TypeError, match="takes a tf.Graph"):
        graph_checks.graph_nodes(np.zeros(3))
