"""The solver's time model: the seconds a decode token spends in each part of the model on the CPU or on the
GPU, from `optiml hw`'s measurements (optiml.offline.hardware.Hardware).

What a decode step reads, part by part, and what it costs here:

    attention   a layer's weights (q, k, v, o, its norms) and the KV cache of `positions` past tokens.
                CPU: the weights at the CPU's dense product rate for their type (Hardware.cpu_dense; the
                plain read bandwidth for a type `optiml hw` did not measure), the KV cache at cpu_bandwidth.
                GPU: everything at gpu_bandwidth, plus ATTENTION_OPS queued ops.
    FFN         a layer's neurons, split by the solver (solve.layer_times): the GPU reads its share densely;
                the CPU's share (neuron_cpu_bytes):
                  without predictors, the row that decides who fires (gate, or up in a FFN without one) of
                  every CPU neuron at the dense rate, then the up row and down column of each firing neuron
                  at the row-sparse rate (Hardware.cpu_sparse);
                  with predictors, the predictor's rows for the CPU's neurons at the dense rate, then gate, up
                  and down of each neuron predicted active at the row-sparse rate. A neuron is predicted
                  active when it fires, and when it does not at the layer's false-positive rate: the
                  predictor file's held-out share predicted active against the stats' firing share.
                A layer whose data crosses between the devices pays Hardware.split_cost.
    output      the final norm and the output matrix. CPU: at their dense rate. GPU: at gpu_bandwidth plus
                OUTPUT_OPS ops and the logits' copy to the host (one small copy's latency, n_vocab floats at
                transfer_bandwidth).

Not counted: the CPU's own per-op work (norms, RoPE, softmax, the thread pool's barriers): small beside a
7B-shaped layer's weights, it dominates layers of SmolLM2's size (tools/bench/time_model.py: 1.15-1.25x the
estimate at 7B shapes, 1.7x at SmolLM2's on 2 threads); the switch of a CPU share's down projection to the
dense kernel when most of its neurons fire (counted as row-sparse reads); and sparsity="auto"'s speed probe,
which may run a small model's calibrated FFN dense on a machine where that is faster (the file's sparsity is
timed as it is).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .._core import ArgumentError
from ..formats import gguf
from ..formats import predictors as predictor_file
from ..formats.quant import type_info
from .hardware import Hardware

__all__ = ["ATTENTION_OPS", "OUTPUT_OPS", "FixedTimes", "PredictorCosts", "dense_seconds", "ffn_mode", "fixed_layout",
           "fixed_times", "neuron_cpu_bytes", "dense_down_seconds", "predictor_costs", "predictor_seconds"]

# Ops a device queues for one layer's attention (norm with the 8-bit input, q/k/v, RoPE with the KV write,
# the scores, o with the residual add) and for the logits (norm, output matrix): the CUDA backend's fused plan.
ATTENTION_OPS = 5
OUTPUT_OPS = 2


def dense_seconds(hw: Hardware, by_type: dict) -> float:
    """Seconds for the CPU to read weights of these types ({type name: bytes}) with its dense products."""
    return sum(b / hw.cpu_dense.get(t.lower(), hw.cpu_bandwidth) for t, b in by_type.items())


def fixed_layout(tensors: dict, md: dict, arch: str, n_layer: int, is_ffn) -> dict:
    """What is not placed group by group, from a GGUF's tensors: weights_fixed (every tensor but the FFN's,
    is_ffn(name), and the token embeddings, which are counted as the output matrix when the model ties them),
    attn (per layer the bytes that go with its attention), attn_types (per layer {type: bytes}),
    output_types ({type: bytes} of the rest of weights_fixed: output matrix, final norm), kv_per_position
    (per layer, f16 K and V of one position), n_vocab."""
    has_output = "output.weight" in tensors
    fixed = {n: t for n, t in tensors.items()
             if not is_ffn(n) and not (n == "token_embd.weight" and has_output)}
    attn = [0] * n_layer
    attn_types = [{} for _ in range(n_layer)]
    output_types = {}
    for n, t in fixed.items():
        name = type_info(t.type).name
        parts = n.split(".")
        into = attn_types[int(parts[1])] if parts[0] == "blk" else output_types
        into[name] = into.get(name, 0) + t.n_bytes
        if parts[0] == "blk":
            attn[int(parts[1])] += t.n_bytes
    n_embd = int(md.get(f"{arch}.embedding_length", 0) or 0)
    n_head = int(md.get(f"{arch}.attention.head_count", 0) or 0)
    n_head_kv = int(md.get(f"{arch}.attention.head_count_kv", n_head) or n_head)
    head_dim = n_embd // n_head if n_head else 0
    k_len = int(md.get(f"{arch}.attention.key_length", head_dim) or head_dim)
    v_len = int(md.get(f"{arch}.attention.value_length", head_dim) or head_dim)
    out = tensors.get("output.weight", tensors.get("token_embd.weight"))
    n_vocab = int(out.shape[1]) if out is not None and len(out.shape) > 1 else 0
    return dict(weights_fixed=sum(t.n_bytes for t in fixed.values()), attn=attn, attn_types=attn_types,
                output_types=output_types, kv_per_position=n_head_kv * (k_len + v_len) * 2, n_vocab=n_vocab,
                n_head=n_head, n_head_kv=n_head_kv, k_len=k_len, n_embd=n_embd)


@dataclass
class FixedTimes:
    attn_gpu_s: list[float]  # per layer: its attention on the GPU
    attn_cpu_s: list[float]  # on the CPU
    output_gpu_s: float      # the final norm, output matrix and logits' copy, with the output on the GPU
    output_cpu_s: float
    output_bytes: int        # what the output takes on the device (plan.cpp output_bytes: weights, logits rows)
    crossing_s: float = 0.0  # the residual stream (n_embd floats) copied between the devices once

    def estimate(self, ffn_s: float, attention: list[bool], output_on_gpu: bool) -> float:
        """A token's seconds: the FFN's (the solver's objective) plus every layer's attention where it runs and
        the output where it runs."""
        return (ffn_s + sum(g if on else c for g, c, on in zip(self.attn_gpu_s, self.attn_cpu_s, attention))
                + (self.output_gpu_s if output_on_gpu else self.output_cpu_s))

    def cpu_parts(self, ffn_s: float) -> dict:
        """Everything on the CPU, by part (seconds): what `optiml bench --timeline` shows per kind of op."""
        return {"attention": sum(self.attn_cpu_s), "ffn": ffn_s, "output": self.output_cpu_s}


def fixed_times(lay: dict, hw: Hardware, positions: int, logits_rows: int) -> FixedTimes:
    """The fixed part's times (lay: fixed_layout's dict) for a step that attends to `positions` past tokens;
    logits_rows: the rows of logits the device holds (plan.cpp: min(n_batch, 64))."""
    kv = lay["kv_per_position"] * positions
    op = hw.op_cost
    attn_gpu = [(a + kv) / hw.gpu_bandwidth + ATTENTION_OPS * op for a in lay["attn"]]
    attn_cpu = [dense_seconds(hw, types) + kv / hw.cpu_bandwidth for types in lay["attn_types"]]
    out_w = sum(lay["output_types"].values())
    logits = 4 * lay["n_vocab"]
    out_gpu = (out_w / hw.gpu_bandwidth + OUTPUT_OPS * op + hw.transfer_latency / 2
               + logits / hw.transfer_bandwidth)
    return FixedTimes(attn_gpu_s=attn_gpu, attn_cpu_s=attn_cpu, output_gpu_s=out_gpu,
                      output_cpu_s=dense_seconds(hw, lay["output_types"]),
                      output_bytes=out_w + logits * int(logits_rows),
                      crossing_s=hw.transfer_latency / 2 + 4 * lay["n_embd"] / hw.transfer_bandwidth)


@dataclass
class PredictorCosts:
    """What a layer's predictor adds to the CPU's FFN share: its bytes, read whenever the CPU keeps any of
    the layer's neurons (it scores all of them), and its false positives."""
    layer_bytes: list[int]     # per layer: A, B and B's bias
    row_type: str              # their tensor type (Q8_0 or F16)
    false_positive: list[float]  # per layer: the share of non-firing (token, neuron) pairs predicted active


