"""Where a compiled XLA program's flops and bytes go: its convolutions, dots and top-level ops.

Pure Python over the HLO text of an optimized module (`tpu_cost.py --dump`, or a JAX
`compiled.as_text()`): lists every convolution and dot, in fused computations too, with its
operand and result shapes, window, dim_labels, feature_group_count / batch_group_count,
operand precision and its flops (2 x MACs from the shapes: the result's elements times the
kernel's elements per output feature for a convolution, times the contracted size for a dot;
padding is counted as XLA's cost analysis does not, so a padded window counts a little more),
and the bytes of every top-level instruction (its operands and its result, as a fusion reads
and writes them), grouped by the TensorFlow/JAX op the metadata names and by kind.

Usage:
  python benchmarks/tpu_hlo_ops.py PROGRAM.hlo.txt [BASELINE.hlo.txt] [--top N] [--by KEY]
    KEY: kind (default: conv / grouped conv / dot, with group count and dtypes), role (forward,
    input gradient, kernel gradient, per-example gradients with expanded groups; `Op.role`), op_type
    (the op_type of the metadata), op_name (op_name up to its last '/'), or layer.
  With BASELINE (e.g. the plain step), each group's excess over the baseline's.
No TPU or JAX needed (it reads text).
"""

import collections
import dataclasses
import json
import math
import re
import sys

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f64": 8,
         "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "token": 0, "s4": 0.5, "u4": 0.5,
         "f8e4m3fn": 1, "f8e5m2": 1}

_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e\dm\d\w*)?)\[([0-9,]*)\]")
_COMP_START = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")



def json_records(paths):
    """Every JSON line of the files `paths` (`tpu_layer_forms.py`'s output), other lines skipped."""
    for path in paths:
        for line in open(path):
            try:
                yield json.loads(line)
            except ValueError:
                continue

@dataclasses.dataclass
class Op:
    name: str
    opcode: str
    out_dtype: str
    out_shape: tuple
    operands: list  # [(dtype, shape)]
    attrs: str
    computation: str
    caller: str = ""  # the fusion instruction that calls the computation, if fused
    flops: float = 0.0
    feature_groups: int = 1
    batch_groups: int = 1
    window: str = ""
    dim_labels: str = ""
    precision: str = ""
    op_type: str = ""
    op_name: str = ""

    def kind(self):
        if self.opcode == "convolution":
            base = "conv"
            if self.feature_groups > 1:
                base = f"grouped conv (feature_group_count={self.feature_groups})"
            elif self.batch_groups > 1:
                base = f"batch-grouped conv (batch_group_count={self.batch_groups})"
        else:
            base = self.opcode
        dts = "x".join(d for d, _ in self.operands[:2])
        return f"{base} {dts}->{self.out_dtype}"

    def role(self):
        """What a convolution computes, from its dimension labels (TF's export keeps no op names).

        forward: `b01f_01io->b01f`; input gradient: the same with a reversed kernel; kernel
        gradient: the kernel's dimensions as output (`..->01bf`); per-example gradient
        (expanded groups): a `[C, H, W, n]`-style lhs (`f01b`) and a `b01f` output, the
        shape a depthwise conv with the batch as channels takes once the compiler has expanded
        its groups into a dense kernel; grouped: feature/batch_group_count kept.
        """
        if self.opcode != "convolution":
            return self.opcode
        if self.feature_groups > 1 or self.batch_groups > 1:
            return "grouped conv (groups kept)"
        lhs_l, rest = (self.dim_labels.split("_") + [""])[:2]
        out_l = rest.split("->")[-1]
        if "rhs_reversal" in self.window:
            return "conv: input gradient"
        if out_l.startswith("01") or out_l.startswith("0b") or out_l.startswith("0f"):
            return "conv: kernel gradient (->01bf)"
        if lhs_l.startswith("f") and out_l.endswith("f"):
            return "conv: per-example gradients, groups expanded (f01b lhs)"
        return "conv: forward"

    def short(self):
        lhs = self.operands[0] if self.operands else ("?", ())
        rhs = self.operands[1] if len(self.operands) > 1 else ("?", ())
        s = (f"{self.opcode} {lhs[0]}{list(lhs[1])} x {rhs[0]}{list(rhs[1])} -> "
             f"{self.out_dtype}{list(self.out_shape)}")
        if self.window:
            s += f" window={{{self.window}}}"
        if self.dim_labels:
            s += f" {self.dim_labels}"
        if self.feature_groups > 1:
            s += f" fgc={self.feature_groups}"
        if self.batch_groups > 1:
            s += f" bgc={self.batch_groups}"
        if self.precision:
            s += f" prec={self.precision}"
        return s + f": {self.flops / 1e9:.4f} GFLOP"


