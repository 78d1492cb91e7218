"""Device models for `--plan`'s time prediction: what one accelerator of a node computes, streams and exchanges.

A model is a named entry of `DEVICE_MODELS` (public figures; docs/405b-on-mi300x.md gives each figure's source) or a
JSON file `bench/device_report.py --json` wrote on the machine itself (measured figures). `--device-model` picks
one; `default_device_model` picks the one a plan uses when none is named.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from pathlib import Path

from finetune.planning.hlo_cost import bus_factor
from jaxmodel.errors import UsageError

GB = 1e9


class DeviceModelError(ValueError, UsageError):
    """An unknown `--device-model` name or a file that does not describe a device; the message says which."""


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    name: str
    peak_flops: dict[str, float]  # dense matmul FLOP/s by compute dtype ("bfloat16", "float32")
    matmul_fraction: float  # of the peak a large matmul reaches
    hbm_bytes_per_s: float  # device memory bandwidth a streaming op reaches
    # collective bus bandwidth (nccl-tests' busbw, bytes/s) by group size: [(message bytes, busbw), ...], rising sizes
    bus_bandwidth: dict[int, tuple[tuple[float, float], ...]]
    collective_latency_s: float  # the least time any collective takes
    source: str  # where the figures come from
    # memory bandwidth an op reaches by the bytes it moves, [(bytes, bytes/s), ...] rising (measured: caches make
    # small ops faster); empty: `hbm_bytes_per_s` for every op
    memory_table: tuple[tuple[float, float], ...] = ()
    # elements of exp, log, tanh, ... a second: what bounds such an op on a CPU's vector units; unbounded (not part
    # of the model) for the accelerators of the table, whose special-function units keep such ops memory-bound
    transcendentals_per_s: float = math.inf

    def matmul_flops_per_s(self, dtype: str) -> float:
        return self.peak_flops[dtype] * self.matmul_fraction

    def memory_bytes_per_s(self, size: float) -> float:
        """The memory bandwidth of an op moving `size` bytes."""
        return _interpolated(self.memory_table, size) if self.memory_table else self.hbm_bytes_per_s

    def bus_bytes_per_s(self, size: float, group: int) -> float:
        """Bus bandwidth of a collective of `size` bytes over `group` devices: the table of the nearest group size
        at or above it (the largest, past it)."""
        groups = sorted(self.bus_bandwidth)
        return _interpolated(self.bus_bandwidth[next((g for g in groups if g >= group), groups[-1])], size)

    def collective_seconds(self, kind: str, size: float, group: int) -> float:
        """Time of one collective of `size` bytes (hlo_cost's convention) over `group` devices."""
        if group <= 1 or size <= 0:
            return 0.0
        bus = size * bus_factor(kind, group)
        return max(self.collective_latency_s, bus / self.bus_bytes_per_s(size, group))


def _interpolated(table: tuple[tuple[float, float], ...], size: float) -> float:
    """A table's figure at `size`: its own at one of its points, interpolated in log(size) between them (which
    would round off a measured figure), flat past either end."""
    sizes = [s for s, _ in table]
    i = bisect.bisect_left(sizes, size)
    if i < len(table) and sizes[i] == size:
        return table[i][1]
    if i == 0:
        return table[0][1]
    if i == len(table):
        return table[-1][1]
    (s0, b0), (s1, b1) = table[i - 1], table[i]
    t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return b0 + t * (b1 - b0)


def _xgmi_full_mesh(eight: tuple[tuple[float, float], ...]) -> dict[int, tuple[tuple[float, float], ...]]:
    """An 8-GPU xGMI node is a full mesh of links: a group of n GPUs drives n-1 of each GPU's 7 links, so its bus
    bandwidth is (n-1)/7 of the 8-GPU figure."""
    return {n: tuple((size, bw * (n - 1) / 7) for size, bw in eight) for n in (2, 4, 8)}


MIB, GIB = 2**20, 2**30
# RCCL all-reduce bus bandwidth on 8 MI300X, rccl-tests (ROCm blog "mi300x-rccl-xgmi"); 2 of the 8 GPUs measured
# 47.7 GB/s elsewhere, 1/7 of the 8-GPU figure as the full mesh implies.
_MI300X_BUS = _xgmi_full_mesh(((1 * MIB, 66.9 * GB), (8 * MIB, 175.4 * GB), (32 * MIB, 240.6 * GB),
                               (128 * MIB, 294.6 * GB), (1 * GIB, 314.7 * GB), (16 * GIB, 319.0 * GB)))
# NCCL on 8 GPUs behind NVSwitch: the published all-reduce figures up to the ring algorithm's ~365 GB/s, which
# all-gather and reduce-scatter reach too (NVLS lifts all-reduce alone to ~470); any group of the 8 gets each GPU's
# full NVLink bandwidth (4 of 8 measured 363 GB/s).
_H100_BUS = {n: ((1 * MIB, 43.7 * GB), (8 * MIB, 172.1 * GB), (32 * MIB, 295.5 * GB), (128 * MIB, 365.0 * GB))
             for n in (2, 4, 8)}
_H200_BUS = {n: ((1 * MIB, 53.0 * GB), (8 * MIB, 181.9 * GB), (32 * MIB, 300.9 * GB), (128 * MIB, 365.6 * GB))
             for n in (2, 4, 8)}

# Peaks are dense (no sparsity). float32: XLA runs a float32 dot as TF32 on NVIDIA GPUs and as FP32 on AMD ones.
# Matmul fraction: the best large bf16 GEMM measured against the peak. Memory: a measured copy's bandwidth.
DEVICE_MODELS: dict[str, DeviceModel] = {
    "mi300x": DeviceModel("mi300x", {"bfloat16": 1307.4e12, "float32": 163.4e12}, 708 / 1307.4, 4.11e12,
                          _MI300X_BUS, 13e-6, "AMD MI300X, public figures (docs/405b-on-mi300x.md)"),
    "mi325x": DeviceModel("mi325x", {"bfloat16": 1307.4e12, "float32": 163.4e12}, 843 / 1307.4, 6.0e12 * 0.77,
                          _MI300X_BUS, 13e-6, "AMD MI325X, public figures (docs/405b-on-mi300x.md)"),
    "h100": DeviceModel("h100", {"bfloat16": 989.4e12, "float32": 494.7e12}, 794.5 / 989.4, 2.90e12, _H100_BUS,
                        26e-6, "NVIDIA H100 SXM, public figures (docs/405b-on-mi300x.md)"),
    "h200": DeviceModel("h200", {"bfloat16": 989.4e12, "float32": 494.7e12}, 781 / 989.4, 4.01e12, _H200_BUS,
                        30e-6, "NVIDIA H200 SXM, public figures (docs/405b-on-mi300x.md)"),
}
DEFAULT = "mi300x"
# `device_kind` strings JAX reports, matched by substring (lower case) to a table entry
_KINDS = {"mi300x": "mi300x", "mi325x": "mi325x", "h100": "h100", "h200": "h200"}


def default_device_model(device_kind: str, backend: str) -> DeviceModel:
    """The model a plan uses when `--device-model` is not given: the accelerator it runs on where the table has it,
    else the target node's (MI300X): a plan on a CPU plans for the node."""
    kind = device_kind.lower()
    if backend != "cpu":
        for key, name in _KINDS.items():
            if key in kind:
                return DEVICE_MODELS[name]
    return DEVICE_MODELS[DEFAULT]


def load_device_model(spec: str) -> DeviceModel:
    """`--device-model NAME` (a table entry) or `--device-model FILE.json` (bench/device_report.py --json)."""
    if spec.lower() in DEVICE_MODELS:
        return DEVICE_MODELS[spec.lower()]
    path = Path(spec)
    if not spec.endswith(".json") and not path.is_file():
        raise DeviceModelError(f"--device-model {spec}: unknown device (known: {', '.join(DEVICE_MODELS)}; or a JSON "
                               "file from bench/device_report.py --json)")
    try:
        report = json.loads(path.read_text())
    except OSError as e:
        raise DeviceModelError(f"--device-model {spec}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise DeviceModelError(f"--device-model {spec}: not valid JSON ({e})") from None
    return device_model_from_report(report, spec)


def device_model_from_report(report: object, where: str) -> DeviceModel:
    """A model from measured figures: bench/device_report.py's `matmul_peak_flops`, `memory_bandwidth` and
    `collectives` (`{"table": {GROUP: [[bytes, busbw], ...]}, "latency_s": ...}`); measured figures are reached
    figures, so the matmul fraction is 1."""
    def field(value, name, check):
        if not check(value):
            raise DeviceModelError(f"--device-model {where}: field {name}: expected {check.__doc__}")
        return value

    if not isinstance(report, dict):
        raise DeviceModelError(f"--device-model {where}: expected a JSON object (bench/device_report.py --json)")
    peaks = field(report.get("matmul_peak_flops"), "matmul_peak_flops", _peak_table)
    memory = report.get("memory_bandwidth") if isinstance(report.get("memory_bandwidth"), dict) else {}
    bandwidth = field(memory.get("bytes_per_s"), "memory_bandwidth.bytes_per_s", _positive)
    memory_table = tuple((float(s), float(b)) for s, b in field(memory.get("table", []), "memory_bandwidth.table",
                                                                   _size_table))
    collectives = report.get("collectives") if isinstance(report.get("collectives"), dict) else {}
    table = collectives.get("table")
    if table is None:  # no collective measured (one device): collectives cost nothing in the prediction
        bus, latency = {1: ((1.0, math.inf),)}, 0.0
    else:
        field(table, "collectives.table", _bus_table)
        bus = {int(g): tuple((float(s), float(b)) for s, b in rows) for g, rows in table.items()}
        latency = float(field(collectives.get("latency_s"), "collectives.latency_s", _non_negative))
    transcendentals = field(report.get("transcendentals_per_s", math.inf), "transcendentals_per_s", _positive)
    name = str(report.get("device_kind") or report.get("backend") or "measured")
    return DeviceModel(name, {k: float(v) for k, v in peaks.items()}, 1.0, float(bandwidth), bus, latency,
                       f"measured: {where}", memory_table, float(transcendentals))


def _positive(value) -> bool:
    """a positive number"""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _non_negative(value) -> bool:
    """a number >= 0"""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _peak_table(value) -> bool:
    """an object of FLOP/s by dtype, e.g. {"float32": 4e14, "bfloat16": 7.8e14}"""
    return isinstance(value, dict) and bool(value) and all(_positive(v) for v in value.values())


def _bus_table(value) -> bool:
    """an object {GROUP_SIZE: [[bytes, bus bytes/s], ...]} with rising sizes"""
    if not isinstance(value, dict) or not value:
        return False
    return all(str(group).isdigit() and rows and _size_table(rows) for group, rows in value.items())


def _size_table(value) -> bool:
    """a list [[bytes, bytes/s], ...] with rising sizes"""
    if not isinstance(value, list):
        return False
    if not all(isinstance(r, list) and len(r) == 2 and _positive(r[0]) and _positive(r[1]) for r in value):
        return False
    return [r[0] for r in value] == sorted(r[0] for r in value)
