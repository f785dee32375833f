"""What a Model made with the defaults (sparsity="auto", predictors="auto", device="auto") picks up besides the
weights, and why, without loading the weights: `optiml info` shows it.

    from optiml.engine.companions import companions
    c = companions("SmolLM2.gguf")
    c["predictors"]["used"], c["predictors"]["why"]     # MODEL.predictors.gguf beside the file
    c["sparsity"]["mode"], c["placement"]["used"], [f["path"] for f in c["files"]]

Companion files are looked for beside the model: MODEL.predictors.gguf (optiml train-predictors; a Model
uses it by itself, see sparsity.beside) and MODEL.stats.npz (optiml profile; read by solve, calibrate and
info --plot when named, never by a running model). The calibrated thresholds and the placement live in the
model file itself.
"""

from __future__ import annotations

import os

from .. import _core
from .._core import OptimlError
from ..formats import gguf as _gguf
from ..formats.placement import read_placement
from . import plan, speed_probe
from .sparsity import beside, choose_mode

__all__ = ["companions"]


def _sparsity(native, path: str) -> dict:
    """The mode sparsity="auto" picks, and why."""
    hp, cfg = native.hparams, native.sparsity
    mode = choose_mode("auto", None, None, cfg, hp, path)[0]
    why = {"calibrated": f"the file carries calibrated thresholds (optiml calibrate, criterion {cfg['criterion']})",
           "exact": f"its FFN is ReLU-family ({hp['ffn_act']}): exact zero-skipping, the dense result",
           "none": f"no calibrated thresholds in the file and its FFN ({hp['ffn_act']}) is not ReLU-family: dense "
                   "(optiml calibrate adds thresholds)"}[mode]
    if mode != "none":
        why += ("; kept only where a step is faster than with the dense FFN on this machine (timed once at the first "
                f"load, cached in {speed_probe.cache_path()}; Model.sparsity_note tells)")
    return {"mode": mode, "why": why, "activation": hp["ffn_act"], "calibrated": bool(cfg["calibrated"])}


def _predictors(path: str, activation: str) -> dict:
    """sparsity.beside without the metadata; a file trained for another model is reported, not raised."""
    try:
        d = beside(path, activation)
    except OptimlError as e:
        from ..formats.predictors import default_predictor_path

        return {"path": default_predictor_path(path), "found": True, "used": False, "predicted_share": None,
                "break_even": None, "why": f"{e} (a Model with predictors='auto' refuses to load: pass "
                                           "predictors=None, --predictors none)"}
    d.pop("meta")
    return d


def _placement(path: str, predictors_used: bool) -> dict:
    """Whether the file has a placement (optiml solve) and whether the default device uses it; on the CPU,
    whether its neuron order is read there (a kept-order file with an order other than hot-first, with
    predictors: Session::reads_placed_copies)."""
    pl = read_placement(path)
    if pl is None:
        return {"in_file": False, "used": False, "why": "no placement in the file (optiml solve writes one)"}
    try:
        p = plan.make(path)
    except OptimlError as e:
        return {"in_file": True, "used": False, "why": f"the default plan cannot be made: {e}"}
    if p.device == "cpu" and pl["form"] == "neuron_order" and pl.get("order", "hot-first") != "hot-first":
        if not predictors_used:
            why = (f"the default device runs every layer on the CPU, which reads the file's {pl['order']} neuron "
                   "order only with predictors (none are used)")
            return {"in_file": True, "used": False, "why": why, "gpu_neurons": sum(pl["gpu_neurons"])}
        with _gguf.open(path) as f:
            copy = sum(t.n_bytes for t in f.tensors if t.name.endswith(("ffn_gate.weight", "ffn_up.weight")))
        why = (f"the default device runs every layer on the CPU, and with the predictors a step reads the FFN's "
               f"rows in the file's {pl['order']} order: its gate and up rows from a copy made at load "
               f"({copy / 2**20:.1f} MiB), down's rows neuron-major in that order (Model.placed_copy_info() "
               "says what a loaded model holds)")
        return {"in_file": True, "used": True, "why": why, "gpu_neurons": sum(pl["gpu_neurons"]),
                "copy_bytes": copy}
    if p.device == "cpu":
        why = (f"the default device runs every layer on the CPU ({p.reason}); the placement is used with "
               "--device cuda (device='cuda') within --vram")
        return {"in_file": True, "used": False, "why": why, "gpu_neurons": sum(pl["gpu_neurons"])}
    return {"in_file": True, "used": True, "why": f"the default device is {p.device}: its FFN neurons follow the "
            "placement within the budget", "gpu_neurons": sum(pl["gpu_neurons"])}


def _stats_file(path: str) -> dict | None:
    stats = (path[:-5] if path.endswith(".gguf") else path) + ".stats.npz"
    if not os.path.isfile(stats):
        return None
    return {"path": stats, "kind": "activation statistics (optiml profile)", "used": False,
            "why": "read when named (optiml solve --stats, calibrate --stats, info --plot --stats), never by a "
                   "running model"}


def companions(path: str | os.PathLike) -> dict:
    """sparsity (the mode sparsity="auto" picks: mode, why, activation, calibrated), predictors (the file
    predictors="auto" looks for: path, found, used, why, predicted_share, break_even), placement (in_file,
    used, why) and files (each companion file found beside the model: path, kind, used, why). OptimlError
    when the engine cannot run the file."""
    path = os.fspath(path)
    native = _core.Model(os.fsencode(path))
    out = {"sparsity": _sparsity(native, path), "predictors": _predictors(path, native.hparams["ffn_act"])}
    out["placement"] = _placement(path, bool(out["predictors"]["used"]))
    out["files"] = []
    pred = out["predictors"]
    if pred["found"]:
        out["files"].append({"path": pred["path"], "kind": "activation predictors (optiml train-predictors)",
                             "used": pred["used"], "why": pred["why"]})
    stats = _stats_file(path)
    if stats:
        out["files"].append(stats)
    return out