def _split_operands(rest):
    """`opcode(args), attrs` -> (opcode, args text, attrs text), parentheses matched."""
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None, "", rest
    depth, i = 0, m.end() - 1
    for j in range(i, len(rest)):
        if rest[j] == "(":
            depth += 1
        elif rest[j] == ")":
            depth -= 1
            if depth == 0:
                return m.group(1), rest[i + 1:j], rest[j + 1:]
    return m.group(1), rest[i + 1:], ""


def _result_and_rest(text):
    """The result type (an array or a tuple) and the text after it."""
    text = text.strip()
    if text.startswith("("):
        depth = 0
        for j, ch in enumerate(text):
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    return text[:j + 1], text[j + 1:].strip()
    m = re.match(r"[\w]+\[[0-9,]*\](\{[^ ]*\})?", text)
    if m:
        return m.group(0), text[m.end():].strip()
    m = re.match(r"\S+", text)
    return m.group(0), text[m.end():].strip()


def _nbytes(type_text):
    total = 0
    for dt, dims in _SHAPE.findall(type_text):
        if dt not in BYTES:
            continue
        total += BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _attr(attrs, key):
    m = re.search(r"\b" + key + r"=(\{[^}]*\}|[^,\s]+)", attrs)
    return m.group(1) if m else ""


def _strip_layouts(text):
    """Drops `{...}` layouts after shapes (they hold commas and parentheses)."""
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _window(window):
    """The window attribute as {size, pad: [(lo, hi)], stride, lhs_dilate, rhs_dilate}."""
    out = {}
    for item in window.split():
        key, _, value = item.partition("=")
        if key == "pad":
            out[key] = [tuple(int(v) for v in p.split("_")) for p in value.split("x")]
        else:
            out[key] = [int(v) for v in value.split("x")]
    return out


def _conv_flops(op, shapes, out_shape):
    """2 x MACs of a convolution, only window taps that read the input (not padding) counted.

    Per output element: the kernel's elements per output feature (its input features and
    window), the window taps that fall on padding left out, as XLA's cost analysis counts.
    """
    rhs = shapes[1][1] if len(shapes) > 1 else ()
    lhs = shapes[0][1] if shapes else ()
    if not op.dim_labels or not rhs:
        return 0.0
    lhs_l, rest = op.dim_labels.split("_")
    rhs_l, out_l = rest.split("->")
    w = _window(op.window)
    spatial = sorted(c for c in out_l if c.isdigit())
    non_spatial_out = math.prod(out_shape[i] for i, c in enumerate(out_l) if not c.isdigit())
    per_out = math.prod(rhs[i] for i, c in enumerate(rhs_l) if c == "i")
    taps = 1
    for j, d in enumerate(spatial):
        size_in = lhs[lhs_l.index(d)]
        size_out = out_shape[out_l.index(d)]
        k = rhs[rhs_l.index(d)]
        stride = w.get("stride", [1] * len(spatial))[j]
        lo = w.get("pad", [(0, 0)] * len(spatial))[j][0]
        ld = w.get("lhs_dilate", [1] * len(spatial))[j]
        rd = w.get("rhs_dilate", [1] * len(spatial))[j]
        count = 0
        for o in range(size_out):
            for t in range(k):
                pos = o * stride + t * rd - lo
                if 0 <= pos <= (size_in - 1) * ld and pos % ld == 0:
                    count += 1
        taps *= count
    # batch-grouped: each output feature reads its group's share of the input batch
    return 2.0 * non_spatial_out * per_out * taps


