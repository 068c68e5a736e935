"""What a traced TensorFlow graph will run: every op, nested functions included.

Privacy and portability checks that must hold for the ops a step really
runs, not for the layers a model lists, read the traced graph: a check of
`model.layers` misses layers inside layers, subclassed models and the ops
that `tf.vectorized_map` makes. `graph_nodes` walks a graph and every
function of its library (while and cond bodies, `tf.vectorized_map`'s
fallbacks, nested `tf.function`s), with the static shapes of each node's
inputs where TensorFlow inferred them.

The checks built on it:
- `broadcast_batch_matmuls`: the matmuls that TensorFlow 2.21's oneDNN
  kernel computes wrongly (`BROADCAST_MATMUL_BUG`);
- `nodes_of_dtype` (e.g. float64, which TPUs do not have) and
  `host_callbacks` (Python functions, which a TPU pod's input graph and an
  XLA-compiled step cannot run).

Only the public protos are read: `Graph.as_graph_def(add_shapes=True)`,
whose nodes carry `_output_shapes`, and the `FunctionDef`s of its library.
"""

import dataclasses
import re
from typing import Iterable, Iterator, List, Optional, Tuple

import tensorflow as tf
from tensorflow.python.framework import op_def_registry  # the OpDef of an op type

Shape = Optional[Tuple[Optional[int], ...]]  # None: unknown rank; None entries: unknown dims

BROADCAST_MATMUL_BUG = (
    "TensorFlow 2.21's oneDNN batch matmul reads a broadcast operand with the strides of an "
    "unbroadcast one (tensorflow/tensorflow#117700, fixed by PR #120199 after 2.21): "
    "tf.matmul([8, 1, T, C], [C, O]) returns garbage (up to 1e31) in its last batch entry or "
    "corrupts the heap. Measured here on every rank-4 case whose second batch axis is 1 and "
    "whose other operand broadcasts over the first; with TF_ENABLE_ONEDNN_OPTS=0 it is exact."
)

HOST_CALLBACK_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
_BATCH_MATMUL_OPS = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of a graph or of a function of its library.

    Attributes:
      name: the node's name (its name scope shows the layer that made it).
      op: the op type, e.g. "BatchMatMulV2".
      function: the library function holding the node; "" at the top level.
      input_shapes: the static shape of each data input (`Shape`).
      attr: the node's attributes (a protobuf map of `AttrValue`).
    """

    name: str
    op: str
    function: str
    input_shapes: Tuple[Shape, ...]
    attr: object

    def describe(self) -> str:
        """`op name (in function) [shapes]`, for messages."""
        where = f" in {self.function}" if self.function else ""
        shapes = ", ".join("?" if s is None else str(list(s)) for s in self.input_shapes)
        return f"{self.op} {self.name}{where} ({shapes})"


def _shape(proto) -> Shape:
    if proto.unknown_rank:
        return None
    return tuple(None if d.size < 0 else int(d.size) for d in proto.dim)


def _output_shapes(node_def) -> List[Shape]:
    if "_output_shapes" not in node_def.attr:
        return []
    return [_shape(s) for s in node_def.attr["_output_shapes"].list.shape]


def _flat_output_index(node_def, output_arg, index, signatures):
    """The flat output index of `node:output_arg:index` in a FunctionDef."""
    op_def = op_def_registry.get(node_def.op)
    args = op_def.output_arg if op_def is not None else signatures.get(node_def.op, ())
    offset = 0
    for arg in args:
        if arg.name == output_arg:
            return offset + index
        if arg.number_attr:
            offset += node_def.attr[arg.number_attr].i
        elif arg.type_list_attr:
            offset += len(node_def.attr[arg.type_list_attr].list.type)
        else:
            offset += 1
    return None


def _function_nodes(function_def, signatures) -> Iterator[Node]:
    """The nodes of one library function, with their inputs' static shapes."""
    shapes = {}
    for i, arg in enumerate(function_def.signature.input_arg):
        attrs = function_def.arg_attr[i].attr if i in function_def.arg_attr else {}
        known = [_shape(s) for s in attrs["_output_shapes"].list.shape] if (
            "_output_shapes" in attrs) else []
        shapes[arg.name] = known[0] if known else None
    by_name = {n.name: n for n in function_def.node_def}

    def input_shape(reference):
        if reference in shapes:
            return shapes[reference]
        parts = reference.split(":")
        node = by_name.get(parts[0])
        if node is None or len(parts) != 3:
            return None
        flat = _flat_output_index(node, parts[1], int(parts[2]), signatures)
        outputs = _output_shapes(node)
        return outputs[flat] if flat is not None and flat < len(outputs) else None

    for node in function_def.node_def:
        data_inputs = [r for r in node.input if not r.startswith("^")]
        yield Node(node.name, node.op, function_def.signature.name,
                   tuple(input_shape(r) for r in data_inputs), node.attr)


