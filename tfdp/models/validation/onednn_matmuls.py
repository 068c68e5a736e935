"""Rule: the model's own forward pass forms no batch matmul that oneDNN computes wrongly."""

from tfdp import graph_checks
from tfdp import host


def refuse_buggy_matmuls(model, nodes):
    """Raises before the probe runs `model` if its own call forms oneDNN's bad matmul.

    With oneDNN on, TensorFlow 2.21 computes a rank-4 batch matmul that
    broadcasts one operand wrongly or corrupts the heap
    (`tfdp.graph_checks.BROADCAST_MATMUL_BUG`); a model whose forward pass
    forms one on a batch would crash the probe, and no path can train it.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    if host.onednn_enabled() is False or tf.config.list_logical_devices("GPU"):
        return
    risky = graph_checks.broadcast_batch_matmuls(nodes)
    if risky:
        raise ValueError(
            f"{model.name}'s own forward pass forms batch matmuls that TensorFlow 2.21 computes "
            f"wrongly with oneDNN on: {'; '.join(n.describe() for n in risky[:4])}. "
            f"{graph_checks.BROADCAST_MATMUL_BUG} Make the model's matmuls rank 3 (reshape to "
            "[batch, T, C] before a Dense or tf.matmul), or set TF_ENABLE_ONEDNN_OPTS=0 before "
            "TensorFlow is imported (slower: docs/design/dp_step.md, 'oneDNN on, on every host').")
