"""What a compiled step costs, read from its optimized HLO text: matmul FLOPs, bytes moved through device memory,
and every collective with its kind, size and group, each counted as often as it runs.

XLA's own cost analysis counts a while loop's body once. A step is mostly loops (the layer scan, gradient
accumulation's micro-batches, the chunked loss and MLP, blockwise attention), so the counts here walk the module from
its entry computation and multiply each loop's body by its `known_trip_count` (nested loops multiply). A loop
without a known trip count counts once and is reported in `unknown_trip_counts`.

Conventions:
- **FLOPs**: 2 x output elements x contracted elements of every `dot` (inside fusions too) and of the GEMM
  custom calls of GPU backends (`__cublas$gemm`, `__cublas$lt$matmul`, hipBLASLt's). Elementwise work is not counted.
- **Transcendentals**: elements computed by exp, log, tanh, logistic, sqrt, rsqrt, power and the like (inside
  fusions too), as XLA's cost analysis counts them: on a CPU such an op is bound by its vector units, not memory.
- **Bytes** (device-memory traffic): for each op the program runs (a fusion is one op), the bytes of its operands
  and its output, as XLA's cost analysis counts them; a slice of an operand (dynamic-slice, slice, gather inside or
  outside a fusion) counts the slice, and a dynamic-update-slice, which writes in place, counts only its update
  (read and written). Without this a layer scan would count its whole `[layers, ...]` buffers at every layer.
- **Collectives**: `bytes` is the collective's size as nccl-tests and rccl-tests define it, per device: the
  buffer of an all-reduce, the output of an all-gather (what each device ends with), the input of a reduce-scatter
  (the group's whole buffer), the buffer of an all-to-all or collective-permute. The bus bytes those tests report
  are `bytes x bus_factor(kind, group)`: (n-1)/n for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for
  all-reduce, 1 for collective-permute. An async pair (`*-start` / `*-done`, or `async-start` around a collective)
  counts once; a tuple-shaped collective (XLA combines several into one) counts once with the bytes of all of
  its arrays.
- `cpu_16bit` (a 16-bit step compiled by XLA:CPU, which runs 16-bit work in float32): a collective of values the
  compiler upcast from 16 bits counts at their 16-bit size, as an accelerator moves them: an all-reduce it promoted
  (its reduction renamed `*_promoted`), and a collective whose operand is converted from bf16/f16 in the op that
  produces it (XLA:CPU converts a layer's bf16 weights to float32 before gathering them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
               "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
               "c64": 8, "c128": 16, "token": 0}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Ops that move no data of their own (views, tuples, control flow whose bodies are counted instead).
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
         "after-all", "partition-id", "replica-id", "iota", "async-done", "async-update", "optimization-barrier",
         "add-dependency", "domain", "opt-barrier"} | {f"{kind}-done" for kind in COLLECTIVES}
_SLICING = {"dynamic-slice", "slice", "gather"}
_UPDATING = {"dynamic-update-slice", "scatter"}
_GEMM_TARGETS = ("gemm", "matmul", "hipblaslt")
_TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sqrt", "rsqrt",
                   "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf"}
# XLA:CPU runs a bf16 or f16 all-reduce in float32 and names its reduction so; an accelerator reduces in 16 bits
PROMOTED = "_promoted"

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")


@dataclasses.dataclass
class Instruction:
    name: str
    computation: str  # the name of the computation it is in
    shape: str
    opcode: str
    operands: list[str]
    attributes: str  # the text after the operand list
    called: dict[str, list[str]]  # attribute (calls, body, ...) -> computation names
    op_name: str
    root: bool = False
    arguments: str = ""  # the operand list's text (`0` of `parameter(0)`)


@dataclasses.dataclass
class Module:
    computations: dict[str, dict[str, Instruction]]
    entry: str

    @property
    def instructions(self) -> dict[str, Instruction]:
        return {name: inst for insts in self.computations.values() for name, inst in insts.items()}


def parse_hlo(text: str) -> Module:
    """The computations of an HLO module's text (as `compiled.as_text()` prints it) and its entry's name."""
    computations: dict[str, dict[str, Instruction]] = {}
    current, current_name, entry = None, "", ""
    for line in text.splitlines():
        if not line.startswith(" "):
            match = _COMPUTATION.match(line)
            current_name = match.group(1) if match else ""
            current = computations.setdefault(current_name, {}) if match else None
            if match and line.startswith("ENTRY"):
                entry = current_name
            continue
        match = _INSTRUCTION.match(line)
        if current is None or not match:
            continue
        root, name, shape, opcode, rest = match.groups()
        inside, attributes = _split_operands(rest)
        called = {key: re.findall(r"%?([\w.\-]+)", value) for key, value in _CALLED.findall(attributes)}
        op_name = re.search(r'op_name="([^"]*)"', attributes)
        current[name] = Instruction(name, current_name, shape, opcode, re.findall(r"%([\w.\-]+)", inside),
                                    attributes, called, op_name.group(1) if op_name else "", bool(root), inside)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations, entry)


def _split_operands(rest: str) -> tuple[str, str]:
    """(the operand list, the attributes after it) of the text after `opcode(`."""
    depth = 1
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def arrays(shape: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of each array of a shape, a tuple's in order (layouts and comments ignored)."""
    return [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in _ARRAY.findall(shape)
            if dtype in DTYPE_BYTES]


