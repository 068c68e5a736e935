"""The tap rules' registry and what rules share (a bias and activation site)."""

from tfdp.dp import ghost_norms


def register(*layer_classes):
    """Decorator: registers a tap rule `(layer, inputs, recorder) -> outputs`."""

    def decorate(rule):
        for cls in layer_classes:
            ghost_norms.register_layer_rule(cls, rule)
        return rule

    return decorate


def require(condition, reason):
    if not condition:
        raise ghost_norms.UnsupportedLayer(reason)


def bias_and_activation(layer, z, recorder):
    if layer.bias is not None:
        z = recorder.site(
            layer, [layer.bias], [z], lambda z: z + layer.bias,
            lambda ins, out, g, k: ghost_norms.broadcast_sq_norms(
                g, layer.bias.shape, num_views=k))
    return z if layer.activation is None else layer.activation(z)
