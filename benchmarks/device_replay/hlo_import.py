"""StableHLO helpers shared by replay.py (here) and benchmarks/xla_step_cost_jax.py: both run in
a JAX venv without tfdp, so this module imports only jax."""
import re


def aliases_of(mlir_bytes):
    """[(parameter_number, output_index)]: the outputs that are a parameter's next value (updated variables)."""
    from jax._src.interpreters import mlir as jm
    from jax._src.lib.mlir import ir
    with jm.make_ir_context():
        text = str(ir.Module.parse(mlir_bytes))
    head = text.split("\n", 1)[0]
    return [(int(p), int(o)) for p, o in re.findall(
        r"parameter_number = (\d+) : i64\}, output_index = array<i64: (\d+)>", head)]


def without_mhlo_copy(mlir_bytes):
    """The module as generic MLIR text with each mhlo.copy (an identity that newer StableHLO
    legalizers refuse) written as a same-type stablehlo.convert (also an identity)."""
    from jax._src.interpreters import mlir as jm
    from jax._src.lib.mlir import ir
    ctx = jm.make_ir_context()
    ctx.allow_unregistered_dialects = True
    with ctx:
        mod = ir.Module.parse(mlir_bytes)
        text = mod.operation.get_asm(print_generic_op_form=True, enable_debug_info=False)
    n = text.count('"mhlo.copy"(')
    return text.replace('"mhlo.copy"(', '"stablehlo.convert"('), n
