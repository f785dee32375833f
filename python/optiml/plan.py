"""The execution plan: which device runs each part of each layer (native/include/optiml/plan.h).

    optiml.Model(path, device="cpu:1", vram="20MiB").plan     # the plan a model runs with
    optiml.plan.make(path, device="cpu:1", vram="20MiB")      # the plan it would get, without loading it
    print(plan)                                               # a readable table

device: "auto" (a GPU when this build can run one, else the CPU), "cpu", "cpu:N" (a second CPU instance
that the plan treats as an accelerator, for testing split execution on any machine) or "cuda[:N]".
vram: the device's memory budget (bytes, or a size such as "6GiB"); n_gpu_layers: the last N layers whole
on the device, as llama.cpp's -ngl; gpu_neurons: per-layer FFN neurons on the device (one value for all
layers, or one per layer), overriding the file's placement (`optiml solve`).
"""

from __future__ import annotations

import os
from typing import Sequence

from . import _core
from ._core import ArgumentError

__all__ = ["Plan", "make", "plan_args"]


class Plan:
    """A plan as data: ``device``, ``reason``, ``budget`` (bytes, -1 = none), ``layers`` (per layer a dict
    with ``attention`` (its device) and ``ffn_on_device`` (neurons)), ``device_bytes`` (by use),
    ``host_kv_bytes``, ``host_scratch_bytes``; str() gives the table."""

    def __init__(self, d: dict):
        self._d = dict(d)

    def __getattr__(self, name):
        try:
            return self._d[name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict:
        return dict(self._d)

    def __str__(self) -> str:
        return self._d["summary"]

    def __repr__(self) -> str:
        return f"<optiml.Plan device={self._d['device']!r} {self._d['device_bytes']['total']} device bytes>"


def plan_args(n_layer: int, device: str = "auto", vram=None, n_gpu_layers=None, gpu_neurons=None,
              kv_vram=None) -> dict:
    """The native keyword arguments for a plan, validated."""
    from .solve import parse_size

    if not isinstance(device, str) or not device:
        raise ArgumentError(f"device must be a string such as 'auto', 'cpu', 'cpu:1' or 'cuda', not {device!r}")
    args = {"device": device, "vram": -1 if vram is None else parse_size(vram), "n_gpu_layers": -1,
            "gpu_neurons": None, "kv_vram": -1 if kv_vram is None else parse_size(kv_vram)}
    if n_gpu_layers is not None:
        if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int) or n_gpu_layers < 0:
            raise ArgumentError(f"n_gpu_layers must be a non-negative integer, not {n_gpu_layers!r}")
        args["n_gpu_layers"] = n_gpu_layers
    if gpu_neurons is not None:
        if isinstance(gpu_neurons, int) and not isinstance(gpu_neurons, bool):
            gpu_neurons = [gpu_neurons] * n_layer
        if not isinstance(gpu_neurons, Sequence) or any(isinstance(k, bool) or not isinstance(k, int) for k in gpu_neurons):
            raise ArgumentError("gpu_neurons must be an integer or a list of one integer per layer")
        args["gpu_neurons"] = [int(k) for k in gpu_neurons]
    return args


def make(path: str | os.PathLike, n_ctx: int | None = None, n_seq: int = 1, n_batch: int = 512,
         kv_type: str = "f16", device: str = "auto", vram=None, n_gpu_layers=None, gpu_neurons=None,
         kv_vram=None) -> Plan:
    """The plan a model would run with (nothing is uploaded or allocated)."""
    from .models import resolve

    model = _core.Model(os.fsencode(resolve(path)))
    hp = model.hparams
    n_ctx = min(hp["n_ctx_train"], 4096) if n_ctx is None else n_ctx
    args = plan_args(hp["n_layer"], device, vram, n_gpu_layers, gpu_neurons, kv_vram)
    return Plan(_core.make_plan(model, n_ctx, n_seq, n_batch, kv_type, **args))
