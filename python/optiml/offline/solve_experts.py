"""`optiml solve` on a mixture of experts: which whole experts of each layer go to the GPU.

The same program as for neurons (optiml.offline.solve: solve_groups, and _solve_partial_attention when the
fixed part does not fit), with each layer's experts as its groups:

    fixed part   every tensor but the experts' 3-D tensors (ffn_{gate,up,down}_exps) and the token embeddings
                 (counted as the output matrix when tied): attention, norms, routers, shared experts, the
                 output; the f16 KV cache for ctx tokens; the device's scratch for steps of `batch` tokens
                 and the buffers of layers whose experts are split (plan.cpp: scratch_bytes,
                 moe_split_scratch_bytes).
    groups       layer l's experts in hot-first order (most chosen first, stats.expert_count), one expert a
                 group: its gate, up and down blocks, exact bytes from the file.
    CPU bytes    expert e costs the CPU share(e) * its bytes per token, share(e) = the tokens that chose it
                 over all tokens (stats.expert_count / stats.n_tokens): what a decode step reads of it.
    GPU time     what a decode step reads there at most: the k experts a token uses (expert_used_count),
                 at the GPU's bandwidth, plus the launch overhead, once a layer has any expert on the GPU
                 (Hardware.launch_overhead carries it; the groups' own bytes cost the GPU no time). Counting
                 every byte the GPU holds, as for neurons, would be a batch's view: it stops placing hot
                 experts long before the budget where a decode step reads only the chosen few.
    CPU rate     the CPU reads a chosen expert whole: its dense rate for the experts' type when `optiml hw`
                 measured it (Hardware.cpu_dense), else cpu_bandwidth.

The engine runs a layer's GPU experts and its CPU experts at once (Session::moe_split) and routes on the
host; the placement is written as optiml.placement.gpu_experts (each layer's list, hottest first) and
optiml.placement.gpu_expert_count, beside gpu_attention. The weights are not moved.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from .._core import ArgumentError
from ..formats import gguf
from ..formats.quant import type_info
from .hardware import Hardware
from .solve import MIP_GAP, Placement, _check_tokens, _place
from .time_model import fixed_layout

__all__ = ["expert_layout", "solve_expert_placement"]

_EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expert_layout(path) -> dict:
    """From the GGUF: per layer one expert's exact bytes, the fixed bytes and what goes with each layer's
    attention, the KV cache per token and the device's scratch per token of a batch (as the plan counts it)."""
    with gguf.open(path) as f:
        md = f.metadata
        arch = str(md.get("general.architecture", ""))
        tensors = {t.name: t for t in f.tensors}
    n_layer = int(md.get(f"{arch}.block_count", 0) or 0)
    n_expert = int(md.get(f"{arch}.expert_count", 0) or 0)
    k = int(md.get(f"{arch}.expert_used_count", 0) or 0)
    if n_expert <= 0 or n_layer <= 0:
        raise ArgumentError(f"{os.path.basename(path)} is not a mixture of experts ({arch}.expert_count)")
    expert_bytes, types = [], []
    for l in range(n_layer):
        ts = [tensors.get(f"blk.{l}.{n}.weight") for n in _EXPS]
        if any(t is None for t in ts):
            raise ArgumentError(f"{os.path.basename(path)}: layer {l} has no expert tensors ({', '.join(_EXPS)}); "
                                "optiml solve places experts of mixtures whose every layer has them")
        if any(t.n_bytes % n_expert for t in ts):
            raise ArgumentError(f"layer {l}: expert tensor sizes are not whole experts")
        expert_bytes.append(sum(t.n_bytes // n_expert for t in ts))
        types.append(type_info(ts[1].type).name)
    exps = {f"blk.{l}.{n}.weight" for l in range(n_layer) for n in _EXPS}
    fixed = fixed_layout(tensors, md, arch, n_layer, lambda n: n in exps)
    n_embd, n_head, n_head_kv, k_len = fixed["n_embd"], fixed["n_head"], fixed["n_head_kv"], fixed["k_len"]
    n_ff = int(md.get(f"{arch}.feed_forward_length", 0) or 0) or int(md[f"{arch}.expert_feed_forward_length"])
    # plan.cpp: scratch_bytes (x, xn, y, y2; q, attn; k, v; gate, up) and moe_split_scratch_bytes.
    scratch = 4 * (4 * n_embd + 2 * n_head * k_len + 2 * n_head_kv * k_len + 2 * n_ff)
    split = 4 * (n_expert + k * n_embd + n_embd + 1 + 2 * k)
    return dict(fixed, n_layer=n_layer, n_expert=n_expert, n_expert_used=k, expert_bytes=expert_bytes,
                kv_per_token=n_layer * fixed["kv_per_position"],
                scratch_per_token=scratch + split, expert_type=max(set(types), key=types.count))  # the most layers'


def solve_expert_placement(model_path, stats, vram: int, hardware: Hardware, ctx: int = 4096,
                           time_limit: float = 30.0, mip_gap: float = MIP_GAP, method: str = "auto",
                           batch: int = 512, positions: int | None = None) -> Placement:
    """Places whole experts of the mixture of experts at model_path on the GPU within `vram` bytes (see the
    module doc). stats: optiml profile's statistics of this model (with its experts' counts). The result's
    gpu_experts holds each layer's experts for the GPU, hottest first; gpu_neurons is all zeros and group 1
    (one expert). positions: as for solve_placement."""
    model_path = os.fspath(model_path)
    if isinstance(vram, bool) or not isinstance(vram, (int, np.integer)) or vram < 0:
        raise ArgumentError(f"the VRAM budget must be a whole number of bytes >= 0, not {vram!r}")
    _check_tokens("ctx", ctx)
    _check_tokens("batch", batch)
    positions = int(ctx) // 2 if positions is None else positions
    _check_tokens("positions", positions, 0)
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"model file not found: {model_path}")
    lay = expert_layout(model_path)
    stats.check_model(model_path)
    if not stats.is_moe:
        raise ArgumentError("the stats hold no expert counts: profile the model with this version of optiml "
                            "profile (it records the router's choices of a mixture of experts)")
    L, X = lay["n_layer"], lay["n_expert"]
    count = np.asarray(stats.expert_count, dtype=np.float64)
    if count.shape != (L, X):
        raise ArgumentError(f"the stats count experts as {count.shape} (layers, experts); the model has {X} "
                            f"experts in {L} layers")
    share = count / max(1, stats.n_tokens)
    order = [np.argsort(-count[l], kind="stable") for l in range(L)]
    gbs = [np.full(X, lay["expert_bytes"][l], dtype=np.int64) for l in range(L)]
    cbs = [share[l][order[l]] * lay["expert_bytes"][l] for l in range(L)]
    gpu_read = lay["n_expert_used"] * max(lay["expert_bytes"]) / hardware.gpu_bandwidth
    ffn_hw = replace(hardware, cpu_bandwidth=hardware.cpu_dense.get(lay["expert_type"].lower(), hardware.cpu_bandwidth),
                     gpu_bandwidth=1e30, launch_overhead=hardware.launch_overhead + gpu_read,
                     source=f"{hardware.source}; experts: a decode step's reads")
    r = _place(lay, gbs, cbs, vram, hardware, ffn_hw, ctx, batch, positions, time_limit, mip_gap, method)
    sol = r.sol
    gpu_experts = [[int(e) for e in order[l][:x]] for l, x in enumerate(sol.x)]
    coverage = [float(count[l][order[l][:x]].sum() / count[l].sum()) if count[l].sum() > 0 else float(x == X)
                for l, x in enumerate(sol.x)]
    return Placement(gpu_neurons=[0] * L, group=1, coverage=coverage, ffn_bytes=[b * X for b in lay["expert_bytes"]],
                     gpu_ffn_bytes=[b * x for b, x in zip(lay["expert_bytes"], sol.x)], gpu_experts=gpu_experts,
                     **r.fields(vram, ctx, positions, hardware))
