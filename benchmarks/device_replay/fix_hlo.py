"""Rewrite an exported HloModuleProto so that the HLO -> StableHLO importer takes it (tfdp venv).

Since tfdp 454d579 the DP step holds clip_paths.alone_where_not_finite's tf.cond + tf.while_loop;
tf2xla bounds the loop's argsort output (a static s32[B]) with `SetBound` custom-calls whose
literal is a tuple, and the importer (jax 0.10.2 and 0.11.2, and TF 2.21's own
`stage="stablehlo"`) fails on them: "INTERNAL: Unsupported type: TUPLE". Each SetBound
custom-call (one operand, same static shape) becomes an identity `copy` of its operand: the
same computation. Usage: python fix_hlo.py IN.hlo.pb OUT.hlo.pb (prints the count).
"""
import sys

from tensorflow.compiler.xla.service import hlo_pb2


def fix(module):
    n = 0
    for c in module.computations:
        for ins in c.instructions:
            if ins.opcode == "custom-call" and ins.custom_call_target == "SetBound":
                assert len(ins.operand_ids) == 1, ins.name
                assert not any(ins.shape.is_dynamic_dimension), ins.name
                new = hlo_pb2.HloInstructionProto(name=ins.name, opcode="copy", id=ins.id,
                                                  operand_ids=list(ins.operand_ids))
                new.shape.CopyFrom(ins.shape)
                new.metadata.CopyFrom(ins.metadata)
                ins.CopyFrom(new)
                n += 1
    return n


if __name__ == "__main__":
    m = hlo_pb2.HloModuleProto()
    m.ParseFromString(open(sys.argv[1], "rb").read())
    n = fix(m)
    open(sys.argv[2], "wb").write(m.SerializeToString())
    print(f"fix_hlo: {n} SetBound custom-call(s) -> copy")