def shape_bytes(shape: str) -> float:
    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays(shape))


def group_size(attributes: str, devices: int) -> int:
    """Devices in each replica group of a collective, from its `replica_groups` in any of XLA's three forms: a list
    (`{{0,1},{2,3}}`), an iota (`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`: groups x group size) or a mesh
    (`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`: the named axes' sizes multiplied); every device when empty. A
    collective-permute's group is its two ends."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if mesh:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes[name] for name in re.findall(r"'([^']+)'", mesh.group(2)))
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", attributes)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    if "source_target_pairs" in attributes:
        return 2
    return devices


def bus_factor(kind: str, group: int) -> float:
    """Bus bytes per byte of a collective's size, as nccl-tests and rccl-tests count them."""
    if kind == "collective-permute":
        return 1.0
    share = (group - 1) / group if group > 0 else 0.0
    return 2 * share if kind == "all-reduce" else share


@dataclasses.dataclass
class Collective:
    kind: str
    bytes: float  # the collective's size, per device (module docstring)
    group: int
    count: int  # how often it runs a step
    name: str
    op_name: str


@dataclasses.dataclass
class StepCost:
    """Per device, per run of the module (a train step)."""
    flops: float = 0.0
    bytes: float = 0.0
    # each op the program runs: (flops, bytes, transcendentals, how often it runs)
    roofline_ops: list[tuple[float, float, float, int]] = dataclasses.field(default_factory=list)
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    unknown_trip_counts: list[str] = dataclasses.field(default_factory=list)

    def collective_totals(self) -> dict[str, dict[str, float]]:
        """Per kind: bytes and count a step, and the largest group it runs over."""
        totals: dict[str, dict[str, float]] = {}
        for c in self.collectives:
            entry = totals.setdefault(c.kind, {"bytes": 0.0, "count": 0, "group_size": 0})
            entry["bytes"] += c.bytes * c.count
            entry["count"] += c.count
            entry["group_size"] = max(entry["group_size"], c.group)
        return totals


def trip_count(inst: Instruction) -> int | None:
    match = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attributes)
    return int(match.group(1)) if match else None


def step_cost(text: str, devices: int, cpu_16bit: bool = False, shares: dict[str, float] | None = None,
              unknown_trips: int | None = None) -> StepCost:
    """The costs of one run of the compiled module `text` on each of its `devices` (module docstring). `shares`:
    for a two-way conditional under a named scope it names (in its op_name), the share of its runs that take the
    true branch (`jax.lax.cond`'s second); any other conditional counts every branch at each run. `unknown_trips`:
    how often a loop without a known trip count runs (a sampler's decode loop, which ends when every row has
    stopped: planned at its most); without it such a loop counts once and is named in `unknown_trip_counts`."""
    module = parse_hlo(text)
    cost = StepCost()
    _walk(module, module.entry, 1, cost, devices, cpu_16bit, shares or {}, unknown_trips)
    return cost


