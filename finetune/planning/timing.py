"""`--plan`'s time prediction: the compiled step's costs (`hlo_cost`) on a device model (`devices`).

The model, per device and step:
- each op the program runs takes the longest of its FLOPs at the matmul rate, its bytes at the memory bandwidth of
  an op its size, and its transcendentals (exp, log, ...) at the device's rate for them (a roofline per op: a
  matmul is bound by compute, an elementwise op by memory, or on a CPU by its vector units); `compute` is the sum
  of the ops bound by FLOPs or transcendentals, `memory` of those bound by bytes;
- each collective takes max(the latency, its bus bytes / the bus bandwidth at its size and group) (`communication`);
- `step_seconds` = the ops' time + the communication, none of it overlapped; `overlapped_seconds` = the larger of
  the two, every collective hidden behind compute (XLA overlaps some on GPUs: the real step lies between);
- what bounds the step: the largest of compute, memory and communication.
"""

from __future__ import annotations

import dataclasses

from finetune.planning.devices import DeviceModel
from finetune.planning.hlo_cost import StepCost


@dataclasses.dataclass
class Prediction:
    device: str
    dtype: str
    compute_seconds: float
    memory_seconds: float
    communication_seconds: float
    tokens: int  # trained tokens a step, all devices
    model_flops: float  # a step's model FLOPs, all devices (finetune.step.flops)
    devices: int
    peak_flops: float  # one device's dense peak in the step's dtype
    collectives: dict[str, dict[str, float]]  # kind -> bytes, count, group_size; per device per step
    hlo_flops: float  # per device, counted in the compiled step (recomputation included)
    hlo_bytes: float
    bytes_scale: float = 1.0  # `predict`'s

    def on(self, cost: StepCost, device: DeviceModel) -> "Prediction":
        """The same step (its `cost`) predicted on another device model."""
        return predict(cost, device, self.dtype, self.tokens, self.model_flops, self.devices, self.bytes_scale)

    @property
    def ops_seconds(self) -> float:
        return self.compute_seconds + self.memory_seconds

    @property
    def step_seconds(self) -> float:
        return self.ops_seconds + self.communication_seconds

    @property
    def overlapped_seconds(self) -> float:
        return max(self.ops_seconds, self.communication_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds else 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_seconds * self.devices * self.peak_flops) if self.step_seconds else 0.0

    @property
    def bound(self) -> str:
        parts = {"compute": self.compute_seconds, "memory": self.memory_seconds,
                 "communication": self.communication_seconds}
        return max(parts, key=parts.get)

    def lines(self) -> list[str]:
        out = [f"predicted time per step on {self.device} ({self.dtype}): {self.step_seconds * 1e3:,.1f} ms "
               f"({self.overlapped_seconds * 1e3:,.1f} ms with every collective overlapped), "
               f"{self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}, bound by {self.bound}",
               f"  compute {self.compute_seconds * 1e3:,.1f} ms ({self.hlo_flops / 1e12:,.2f} TFLOP a device), memory "
               f"{self.memory_seconds * 1e3:,.1f} ms ({self.hlo_bytes / 1e9:,.2f} GB moved a device), communication "
               f"{self.communication_seconds * 1e3:,.1f} ms"]
        for kind, entry in sorted(self.collectives.items()):
            out.append(f"  {kind}: {entry['count']:,} a step, {entry['bytes'] / 1e9:,.3f} GB a device, groups of "
                       f"{entry['group_size']}")
        return out

    def as_json(self) -> dict:
        return {"step_seconds": self.step_seconds, "overlapped_step_seconds": self.overlapped_seconds,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bound": self.bound,
                "compute_seconds": self.compute_seconds, "memory_seconds": self.memory_seconds,
                "communication_seconds": self.communication_seconds, "flops_per_device": self.hlo_flops,
                "bytes_per_device": self.hlo_bytes, "model_flops": self.model_flops}


def predict(cost: StepCost, device: DeviceModel, dtype: str, tokens: int, model_flops: float, devices: int,
            bytes_scale: float = 1.0) -> Prediction:
    """The step's predicted time. `bytes_scale` multiplies the memory traffic (a bf16 step planned on a CPU counts
    the float32 step's traffic at half: the CPU compiler runs bf16 elementwise work in float32)."""
    rate = device.matmul_flops_per_s(dtype)
    compute = memory = 0.0
    for flops, moved, transcendentals, times in cost.roofline_ops:
        flops_time = max(flops / rate, transcendentals / device.transcendentals_per_s)
        bytes_time = moved * bytes_scale / device.memory_bytes_per_s(moved * bytes_scale)
        if flops_time >= bytes_time:
            compute += flops_time * times
        else:
            memory += bytes_time * times
    communication = sum(device.collective_seconds(c.kind, c.bytes, c.group) * c.count for c in cost.collectives)
    return Prediction(device.name, dtype, compute, memory, communication, tokens, model_flops, devices,
                      device.peak_flops[dtype], cost.collective_totals(), cost.flops, cost.bytes * bytes_scale,
                      bytes_scale)
