"""The machine as `optiml solve` sees it: memory bandwidths and the costs of splitting a layer.

Defaults describe a typical desktop (dual-channel DDR5 CPU, a PCIe 4 consumer GPU):

    cpu_bandwidth    50e9   bytes/s  CPU memory read bandwidth (sparse FFN rows on the CPU are bandwidth-bound)
    gpu_bandwidth   900e9   bytes/s  GPU memory read bandwidth
    transfer_latency 10e-6  s        one PCIe transfer: the CPU's partial FFN output (one n_embd vector) to the GPU
    sync_cost        10e-6  s        waiting for and joining the CPU and GPU halves of a split layer
    launch_overhead   5e-6  s        kernel launches of a layer that has any neurons on the GPU
    gpu_memory          0   bytes    the device's memory (informational; 0: unknown)

A layer that is split between the devices pays transfer_latency + sync_cost (Hardware.split_cost) per token.

A JSON file given to `optiml solve --hardware FILE` holds any subset of these keys, e.g.
    {"cpu_bandwidth": 80e9, "gpu_bandwidth": 1.0e12, "sync_cost": 2e-5}
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields

from ._core import ArgumentError

__all__ = ["Hardware"]


@dataclass
class Hardware:
    cpu_bandwidth: float = 50e9
    gpu_bandwidth: float = 900e9
    transfer_latency: float = 10e-6
    sync_cost: float = 10e-6
    launch_overhead: float = 5e-6
    gpu_memory: int = 0
    source: str = "defaults"  # where the numbers came from, for the report

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "source":
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ArgumentError(f"hardware: {f.name} must be a finite number >= 0, not {v!r}")
            if f.name.endswith("bandwidth") and v <= 0:
                raise ArgumentError(f"hardware: {f.name} must be > 0, not {v!r}")
        self.gpu_memory = int(self.gpu_memory)

    @property
    def split_cost(self) -> float:
        """Seconds per token added by a layer split between the CPU and the GPU."""
        return self.transfer_latency + self.sync_cost

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Hardware:
        """Reads a JSON object with any of the fields above; unknown keys and bad values: ArgumentError."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ArgumentError(f"hardware file not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ArgumentError(f"{path} is not a JSON hardware description: {e}") from None
        if not isinstance(d, dict):
            raise ArgumentError(f"{path}: expected a JSON object of hardware fields, not {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"source"}
        for k in d:
            if k not in known:
                raise ArgumentError(f"{path}: unknown hardware key {k!r}; known: {', '.join(sorted(known))}")
        try:
            return cls(**d, source=f"file {os.path.basename(path)}")
        except ArgumentError as e:
            raise ArgumentError(f"{path}: {e}") from None

    @classmethod
    def auto(cls, measure_bytes: int = 256 << 20) -> Hardware:
        """Measures the CPU's read bandwidth (optiml._core.measure_read_bandwidth); takes the GPU's memory
        size from optiml.system_info()'s CUDA devices when there are any. The GPU bandwidth, latencies and
        overheads are not measured: they keep their defaults. `source` says which is which."""
        from . import _core

        hw = cls()
        measured = []
        try:
            hw.cpu_bandwidth = float(_core.measure_read_bandwidth(measure_bytes, 3))
            measured.append("cpu_bandwidth")
        except Exception:  # noqa: BLE001 - a failed measurement leaves the default
            pass
        devices = _core.system_info().get("cuda_devices", [])
        if devices:
            hw.gpu_memory = int(devices[0]["total_memory"])
            measured.append(f"gpu_memory ({devices[0]['name']})")
        hw.source = ("measured: " + ", ".join(measured) + "; defaults: the rest") if measured else "defaults"
        return hw