def parse_module(text):
    """(ops, top): convolutions/dots anywhere, and every instruction of non-fused computations.

    Each top-level instruction is `(computation, name, opcode, bytes, op_type, op_name, calls,
    cycles)`: cycles is the TPU compiler's own estimate in its backend_config
    (`estimated_cycles`; 0 where it gives none), which unlike cost analysis' flops sees an
    operand precision's extra passes.
    """
    comps = {}  # name -> list of (name, result text, opcode, args, attrs)
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP_START.match(line.strip())
            if m:
                current = m.group(2)
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        result, rest = _result_and_rest(m.group(3))
        opcode, args, attrs = _split_operands(rest)
        comps[current].append((m.group(2), result, opcode, args, attrs))
    global _COMPUTATIONS
    _COMPUTATIONS = comps
    types = {}  # instruction name -> its result type (names are unique in a module)
    for instrs in comps.values():
        for name, result, opcode, args, attrs in instrs:
            types[name] = _strip_layouts(result)

    def operand_types(args):
        """The operands' types: printed inline, or looked up by name."""
        args = _strip_layouts(args)
        if _SHAPE.search(args):
            return args
        return " ".join(types.get(a.strip().lstrip("%"), "") for a in args.split(","))

    callers = {}  # fused computation -> (caller instruction, caller computation)
    for cname, instrs in comps.items():
        for name, result, opcode, args, attrs in instrs:
            if opcode == "fusion":
                called = _attr(attrs, "calls").lstrip("%")
                callers[called] = (name, cname)
    ops, top = [], []
    for cname, instrs in comps.items():
        fused = cname in callers
        for name, result, opcode, args, attrs in instrs:
            meta = re.search(r'op_type="([^"]*)"', attrs)
            op_type = meta.group(1) if meta else ""
            meta = re.search(r'op_name="([^"]*)"', attrs)
            op_name = meta.group(1) if meta else ""
            if opcode in ("convolution", "dot"):
                shapes = [(d, tuple(int(x) for x in s.split(",") if x))
                          for d, s in _SHAPE.findall(operand_types(args))]
                m2 = _SHAPE.search(result)
                out_dt, out_shape = m2.group(1), tuple(int(x) for x in m2.group(2).split(",") if x)
                op = Op(name, opcode, out_dt, out_shape, shapes, attrs, cname,
                        callers.get(cname, ("", ""))[0], op_type=op_type, op_name=op_name)
                op.precision = _attr(attrs, "operand_precision")
                if opcode == "convolution":
                    op.window = _attr(attrs, "window").strip("{}")
                    op.dim_labels = _attr(attrs, "dim_labels")
                    op.feature_groups = int(_attr(attrs, "feature_group_count") or 1)
                    op.batch_groups = int(_attr(attrs, "batch_group_count") or 1)
                    op.flops = _conv_flops(op, shapes, out_shape)
                else:
                    lhs = shapes[0][1] if shapes else ()
                    cdims = [int(x) for x in _attr(attrs, "lhs_contracting_dims").strip("{}")
                             .split(",") if x]
                    op.flops = 2.0 * math.prod(out_shape) * math.prod(lhs[d] for d in cdims)
                ops.append(op)
            if not fused and opcode not in (None, "parameter", "constant", "tuple",
                                            "get-tuple-element", "bitcast"):
                nbytes = _nbytes(_strip_layouts(result)) + _nbytes(operand_types(args))
                cycles = re.search(r'"estimated_cycles":"([0-9]+)"', attrs)
                top.append((cname, name, opcode, nbytes, op_type, op_name,
                            _attr(attrs, "calls").lstrip("%"),
                            int(cycles.group(1)) if cycles else 0))
    return ops, top


_COMPUTATIONS = {}  # the last parsed module's computations (for `fusion_kind`)