def predictor_seconds(pred: PredictorCosts, layer: int, hw: Hardware) -> float:
    """Seconds a layer's predictor takes on the CPU (its products at the dense rate for their type)."""
    return dense_seconds(hw, {pred.row_type: pred.layer_bytes[layer]})


def predictor_costs(path: str | os.PathLike, model_path: str, stats) -> PredictorCosts:
    """A predictor file's costs for the CPU's share (checked to be trained for model_path)."""
    meta = predictor_file.check_predictors(path, model_path)
    predicted = meta.get("optiml.predictor.heldout_predicted")
    n_layer, n_ff = np.asarray(stats.freq).shape
    if predicted is None or len(predicted) != n_layer:
        raise ArgumentError(f"{path}: no held-out predicted share per layer (optiml.predictor.heldout_predicted); "
                            "train the predictors again with this version of optiml train-predictors")
    sizes, types = [0] * n_layer, set()
    with gguf.open(path) as f:
        for t in f.tensors:
            parts = t.name.split(".")
            if parts[0] == "blk" and parts[2] in ("ffn_pred_a", "ffn_pred_b") and int(parts[1]) < n_layer:
                sizes[int(parts[1])] += t.n_bytes
                if len(t.shape) > 1:
                    types.add(type_info(t.type).name)
    active = np.asarray(stats.freq, dtype=np.float64).mean(axis=1)
    fp = [float(np.clip((p - a) / (1 - a), 0, 1)) if a < 1 else 0.0 for p, a in zip(predicted, active)]
    return PredictorCosts(layer_bytes=sizes, row_type=max(types) if types else "Q8_0", false_positive=fp)