def _top_level_nodes(graph_def) -> Iterator[Node]:
    by_name = {n.name: n for n in graph_def.node}

    def input_shape(reference):
        name, _, index = reference.partition(":")
        node = by_name.get(name)
        outputs = _output_shapes(node) if node is not None else []
        k = int(index) if index else 0
        return outputs[k] if k < len(outputs) else None

    for node in graph_def.node:
        data_inputs = [r for r in node.input if not r.startswith("^")]
        yield Node(node.name, node.op, "", tuple(input_shape(r) for r in data_inputs),
                   node.attr)


def graph_nodes(traced) -> List[Node]:
    """Every node that `traced` may run, nested functions included.

    Args:
      traced: a `tf.Graph` (a `FuncGraph`), a `ConcreteFunction`, or a
        `GraphDef` (shapes are known only where its nodes carry
        `_output_shapes`, as `as_graph_def(add_shapes=True)` writes them).

    Returns:
      A list of `Node`: the top-level nodes, then those of every library
      function (each function once). A traced function may hold ops that
      never run (the first trace of a `tf.vectorized_map` body, which its
      converted ops replace); they are listed too, which errs on the side of
      reporting.

    Raises:
      TypeError: for any other argument.
    """
    if isinstance(traced, tf.types.experimental.ConcreteFunction):
        traced = traced.graph
    if isinstance(traced, tf.Graph):
        traced = traced.as_graph_def(add_shapes=True)
    if not isinstance(traced, tf.compat.v1.GraphDef):
        raise TypeError(f"graph_nodes takes a tf.Graph, a ConcreteFunction or a GraphDef, got "
                        f"{type(traced).__name__}.")
    signatures = {f.signature.name: f.signature.output_arg for f in traced.library.function}
    nodes = list(_top_level_nodes(traced))
    for function_def in traced.library.function:
        nodes.extend(_function_nodes(function_def, signatures))
    return nodes


# -- Checks ------------------------------------------------------------------


def _broadcasts(batch_a: Shape, batch_b: Shape) -> bool:
    """Whether a batch matmul with these batch shapes may broadcast one operand.

    Unknown ranks and unknown sizes count as broadcasting: a static check
    cannot prove two unknown sizes equal.
    """
    if batch_a is None or batch_b is None:
        return True
    rank = max(len(batch_a), len(batch_b))
    a = (1,) * (rank - len(batch_a)) + tuple(batch_a)
    b = (1,) * (rank - len(batch_b)) + tuple(batch_b)
    for x, y in zip(a, b):
        if x is None or y is None:
            if not (x == 1 and y == 1):
                return True
        elif x != y:
            return True
    return False


def _batch_rank(batch_a: Shape, batch_b: Shape) -> Optional[int]:
    if batch_a is None or batch_b is None:
        return None
    return max(len(batch_a), len(batch_b))


def _all_ones(batch: Shape) -> bool:
    return batch is not None and all(d == 1 for d in batch)


def _matmul_at_risk(batch_a: Shape, batch_b: Shape) -> bool:
    """A batch matmul of two or more batch axes (rank >= 4) that may broadcast.

    Rank-3 batch matmuls (one batch axis) broadcast correctly (measured:
    `[8, T, C] x [C, O]`); so do matmuls whose batch axes are all 1 on both
    sides (nothing is broadcast). Everything else that may broadcast is at
    risk, whatever its sizes: the measured failures need a second batch axis
    of 1, but the cause (the strides of a broadcast operand) does not.
    """
    if _all_ones(batch_a) and _all_ones(batch_b):
        return False
    rank = _batch_rank(batch_a, batch_b)
    if rank is not None and rank < 2:
        return False
    return _broadcasts(batch_a, batch_b)