def fusion_kind(calls):
    """What a fusion without convolutions or dots does, from the ops of its computation.

    random bits (xor: the noise's generator), select + reduce (a weighted sum over the
    examples, `clipping.weighted_sum`'s multiply_no_nan), a reduce to [examples, <= 512]
    (the DP step's per-example squares; a plain step's GroupNorm statistics), another reduce,
    or elementwise/layout.
    """
    instrs = _COMPUTATIONS.get(calls, [])
    ops = collections.Counter(opcode for _, _, opcode, _, _ in instrs)
    root = [result for name, result, opcode, _, _ in instrs][-1:] or [""]
    outs = [tuple(int(x) for x in dims.split(",") if x)
            for _, dims in _SHAPE.findall(_strip_layouts(root[0]))]
    if ops["xor"]:
        return "random bits"
    if ops["reduce"] and ops["select"]:
        return "select + reduce (weighted sum)"
    if ops["reduce"] and outs and all(1 <= len(o) <= 2 and o[-1] <= 512 and o[0] <= 512
                                      for o in outs):
        return "reduce to [examples, <= 512] (squares; GN stats)"
    if ops["reduce"]:
        return "other reduce"
    return "elementwise/layout"


def parse(text):
    """The convolutions and dots of an optimized HLO module's text (`Op`s)."""
    return parse_module(text)[0]


def _layer(op_name):
    """A Keras layer path from an op_name: the segments up to the first op-like one."""
    parts = [p for p in op_name.split("/") if p]
    keep = [p for p in parts if not re.match(r"^(gradient_tape|while|cond|body|Conv2D|"
                                             r"depthwise|transpose|Reshape|mul|add)", p)]
    return "/".join(keep[:4])


def key_of(op, by):
    if by == "kind":
        return op.kind()
    if by == "role":
        return op.role()
    if by == "op_type":
        return op.op_type or "?"
    if by == "op_name":
        return op.op_name.rsplit("/", 1)[0] or "?"
    if by == "layer":
        return _layer(op.op_name) or "?"
    raise ValueError(by)


def summarize(path, by="kind"):
    ops, top = parse_module(open(path).read())
    groups = collections.defaultdict(lambda: [0, 0.0])
    for op in ops:
        g = groups[key_of(op, by)]
        g[0] += 1
        g[1] += op.flops
    return ops, top, groups


def main():
    args = sys.argv[1:]
    top_n, by = 25, "kind"
    if "--top" in args:
        i = args.index("--top")
        top_n = int(args[i + 1])
        del args[i:i + 2]
    if "--by" in args:
        i = args.index("--by")
        by = args[i + 1]
        del args[i:i + 2]
    ops, top, groups = summarize(args[0], by)
    base = summarize(args[1], by)[2] if len(args) > 1 else {}
    total = sum(op.flops for op in ops)
    print(f"{args[0]}: {len(ops)} convolutions/dots, {total / 1e9:.2f} GFLOP (2 x MACs)")
    print(f"\nGFLOP by {by}" + (" (baseline, excess)" if base else ""))
    for k, (count, flops) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        line = f"  {flops / 1e9:9.3f}  {count:5d}  {k}"
        if base:
            b = base.get(k, [0, 0.0])[1]
            line += f"   [baseline {b / 1e9:.3f}, excess {(flops - b) / 1e9:+.3f}]"
        print(line)
    print(f"\nlargest {top_n} convolutions/dots:")
    for op in sorted(ops, key=lambda o: -o.flops)[:top_n]:
        print(f"  {op.short()}  [{op.op_type}] {op.op_name[-90:]}")
    roles = collections.defaultdict(set)  # fused computation -> roles of its convs/dots
    for op in ops:
        roles[op.computation].add(op.role())
    tb = collections.defaultdict(lambda: [0, 0, 0])
    for cname, name, opcode, nbytes, op_type, op_name, calls, cycles in top:
        k = opcode
        if opcode == "fusion":
            k = "fusion [" + (", ".join(sorted(roles[calls])) or fusion_kind(calls)) + "]"
        tb[k][0] += 1
        tb[k][1] += nbytes
        tb[k][2] += cycles
    print(f"\ntop-level instructions: bytes (operands + result; an async start and its done "
          f"both count) {sum(t[3] for t in top) / 1e9:.3f} GB, the compiler's estimated "
          f"cycles {sum(t[7] for t in top) / 1e6:.2f} M")
    for k, (count, nbytes, cycles) in sorted(tb.items(), key=lambda kv: -kv[1][2])[:top_n]:
        print(f"  {cycles / 1e6:9.3f} Mcycles {nbytes / 1e9:9.3f} GB  {count:5d}  {k}")


if __name__ == "__main__":
    main()