def ffn_mode(stats_activation: str, metadata: dict, predictors: bool = False) -> str:
    """How the engine runs a model's FFN on the CPU by default: "gate" (act(gate) decides who fires: ReLU's
    exact zeros, or calibrated thresholds on the gate, which a file from before the criterion was recorded
    uses), "product" (calibrated thresholds on act(gate) * up, optiml calibrate's default; also a FFN without
    thresholds that runs with predictors: the product of the predicted neurons, none skipped after them) or
    "dense" (no thresholds and not ReLU-family: every neuron is computed)."""
    criterion = metadata.get("optiml.sparsity.criterion")
    if criterion in ("gate", "product"):
        return str(criterion)
    if "optiml.sparsity.threshold" in metadata or stats_activation in ("relu", "relu2"):
        return "gate"
    return "product" if predictors else "dense"


def dense_down_seconds(v: dict, hw: Hardware) -> float:
    """A dense FFN's down product on the CPU: the whole matrix whenever the CPU keeps any of the layer's
    neurons (a split computes the device's gate and up there and the whole down product here, in the unsplit
    order: Session::ffn_split_exact). v: the layer's FFN layout."""
    return dense_seconds(hw, {v["down_type"]: v["down"] * v["n_ff"]})


def neuron_cpu_bytes(sorted_freq: np.ndarray, group: int, v: dict, mode: str, hw: Hardware, ffn_hw: Hardware,
                     pred: PredictorCosts | None = None, layer: int = 0) -> np.ndarray:
    """One layer's CPU cost per group of `group` neurons in hot-first order (sorted_freq: their firing rates),
    as bytes at the row-sparse rate (ffn_hw.cpu_bandwidth, what solve.layer_times divides by). v: the layer's
    FFN layout (solve._model_layout: per neuron the bytes of its gate row, up row and down column, and their
    types, and down_row: its row in the neuron-major 8-bit copy of down that the sparse FFN sums; a FFN
    without a gate decides on up). mode: ffn_mode's. Non-increasing in hot-first order."""
    f = np.asarray(sorted_freq, dtype=np.float64)
    n = len(f)
    starts = np.arange(0, n, group)
    sizes = np.diff(np.append(starts, n)).astype(np.float64)
    fires = np.add.reduceat(f, starts) if n else np.zeros(0)
    sparse = ffn_hw.cpu_bandwidth

    def dense(nbytes, type_name):  # bytes a dense product reads, as bytes at the row-sparse rate
        return nbytes * sparse / hw.cpu_dense.get(type_name.lower(), hw.cpu_bandwidth)

    gate, up = v["gate_row"], v["up_row"]
    if not gate:  # the up row decides
        v = {**v, "gate_type": v["up_type"]}
        gate, up = up, 0.0
    if mode == "dense":  # (down: the whole matrix whenever the CPU keeps a neuron, dense_down_seconds)
        return sizes * (dense(gate, v["gate_type"]) + dense(up, v["up_type"]))
    # The sparse FFN sums a firing neuron's row of the neuron-major copy, at its own measured rate.
    down = v["down_row"] * (sparse / hw.cpu_sparse_down if hw.cpu_sparse_down > 0 else 1.0)
    decided_first = gate if mode == "gate" else gate + up  # computed before the criterion
    after = down + (up if mode == "gate" else 0.0)         # read for the neurons the criterion keeps
    if pred is None:
        first = sizes * (dense(gate, v["gate_type"]) + (dense(up, v["up_type"]) if mode == "product" else 0.0))
    else:  # (the predictor's own reads: predictor_seconds, once per layer)
        first = (fires + pred.false_positive[layer] * (sizes - fires)) * decided_first
    return first + fires * after