def _walk(module: Module, computation: str, times: float, cost: StepCost, devices: int, cpu_16bit: bool,
          shares: dict[str, float], unknown_trips: int | None = None) -> None:
    instructions = module.computations[computation]
    for inst in instructions.values():
        if inst.opcode == "while":
            n = trip_count(inst)
            if n is None and unknown_trips is None:
                cost.unknown_trip_counts.append(inst.name)
            n = unknown_trips if n is None else n
            for body in inst.called.get("body", []):
                _walk(module, body, times * (n or 1), cost, devices, cpu_16bit, shares, unknown_trips)
            for condition in inst.called.get("condition", []):  # evaluated once more than the body runs
                _walk(module, condition, times * ((n or 1) + 1), cost, devices, cpu_16bit, shares, unknown_trips)
            continue
        branches = inst.called.get("branch_computations", []) if inst.opcode == "conditional" else []
        share = next((v for scope, v in shares.items() if _in_scope(inst.op_name, scope)), None)
        if share is not None and len(branches) == 2:
            for branch, runs in zip(branches, (1 - share, share)):  # false, true
                _walk(module, branch, times * runs, cost, devices, cpu_16bit, shares, unknown_trips)
            continue
        if inst.opcode in ("call", "conditional"):
            for key in ("calls", "to_apply", "branch_computations"):
                for called in inst.called.get(key, []):
                    _walk(module, called, times, cost, devices, cpu_16bit, shares, unknown_trips)
            continue
        if inst.opcode == "async-start":  # a collective wrapped in an async computation
            for called in inst.called.get("calls", []):
                _walk(module, called, times, cost, devices, cpu_16bit, shares, unknown_trips)
            continue
        kind = _collective_kind(inst.opcode)
        if kind is not None:
            size = _collective_bytes(inst, kind, instructions)
            if cpu_16bit and _upcast_from_16_bits(module, inst, instructions):
                size /= 2
            cost.collectives.append(Collective(kind, size, group_size(inst.attributes, devices), times, inst.name,
                                               inst.op_name))
        if inst.opcode in _FREE:
            continue
        flops = _op_flops(module, inst, instructions)
        moved = _op_bytes(module, inst, instructions)
        transcendentals = _op_transcendentals(module, inst)
        cost.flops += flops * times
        cost.bytes += moved * times
        cost.roofline_ops.append((flops, moved, transcendentals, times))


def _in_scope(op_name: str, scope: str) -> bool:
    """Whether `op_name` names `scope` among its parts, as itself or under transformations (`jvp(scope)`,
    `transpose(jvp(scope))`: the forward, recomputation and gradient of what it computes)."""
    return any(re.fullmatch(rf"(?:[\w\-]+\()*{re.escape(scope)}\)*", part) for part in op_name.split("/"))


def _upcast_from_16_bits(module: Module, inst: Instruction, instructions: dict[str, Instruction]) -> bool:
    """Whether XLA:CPU made a 16-bit collective a float32 one (module docstring)."""
    if any(name.endswith(PROMOTED) for name in inst.called.get("to_apply", [])):
        return True
    for operand in inst.operands:
        producer = instructions.get(operand)
        if producer is None or not arrays(producer.shape):
            return False
        elements = math.prod(arrays(producer.shape)[0][1])
        if producer.opcode == "fusion":
            scope = module.computations[producer.called["calls"][0]]
            converts = [i for i in scope.values() if i.opcode == "convert"]
        else:
            scope, converts = instructions, [producer] if producer.opcode == "convert" else []
        if not any(_converts_16_to_32(c, scope, elements) for c in converts):
            return False
    return bool(inst.operands)


def _converts_16_to_32(convert: Instruction, instructions: dict[str, Instruction], elements: int) -> bool:
    source = instructions.get(convert.operands[0]) if convert.operands else None
    if source is None or not arrays(source.shape) or not arrays(convert.shape):
        return False
    (src, dims), (dst, _) = arrays(source.shape)[0], arrays(convert.shape)[0]
    return src in ("bf16", "f16") and dst == "f32" and math.prod(dims) == elements


def _collective_kind(opcode: str) -> str | None:
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVES else None


def _collective_bytes(inst: Instruction, kind: str, instructions: dict[str, Instruction]) -> float:
    """The collective's size (module docstring): an all-gather's output, any other's operands."""
    operand_shapes = [instructions[o].shape for o in inst.operands if o in instructions]
    if kind == "all-gather":
        return _collective_output_bytes(inst, kind, operand_shapes)
    return sum(shape_bytes(s) for s in operand_shapes)


def _collective_output_bytes(inst: Instruction, kind: str, operand_shapes: list[str]) -> float:
    """Bytes of what a collective writes: an async start's shape is (operands..., outputs...[, context])."""
    if not inst.opcode.endswith("-start"):
        return shape_bytes(inst.shape)
    operands = sum(len(arrays(s)) for s in operand_shapes)
    out = arrays(inst.shape)[operands:2 * operands]
    if kind == "reduce-scatter" or kind == "all-gather":
        return sum(DTYPE_BYTES[d] * math.prod(s) for d, s in out)
    return sum(shape_bytes(s) for s in operand_shapes)


def dot_flops(inst: Instruction, instructions: dict[str, Instruction]) -> float:
    """2 x output elements x contracted elements of a `dot`."""
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attributes)
    return _contraction_flops(inst, instructions, [int(d) for d in contracting.group(1).split(",") if d]
                              if contracting else [])


def _gemm_flops(inst: Instruction, instructions: dict[str, Instruction]) -> float:
    """FLOPs of a GPU GEMM custom call, from the dot dimensions in its backend config (output: its first array)."""
    config = re.search(r"backend_config=(\{.*\})", inst.attributes)
    try:
        numbers = _find_key(json.loads(config.group(1)), "dot_dimension_numbers") if config else None
    except ValueError:
        numbers = None
    if not numbers:
        return 0.0
    return _contraction_flops(inst, instructions, [int(d) for d in numbers.get("lhs_contracting_dimensions", [])])