def _einsum_batch_shapes(equation: str, shapes) -> Optional[Tuple[Shape, Shape]]:
    """The batch axes of the batch matmul that TensorFlow runs an Einsum as, per operand.

    TensorFlow's Einsum (`EinsumOp`) runs a two-operand equation as one batch
    matmul whose batch axes are, for each operand, the axes under its "..."
    (which broadcast against the other operand's) followed by the named labels
    that both inputs and the output have (which must match exactly):
    `"...hid,hde->...hie"` on `[8, 1, 5, 4]` and `[1, 4, 6]` is a batch matmul
    with batch axes `[8, 1]` and `[1]`, the oneDNN bug's shape (measured: a
    segfault). Returns None for other equations (one operand, or a result
    without "->").
    """
    if "->" not in equation:
        return None
    inputs, output = equation.split("->")
    specs = [spec.strip() for spec in inputs.split(",")]
    if len(specs) != 2 or len(shapes) != 2:
        return None
    named = [re.sub(r"\.\.\.|\s", "", spec) for spec in specs]
    batch_labels = [c for c in named[0] if c in named[1] and c in output]
    result = []
    for spec, labels, shape in zip(specs, named, shapes):
        if shape is None or len(shape) < len(labels):
            result.append(None)
            continue
        ellipsis = tuple(shape[:len(shape) - len(labels)]) if "..." in spec else ()
        sizes = dict(zip(labels, shape[len(shape) - len(labels):]))
        result.append(ellipsis + tuple(sizes[c] for c in batch_labels))
    return result[0], result[1]


def broadcast_batch_matmuls(nodes: Iterable[Node]) -> List[Node]:
    """The nodes that TensorFlow 2.21's oneDNN batch matmul may compute wrongly.

    `BatchMatMul`, `BatchMatMulV2` and `BatchMatMulV3` whose operands have
    two or more batch axes (rank >= 4) and may broadcast one over the other
    (`_matmul_at_risk`), and `Einsum`s whose batch matmul (`_einsum_batch_shapes`:
    the "..." axes and the named labels both inputs and the output share)
    may do the same (measured: `einsum("...ij,jk->...ik", [8, 1, 5, 4], [4, 6])`
    and `einsum("...hid,hde->...hie", [8, 1, 5, 4], [1, 4, 6])` corrupt the heap).
    See `BROADCAST_MATMUL_BUG`. Unknown shapes count as at risk.

    Args:
      nodes: from `graph_nodes`.

    Returns:
      The nodes at risk, in order.
    """
    risky = []
    for node in nodes:
        if node.op in _BATCH_MATMUL_OPS and len(node.input_shapes) >= 2:
            a, b = node.input_shapes[:2]
            if _matmul_at_risk(None if a is None else a[:-2], None if b is None else b[:-2]):
                risky.append(node)
        elif node.op == "Einsum" and "equation" in node.attr:
            batches = _einsum_batch_shapes(node.attr["equation"].s.decode(), node.input_shapes)
            if batches is not None and _matmul_at_risk(*batches):
                risky.append(node)
    return risky


def nodes_of_dtype(nodes: Iterable[Node], dtype) -> List[Node]:
    """The nodes with a type attribute (`T`, `dtype`, `DstT`, `Tout`, ...) equal to `dtype`.

    Args:
      nodes: from `graph_nodes`.
      dtype: a `tf.DType`, e.g. `tf.float64`.

    Returns:
      The nodes that compute in, produce or hold `dtype`, in order.
    """
    enum = tf.as_dtype(dtype).as_datatype_enum
    found = []
    for node in nodes:
        for value in node.attr.values():
            if value.type == enum or enum in value.list.type:
                found.append(node)
                break
    return found


def host_callbacks(nodes: Iterable[Node]) -> List[Node]:
    """The nodes that call back into Python (`tf.numpy_function`, `tf.py_function`).

    A TPU pod runs the input graphs of its other hosts without a Python
    interpreter, and XLA cannot compile such an op.
    """
    return [node for node in nodes if node.op in HOST_CALLBACK_OPS]
