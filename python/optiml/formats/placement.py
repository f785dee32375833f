"""Writing a placement into a GGUF file and reading it back.

    write_placed("model.gguf", stats, placement, "model.placed.gguf")   # stats: formats.stats.ActivationStats
    read_placement("model.placed.gguf")                                   # dict, or None when unplaced

Each layer's FFN neurons get a hot-first order (optiml.formats.stats.hot_first_order): placed neuron i is stored
neuron order[l][i], and layer l's GPU share is placed neurons [0, k_l). The placed file computes exactly
what the source computes; nothing is requantized. It takes one of two forms:

- permuted: gate/up rows (and their biases) move whole, byte for byte, and the down projection
  [n_embd rows, n_ff columns] moves column by column. Its rows are stored in blocks along n_ff, so this
  form needs every layer's down to be a float type (F32/F16/BF16: columns move exactly), or the order to
  move whole quant blocks (each placed block holds the neurons of one stored block; inside a block the
  neurons may be reordered only for the types whose elements decode independently, Q4_0/Q4_1/Q5_0/Q5_1/
  Q8_0/IQ4_NL/MXFP4, by moving their codes). No optiml.placement.neuron_order key.
- neuron_order (the general case, e.g. any quantized down with a neuron-level order): gate, up and down
  keep the source's bytes and order, and optiml.placement.neuron_order (int32, n_layer * n_ff values)
  says that placed neuron i of layer l is the stored neuron order[l * n_ff + i]; the engine gathers at
  load.

Either way the file stays a valid llama.cpp model computing the source's function (a permutation of FFN
neurons does not change it); the placement is metadata only (optiml.placement.*), no extra tensors.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from . import gguf as _gguf
from . import quant
from .._core import ArgumentError, GGUFError, UnsupportedModelError
from .gguf_edit import GGUFValueType as VT
from .gguf_edit import check_output, rewrite_gguf
from .stats import ActivationStats, hot_first_order
from ..util import jsonout

__all__ = ["PREFIX", "coverage_curve", "curve_ranks", "ffn_layout", "layer_bytes", "read_placement", "write_placed",
           "write_expert_placement"]

PREFIX = "optiml.placement."
VERSION = 2  # 2: neuron_order; no requantized down (v1 wrote down_type)
N_CURVE = 128

_FLOAT_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_NEURON_ROWS = ("ffn_gate.weight", "ffn_up.weight", "ffn_gate.bias", "ffn_up.bias")  # indexed by neuron on the outer axis
_NOT_NEURON = ("ffn_norm.weight", "ffn_norm.bias", "ffn_post_norm.weight", "ffn_down.bias", "ffn_pre_norm.weight")


# ---- curves ---------------------------------------------------------------------------------------
def curve_ranks(n_ff: int, n: int = N_CURVE) -> np.ndarray:
    """About n log-spaced neuron ranks from 1 to n_ff (1-based, unique, both ends included)."""
    m = n
    while True:  # low ranks round to the same integer: sample more points until n distinct ones
        r = np.unique(np.round(np.geomspace(1, n_ff, m)).astype(np.int32))
        if len(r) >= min(n, n_ff) or m > 8 * n:
            return r
        m += n // 4


def coverage_curve(freq: np.ndarray) -> np.ndarray:
    """[L, F] firing frequencies -> [L, F]: share of all firings covered by each layer's r most frequent
    neurons (column r-1)."""
    s = -np.sort(-np.asarray(freq, dtype=np.float64), axis=1)
    c = np.cumsum(s, axis=1)
    tot = c[:, -1:]
    return np.divide(c, tot, out=np.zeros_like(c), where=tot > 0)


# ---- the FFN tensors of a file --------------------------------------------------------------------
def ffn_layout(f: _gguf.GGUFFile) -> tuple[int, int, dict[int, dict[str, _gguf.TensorInfo]]]:
    """(n_layer, n_ff, {layer: {suffix: TensorInfo}}) of the FFN tensors; UnsupportedModelError when the
    FFN is not a plain (gated) MLP with the same width in every layer."""
    if f.metadata.get("general.architecture") == "phi3":
        raise UnsupportedModelError(f"{f.path}: phi3 keeps each layer's gate and up in one tensor (ffn_up, 2 x n_ff "
                                    "rows); placing or reordering its neurons is not supported yet: run it whole on "
                                    "one device, or sparse on the CPU after optiml calibrate")
    layers: dict[int, dict[str, _gguf.TensorInfo]] = {}
    for t in f.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(ffn_\w+\.\w+)", t.name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
    if not layers:
        raise UnsupportedModelError(f"{f.path}: no FFN tensors (blk.N.ffn_up.weight) found")
    n_ff = None
    for l in sorted(layers):
        d = layers[l]
        if any("exps" in k for k in d):
            raise UnsupportedModelError(f"{f.path}: mixture-of-experts FFNs cannot be placed by neuron")
        for need in ("ffn_up.weight", "ffn_down.weight"):
            if need not in d:
                raise UnsupportedModelError(f"{f.path}: layer {l} has no {need}")
        w = int(d["ffn_up.weight"].shape[1])
        if n_ff is None:
            n_ff = w
        elif w != n_ff:
            raise UnsupportedModelError(f"{f.path}: FFN widths differ between layers ({n_ff} and {w})")
        for k, t in d.items():
            if k in _NEURON_ROWS:
                if int(t.shape[-1]) != n_ff:
                    raise UnsupportedModelError(f"{f.path}: {t.name} has shape {list(t.shape)}, not {n_ff} neurons")
            elif k == "ffn_down.weight":
                if int(t.shape[0]) != n_ff:
                    raise UnsupportedModelError(f"{f.path}: {t.name} has shape {list(t.shape)}, not {n_ff} neurons")
            elif k not in _NOT_NEURON and n_ff in [int(s) for s in t.shape]:
                raise UnsupportedModelError(f"{f.path}: do not know how to permute {t.name} by neuron")
    if sorted(layers) != list(range(len(layers))):
        raise UnsupportedModelError(f"{f.path}: FFN layers are not numbered 0..{len(layers) - 1}")
    return len(layers), n_ff, layers


def layer_bytes(f: _gguf.GGUFFile, gpu_neurons) -> list[tuple[int, int]]:
    """Per layer (GPU bytes, CPU bytes) of the FFN weights when placed neurons [0, k_l) are on the GPU
    (in placed order: for a neuron_order file, once gathered): whole gate/up rows, and for down the
    quant blocks along n_ff that hold the first k_l columns (a block that straddles k_l counts on both
    sides)."""
    n_layer, n_ff, layers = ffn_layout(f)
    out = []
    for l, k in enumerate(gpu_neurons):
        k = int(k)
        gpu = cpu = 0
        for name, t in layers[l].items():
            if name in _NEURON_ROWS:
                per = t.n_bytes // n_ff
                gpu += k * per
                cpu += (n_ff - k) * per
            elif name == "ffn_down.weight":
                info = quant.type_info(t.type)
                rows = t.n_bytes // (n_ff // info.block_size * info.type_size)
                blk = rows * info.type_size
                gpu += -(-k // info.block_size) * blk
                cpu += (n_ff // info.block_size - k // info.block_size) * blk
        out.append((gpu, cpu))
    return out


# ---- writing --------------------------------------------------------------------------------------
def _permute_rows(order: np.ndarray):
    def transform(t, data):
        rows = data.reshape(len(order), -1)  # gate/up: (n_ff, row bytes); biases: F32 (n_ff*4,) -> (n_ff, 4)
        return rows[order], t.type, t.shape

    return transform


# Block types whose element j decodes from the block's header and element j's own code alone, so the
# elements of a block can be reordered exactly by moving codes: name -> (header bytes, code layout).
# "i8": one byte per code; "nib": 16 bytes, element j < 16 in the low nibble of byte j, j >= 16 in the
# high nibble of byte j - 16; "nib+qh": a 4-byte bit field (bit j: element j's fifth bit) then "nib".
_CODE_LAYOUT = {"Q8_0": (2, "i8"), "Q4_0": (2, "nib"), "IQ4_NL": (2, "nib"), "Q4_1": (4, "nib"),
                "Q5_0": (2, "nib+qh"), "Q5_1": (4, "nib+qh"), "MXFP4": (1, "nib")}


def _unpack_codes(blocks: np.ndarray, name: str) -> np.ndarray:
    """[..., type_size] block bytes -> [..., 32] codes (uint8) of a _CODE_LAYOUT type."""
    head, layout = _CODE_LAYOUT[name]
    if layout == "i8":
        return blocks[..., head:].copy()
    qs = blocks[..., -16:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    if layout == "nib+qh":
        codes |= np.unpackbits(blocks[..., head:head + 4], axis=-1, bitorder="little") << 4
    return codes


def _pack_codes(blocks: np.ndarray, codes: np.ndarray, name: str) -> np.ndarray:
    """The blocks with their codes replaced (headers kept)."""
    head, layout = _CODE_LAYOUT[name]
    out = blocks.copy()
    if layout == "i8":
        out[..., head:] = codes
        return out
    out[..., -16:] = (codes[..., :16] & 0x0F) | ((codes[..., 16:] & 0x0F) << 4)
    if layout == "nib+qh":
        out[..., head:head + 4] = np.packbits(codes >> 4, axis=-1, bitorder="little")
    return out


def _block_moves(order: np.ndarray, block: int):
    """(stored block of each placed block, in-block order [n_blocks, block] or None when every block
    keeps its order) when each placed block of `block` neurons holds exactly the neurons of one stored
    block; None when the order splits blocks."""
    o = np.asarray(order).reshape(-1, block)
    src = o // block
    if not (src == src[:, :1]).all():
        return None
    inner = o % block
    return src[:, 0], (None if (inner == np.arange(block)).all() else inner)


def down_permutable(type_name: str, block: int, order: np.ndarray) -> bool:
    """Whether a down tensor of this type can be permuted to `order` exactly in its own type."""
    if type_name in _FLOAT_NP:
        return True
    moves = _block_moves(order, block)
    return moves is not None and (moves[1] is None or type_name in _CODE_LAYOUT)


def _permute_down(order: np.ndarray):
    def transform(t, data):
        n_ff = int(t.shape[0])
        if t.type_name in _FLOAT_NP:  # columns move exactly in their own type
            vals = data.view(_FLOAT_NP[t.type_name]).reshape(-1, n_ff)
            return np.ascontiguousarray(vals[:, order]).view(np.uint8), t.type, t.shape
        info = quant.type_info(t.type)
        src, inner = _block_moves(order, info.block_size)
        blocks = data.reshape(-1, n_ff // info.block_size, info.type_size)[:, src, :]  # whole blocks
        if inner is not None:  # then each block's elements, by their codes
            codes = np.take_along_axis(_unpack_codes(blocks, t.type_name), inner[None], axis=-1)
            blocks = _pack_codes(blocks, codes, t.type_name)
        return np.ascontiguousarray(blocks).reshape(data.shape), t.type, t.shape

    return transform


def _check_placement(p, n_layer: int, n_ff: int) -> list[int]:
    k = [int(v) for v in p.gpu_neurons]
    if len(k) != n_layer:
        raise ArgumentError(f"the placement has {len(k)} layers, the model {n_layer}")
    bad = [i for i, v in enumerate(k) if not 0 <= v <= n_ff]
    if bad:
        raise ArgumentError(f"placement: layer {bad[0]} puts {k[bad[0]]} neurons on the GPU, not within 0..{n_ff}")
    if len(p.coverage) != n_layer:
        raise ArgumentError(f"the placement's coverage has {len(p.coverage)} layers, the model {n_layer}")
    return k


def _solution_kv(stats: ActivationStats, placement: Any, n_layer: int) -> dict[str, tuple[Any, VT | None]]:
    """The keys every placement writes: where attention goes, what the solver was given and found, the stats."""
    solver = {"method": placement.method, "status": placement.status, "gap": float(placement.gap),
              "solve_s": float(placement.solve_s)}
    if hasattr(placement, "cpu_only_parts"):  # what est_token_ms assumed (optiml.offline.time_model)
        solver["estimate"] = {"positions": int(placement.positions), "predictors": placement.predictors,
                              "output_on_gpu": bool(placement.output_on_gpu),
                              "cpu_only_ms": float(placement.cpu_only_token_s) * 1000.0,
                              "cpu_only_parts_ms": {k: v * 1000.0 for k, v in placement.cpu_only_parts.items()}}
    P = PREFIX
    return {
        P + "version": (VERSION, VT.UINT32),
        P + "group_size": (int(placement.group), VT.UINT32),
        P + "gpu_attention": (np.asarray(getattr(placement, "gpu_attention", None) or [1] * n_layer, dtype=np.int32),
                              VT.ARRAY),
        P + "coverage": (np.asarray(placement.coverage, dtype=np.float32), VT.ARRAY),
        P + "vram_budget": (int(placement.vram_budget), VT.UINT64),
        P + "vram_used": (int(placement.vram_used), VT.UINT64),
        P + "fixed_bytes": (int(placement.fixed_bytes), VT.UINT64),
        P + "ctx": (int(placement.ctx), VT.UINT32),
        P + "hardware": (jsonout.dumps(placement.hardware, sort_keys=True, default=str), VT.STRING),
        P + "solver": (jsonout.dumps(solver), VT.STRING),
        P + "est_token_ms": (float(placement.est_token_s) * 1000.0, VT.FLOAT32),
        P + "stats.tokens": (int(stats.n_tokens), VT.UINT64),
        P + "stats.sources": (stats.sources or "-", VT.STRING),
        P + "stats.fingerprint": (stats.fingerprint, VT.STRING),
    }


def placement_kv(stats: ActivationStats, placement: Any,
                 neuron_order: np.ndarray | None = None) -> dict[str, tuple[Any, VT | None]]:
    """The optiml.placement.* key/values of a placement and the stats it came from; neuron_order ([n_layer,
    n_ff], placed -> stored) for a file whose weights keep the stored order. placement: the solver's
    optiml.offline.solve.Placement, or anything with its fields (a file format does not import the solver)."""
    n_layer, n_ff = stats.freq.shape
    ranks = curve_ranks(n_ff)
    freq_sorted = -np.sort(-np.asarray(stats.freq, dtype=np.float32), axis=1)
    cov = coverage_curve(stats.freq)
    P = PREFIX
    kv = {
        **_solution_kv(stats, placement, len(placement.gpu_neurons)),
        P + "gpu_neurons": (np.asarray(placement.gpu_neurons, dtype=np.int32), VT.ARRAY),
        P + "curve_ranks": (ranks.astype(np.int32), VT.ARRAY),
        P + "curve_freq": (freq_sorted[:, ranks - 1].reshape(-1).astype(np.float32), VT.ARRAY),
        P + "curve_coverage": (cov[:, ranks - 1].reshape(-1).astype(np.float32), VT.ARRAY),
    }
    if neuron_order is not None:
        kv[P + "neuron_order"] = (np.asarray(neuron_order, dtype=np.int32).reshape(-1), VT.ARRAY)
    return kv


def write_expert_placement(model_path: str | os.PathLike, stats: ActivationStats, placement: Any,
                           out_path: str | os.PathLike, progress: bool = True) -> dict:
    """Writes out_path: the mixture of experts at model_path with the solver's expert placement in
    optiml.placement.* (gpu_experts: each layer's GPU experts hottest first, concatenated; gpu_expert_count:
    how many are each layer's; gpu_attention; gpu_neurons all zero). The weights are copied unchanged.
    Returns {"form": "experts"}."""
    model_path, out_path = os.fspath(model_path), os.fspath(out_path)
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"model file not found: {model_path}")
    check_output(model_path, out_path)
    stats.check_model(model_path)
    experts = [[int(e) for e in ids] for ids in placement.gpu_experts]
    n_layer = len(placement.gpu_neurons)
    if len(experts) != n_layer or len(placement.coverage) != n_layer:
        raise ArgumentError(f"the placement has {len(experts)} expert lists for {n_layer} layers")
    P = PREFIX
    flat = [e for ids in experts for e in ids]
    kv = {
        **_solution_kv(stats, placement, n_layer),
        P + "gpu_neurons": (np.zeros(n_layer, dtype=np.int32), VT.ARRAY),
        P + "gpu_expert_count": (np.asarray([len(ids) for ids in experts], dtype=np.int32), VT.ARRAY),
        P + "gpu_experts": (np.asarray(flat, dtype=np.int32), VT.ARRAY),
    }
    if not flat:  # an empty array has no element type to read back: no experts, no list
        del kv[P + "gpu_experts"], kv[P + "gpu_expert_count"]
    rewrite_gguf(model_path, out_path, set_kv=kv, remove_prefixes=(PREFIX,), progress=progress, desc="placing")
    return {"form": "experts"}


def check_placeable(model_path: str | os.PathLike) -> None:
    """ArgumentError for a file already placed with its weights in the original order (neuron_order): its
    weights are the original's (same fingerprint), so stats measured on either fit, but in which neuron
    order is ambiguous; placing the original says it plainly."""
    with _gguf.open(os.fspath(model_path)) as f:
        if PREFIX + "neuron_order" in f.metadata:
            raise ArgumentError(f"{model_path} is already placed with its weights in the original order "
                                f"({PREFIX}neuron_order); place the original file instead (the same stats fit it)")


def write_placed(model_path: str | os.PathLike, stats: ActivationStats, placement: Any,
                 out_path: str | os.PathLike, progress: bool = True, order: np.ndarray | None = None,
                 order_name: str = "custom") -> dict:
    """Writes out_path: model_path with each layer's FFN neurons in hot-first order (or `order`, [n_layer,
    n_ff]: placed neuron i of layer l is stored neuron order[l, i]; its GPU share must stay a hot prefix
    for the solver's figures to hold; order_name says how it was made, in optiml.placement.order, e.g.
    "coactive") and the placement in
    optiml.placement.* metadata (any previous placement replaced; other keys copied unchanged). The
    neurons are permuted in the file when every layer's down tensor allows it exactly, else the weights
    keep their order and optiml.placement.neuron_order records it (see the module doc); nothing is
    requantized. Returns {"form": "permuted" or "neuron_order", "down_types": {type name: layers}}.
    ArgumentError when the stats are another model's, the placement does not fit the model, the model
    already carries a neuron_order, out_path is model_path or its folder does not exist."""
    model_path, out_path = os.fspath(model_path), os.fspath(out_path)
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"model file not found: {model_path}")
    check_output(model_path, out_path)
    stats.check_model(model_path)

    check_placeable(model_path)
    with _gguf.open(model_path) as f:
        n_layer, n_ff, layers = ffn_layout(f)
    if tuple(stats.freq.shape) != (n_layer, n_ff):
        raise ArgumentError(f"the stats are {stats.freq.shape[0]} layers x {stats.freq.shape[1]} neurons, "
                            f"the model {n_layer} x {n_ff}")
    _check_placement(placement, n_layer, n_ff)

    custom = order
    if order is None:
        order = hot_first_order(stats.freq, stats.impact)
    else:
        try:
            order = np.asarray(order, dtype=np.int64)
        except (ValueError, TypeError):
            order = np.zeros(0, dtype=np.int64)  # ragged or not numbers: refused below
        if order.shape != (n_layer, n_ff) or any(not np.array_equal(np.sort(o), np.arange(n_ff)) for o in order):
            raise ArgumentError(f"the neuron order must hold a permutation of {n_ff} neurons for each of "
                                f"{n_layer} layers")
    downs = [layers[l]["ffn_down.weight"] for l in range(n_layer)]
    down_types: dict[str, int] = {}
    for t in downs:
        down_types[t.type_name] = down_types.get(t.type_name, 0) + 1
    permute = all(down_permutable(t.type_name, quant.type_info(t.type).block_size, order[l])
                  for l, t in enumerate(downs))
    transforms = {}
    if permute:
        for l in range(n_layer):
            for name, t in layers[l].items():
                if name in _NEURON_ROWS:
                    transforms[t.name] = _permute_rows(order[l])
                elif name == "ffn_down.weight":
                    transforms[t.name] = _permute_down(order[l])
    kv = placement_kv(stats, placement, None if permute else order)
    kv[PREFIX + "order"] = ("hot-first" if custom is None else order_name, VT.STRING)
    rewrite_gguf(model_path, out_path, set_kv=kv, remove_prefixes=(PREFIX,), transforms=transforms,
                 progress=progress, desc="placing")
    return {"form": "permuted" if permute else "neuron_order", "down_types": down_types}


# ---- reading --------------------------------------------------------------------------------------
def read_placement(path_or_file) -> dict | None:
    """The optiml.placement.* metadata of a file, parsed: keys are the names after the prefix
    ("gpu_neurons", "stats.tokens", ...); hardware and solver are dicts, curve_freq and curve_coverage
    [L, P] arrays, neuron_order an int32 [L, n_ff] array (placed -> stored). "form" says how the file
    holds the placement: "permuted" (weights in placed order), "neuron_order" (weights in the stored
    order, gathered at load) or "experts" (a mixture of experts: gpu_experts, one list per layer). None when the file has no placement. GGUFError for a neuron_order that is
    not a permutation of each layer's neurons."""
    if isinstance(path_or_file, _gguf.GGUFFile):
        md = path_or_file.metadata
        where = path_or_file.path
    else:
        with _gguf.open(path_or_file) as f:
            md = f.metadata
        where = os.fspath(path_or_file)
    d = {k[len(PREFIX):]: v for k, v in md.items() if k.startswith(PREFIX)}
    if not d:
        return None
    for k in ("hardware", "solver"):
        if k in d:
            try:
                d[k] = json.loads(d[k])
            except (TypeError, ValueError):
                d[k] = {"text": d[k]}
    for k in ("gpu_neurons", "gpu_attention", "curve_ranks", "gpu_expert_count"):
        if k in d:
            d[k] = [int(v) for v in d[k]]
    if "gpu_experts" in d and "gpu_expert_count" in d:  # back to one list per layer (the engine checks them)
        flat, at = [int(v) for v in d["gpu_experts"]], 0
        d["gpu_experts"] = []
        for c in d["gpu_expert_count"]:
            d["gpu_experts"].append(flat[at:at + c])
            at += c
    if "coverage" in d:
        d["coverage"] = [float(v) for v in d["coverage"]]
    n_layer = len(d.get("gpu_neurons", []))
    for k in ("curve_freq", "curve_coverage"):
        if k in d and n_layer:
            d[k] = np.asarray(d[k], dtype=np.float32).reshape(n_layer, -1)
    d["form"] = "experts" if "gpu_experts" in d else "permuted"
    if "neuron_order" in d:
        d["neuron_order"] = _check_neuron_order(d["neuron_order"], n_layer, where)
        d["form"] = "neuron_order"
    return d


def _check_neuron_order(raw, n_layer: int, where: str) -> np.ndarray:
    key = PREFIX + "neuron_order"
    o = np.asarray(raw)
    if o.dtype.kind not in "iu" or n_layer == 0 or o.size % n_layer:
        raise GGUFError(f"{where}: {key} must be {n_layer} layers x n_ff integers, not {o.size} of {o.dtype}")
    o = o.astype(np.int32).reshape(n_layer, -1)
    n_ff = o.shape[1]
    for l in range(n_layer):
        if not np.array_equal(np.sort(o[l]), np.arange(n_ff)):
            raise GGUFError(f"{where}: {key} of layer {l} is not a permutation of 0..{n_ff - 1}")
    return o