def _contraction_flops(inst: Instruction, instructions: dict[str, Instruction], contracting: list[int]) -> float:
    lhs = arrays(instructions[inst.operands[0]].shape)[0][1] if inst.operands[0] in instructions else []
    contracted = math.prod(lhs[d] for d in contracting if d < len(lhs))
    return 2 * math.prod(arrays(inst.shape)[0][1]) * contracted


def _find_key(tree, key):
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            if (found := _find_key(value, key)) is not None:
                return found
    return None


def matmul_flops(module: Module, inst: Instruction) -> float | None:
    """FLOPs of the matmuls an op runs (itself, a GEMM custom call, or a fusion's dots), None if it runs none."""
    if inst.opcode == "fusion":
        body = [i for c in inst.called.get("calls", []) for i in module.computations[c].values()]
        if not any(i.opcode == "dot" or _is_gemm(i) for i in body):
            return None
    elif inst.opcode != "dot" and not _is_gemm(inst):
        return None
    return _op_flops(module, inst, module.computations[inst.computation])


def _is_gemm(inst: Instruction) -> bool:
    target = re.search(r'custom_call_target="([^"]*)"', inst.attributes) if inst.opcode == "custom-call" else None
    return bool(target) and any(t in target.group(1).lower() for t in _GEMM_TARGETS)


def _op_flops(module: Module, inst: Instruction, instructions: dict[str, Instruction]) -> float:
    if inst.opcode == "dot":
        return dot_flops(inst, instructions)
    if _is_gemm(inst):
        return _gemm_flops(inst, instructions)
    if inst.opcode == "fusion":
        return sum(_op_flops(module, i, module.computations[c]) for c in inst.called.get("calls", [])
                   for i in module.computations[c].values())
    return 0.0


def _op_transcendentals(module: Module, inst: Instruction) -> float:
    if inst.opcode in _TRANSCENDENTAL:
        return float(sum(math.prod(dims) for _, dims in arrays(inst.shape)))
    if inst.opcode == "fusion":
        return sum(_op_transcendentals(module, i) for c in inst.called.get("calls", [])
                   for i in module.computations[c].values())
    return 0.0


def _op_bytes(module: Module, inst: Instruction, instructions: dict[str, Instruction]) -> float:
    """Bytes an op reads and writes (module docstring)."""
    operand_shapes = [instructions[o].shape if o in instructions else "" for o in inst.operands]
    kind = _collective_kind(inst.opcode)
    if kind is not None and inst.opcode.endswith("-start"):  # its shape holds its operands too, and a context
        return sum(shape_bytes(s) for s in operand_shapes) + _collective_output_bytes(inst, kind, operand_shapes)
    if inst.opcode in _SLICING:
        return 2 * shape_bytes(inst.shape) + sum(shape_bytes(s) for s in operand_shapes[1:] if inst.opcode != "gather")
    if inst.opcode in _UPDATING:
        update = shape_bytes(operand_shapes[1 if inst.opcode == "dynamic-update-slice" else 2])
        return 2 * update
    if inst.opcode != "fusion" or not inst.called.get("calls"):
        return sum(shape_bytes(s) for s in operand_shapes) + shape_bytes(inst.shape)
    body = module.computations[inst.called["calls"][0]]
    users: dict[str, list[Instruction]] = {}
    for i in body.values():
        for o in i.operands:
            users.setdefault(o, []).append(i)
    parameters = {int(i.arguments): i for i in body.values() if i.opcode == "parameter"}
    read = 0.0
    in_place = set()
    for number, shape in enumerate(operand_shapes):
        param = parameters.get(number)
        uses = users.get(param.name, []) if param else []
        if uses and all(u.opcode in _SLICING and u.operands[0] == param.name for u in uses):
            read += sum(shape_bytes(u.shape) for u in uses)
        elif uses and all(u.opcode in _UPDATING and u.operands[0] == param.name for u in uses):
            in_place.add(param.name)  # written in place: only the update counts, below
        else:
            read += shape_bytes(shape)
    root = next((i for i in body.values() if i.root), None)
    outputs = [body[o] for o in root.operands if o in body] if root is not None and root.opcode == "tuple" else [root]
    written = 0.0
    for out in outputs:
        if out is not None and out.opcode in _UPDATING and out.operands[0] in in_place | {
                p.name for p in parameters.values()}:
            written += 2 * shape_bytes(body[out.operands[1 if out.opcode == "dynamic-update-slice" else 2]].shape)
        elif out is not None:
            written += shape_bytes(out.shape)
    return read + written

