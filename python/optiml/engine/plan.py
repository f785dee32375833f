"""The execution plan: which device runs each part of each layer (native/include/optiml/plan.h).

    optiml.Model(path, device="cpu:1", vram="20MiB").plan     # the plan a model runs with
    optiml.plan.make(path, device="cpu:1", vram="20MiB")      # the plan it would get, without loading it
    print(plan)                                               # a readable table

device: "auto" (the CPU, until the CUDA backend is verified on a GPU; give "cuda" for the GPU), "cpu", "cpu:N" (a second CPU instance
that the plan treats as an accelerator, for testing split execution on any machine) or "cuda[:N]".
vram: the device's memory budget (bytes, or a size such as "6GiB"); n_gpu_layers: the last N layers whole
on the device, as llama.cpp's -ngl; gpu_neurons: per-layer FFN neurons on the device (one value for all
layers, or one per layer), overriding the file's placement (`optiml solve`); gpu_experts (mixtures of
experts): per layer the experts for the device, hottest first, the others kept on the CPU, both running at
once, overriding the file's expert placement.
"""

from __future__ import annotations

import os
from typing import Sequence

from .. import _core
from .._core import ArgumentError
from ..hub.registry import resolve
from ..util.sizes import parse_size

__all__ = ["Plan", "make", "plan_args", "kv_types", "KV_TYPES"]

# The KV cache's element types, by llama.cpp's names (--cache-type-k/-v): bytes per value 4, 2, 1.0625
# and 0.5625. Aliases: other spellings, and ggml's type ids (llama_cpp.GGML_TYPE_Q8_0 = 8, ...).
KV_TYPES = ("f16", "f32", "q8_0", "q4_0")
_KV_ALIASES = {"fp16": "f16", "float16": "f16", "half": "f16", "fp32": "f32", "float32": "f32", "float": "f32",
               0: "f32", 1: "f16", 2: "q4_0", 8: "q8_0"}


def _kv_type(what: str, t) -> str:
    name = t.lower() if isinstance(t, str) else t
    if isinstance(name, bool):
        name = None
    name = _KV_ALIASES.get(name, name)
    if name not in KV_TYPES:
        raise ArgumentError(f"{what} must be one of {', '.join(KV_TYPES)} (llama.cpp's cache types; ggml type ids "
                            f"0, 1, 2 and 8 are accepted too), not {t!r}")
    return name


def kv_types(kv_type="f16", kv_type_k=None, kv_type_v=None) -> tuple[str, str]:
    """The keys' and values' cache types: kv_type for both, kv_type_k / kv_type_v overriding either
    (llama.cpp's -ctk / -ctv)."""
    base = _kv_type("kv_type", kv_type)
    k = base if kv_type_k is None else _kv_type("kv_type_k", kv_type_k)
    v = base if kv_type_v is None else _kv_type("kv_type_v", kv_type_v)
    return k, v


class Plan:
    """A plan as data: ``device``, ``reason``, ``budget`` (bytes, -1 = none), ``layers`` (per layer a dict
    with ``attention`` (its device), ``ffn_on_device`` (neurons) and ``device_experts`` (the experts on
    the device of a layer whose experts are split)), ``device_bytes`` (by use),
    ``host_kv_bytes``, ``host_scratch_bytes``, ``kv_type_k`` and ``kv_type_v`` (the KV cache's types);
    str() gives the table."""

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
              kv_vram=None, n_cpu_moe=None, gpu_experts=None) -> dict:
    """The native keyword arguments for a plan, validated. n_cpu_moe: a mixture of experts keeps the experts of
    its first n_cpu_moe layers on the CPU (llama.cpp's --n-cpu-moe; True: every layer's, --cpu-moe).
    gpu_experts: per layer a list of expert ids for the device, hottest first (as many as the budget
    holds go; the others stay on the CPU and both run at once), overriding the file's (`optiml solve`)."""
    if not isinstance(device, str) or not device:
        raise ArgumentError(f"device must be a string such as 'auto', 'cpu', 'cpu:1' or 'cuda', not {device!r}")
    args = {"device": device, "vram": -1 if vram is None else parse_size(vram), "n_gpu_layers": -1,
            "gpu_neurons": None, "kv_vram": -1 if kv_vram is None else parse_size(kv_vram), "n_cpu_moe": -1}
    if n_cpu_moe is True:
        args["n_cpu_moe"] = n_layer
    elif n_cpu_moe is not None and n_cpu_moe is not False:
        if isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int) or n_cpu_moe < 0:
            raise ArgumentError(f"n_cpu_moe must be a non-negative integer (or True: every layer), not {n_cpu_moe!r}")
        args["n_cpu_moe"] = min(n_cpu_moe, n_layer)  # (past the layers: all of them)
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
    if gpu_experts is not None:
        if (not isinstance(gpu_experts, Sequence) or isinstance(gpu_experts, str)
                or any(not isinstance(ids, Sequence) or isinstance(ids, str) for ids in gpu_experts)
                or any(isinstance(e, bool) or not isinstance(e, int) for ids in gpu_experts for e in ids)):
            raise ArgumentError("gpu_experts must be a list of one list of expert ids per layer")
        if len(gpu_experts) != n_layer:
            raise ArgumentError(f"gpu_experts has {len(gpu_experts)} lists for {n_layer} layers")
        args["gpu_experts"] = [[int(e) for e in ids] for ids in gpu_experts]
    return args


def make(path: str | os.PathLike, n_ctx: int | None = None, n_seq: int = 1, n_batch: int = 512,
         kv_type: str = "f16", device: str = "auto", vram=None, n_gpu_layers=None, gpu_neurons=None,
         kv_vram=None, kv_type_k=None, kv_type_v=None, n_cpu_moe=None, gpu_experts=None) -> Plan:
    """The plan a model would run with (nothing is uploaded or allocated). kv_type, kv_type_k, kv_type_v:
    the KV cache's types (see :func:`kv_types`); the plan's KV bytes follow them."""
    tk, tv = kv_types(kv_type, kv_type_k, kv_type_v)
    model = _core.Model(os.fsencode(resolve(path)))
    hp = model.hparams
    n_ctx = min(hp["n_ctx_train"], 4096) if n_ctx is None else n_ctx
    args = plan_args(hp["n_layer"], device, vram, n_gpu_layers, gpu_neurons, kv_vram, n_cpu_moe, gpu_experts)
    return Plan(_core.make_plan(model, n_ctx, n_seq, n_batch, tk, kv_type_v=tv, **args))
