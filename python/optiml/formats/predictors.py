"""The companion predictor GGUF of `optiml train-predictors`: its metadata, the check that it was trained for
a model, and writing it.

    MODEL.predictors.gguf        beside MODEL.gguf (default_predictor_path): where a Model looks by itself

Per layer l it holds the low-rank predictor blk.l.ffn_pred_a.weight [rank x n_embd], blk.l.ffn_pred_b.weight
[n_ff x rank] and blk.l.ffn_pred_b.bias [n_ff] (Q8_0, or F16 when n_embd is not a multiple of 32), and the
metadata optiml.predictor.*: the decision threshold and rank per layer, what training measured on held-out
tokens, and the model's fingerprint (optiml.formats.stats.model_fingerprint: tensor layout and FFN bytes).
A file for another model, or for a model whose neurons were since permuted, is refused with
PredictorMismatchError.
"""

from __future__ import annotations

import os

import numpy as np

from .._core import ArgumentError, GGUFError
from ..util.atomic import atomic_output
from . import gguf, quant
from .stats import model_fingerprint

__all__ = ["ARCH", "PredictorMismatchError", "check_predictors", "default_predictor_path", "predicted_share", "write"]

ARCH = "optiml-predictor"


class PredictorMismatchError(ArgumentError):
    """A predictor file made for another model (or another neuron order of this one)."""


def default_predictor_path(model_path: str | os.PathLike) -> str:
    """MODEL.predictors.gguf beside MODEL.gguf: where a Model looks for its predictors by itself."""
    p = os.fspath(model_path)
    base = p[:-5] if p.endswith(".gguf") else p
    return base + ".predictors.gguf"


def check_predictors(pred_path: str | os.PathLike, model_path: str | os.PathLike, activation: str | None = None) -> dict:
    """The predictor file's metadata, after checking it was trained for this model (PredictorMismatchError
    otherwise; FileNotFoundError when it is missing, ArgumentError when it is not a predictor file)."""
    pred_path = os.fspath(pred_path)
    if os.path.isdir(pred_path):
        raise ArgumentError(f"{pred_path} is a folder: give the predictor file (optiml train-predictors writes one)")
    if not os.path.isfile(pred_path):
        raise FileNotFoundError(f"predictor file not found: {pred_path}")
    try:
        with gguf.open(pred_path) as f:
            meta = dict(f.metadata)
    except GGUFError as e:  # a file given by name that is not one: bad input, as the check below says
        raise ArgumentError(f"{pred_path}: not a predictor file ({str(e).removeprefix(pred_path + ': ')}); make one "
                            "with `optiml train-predictors`") from None
    if "optiml.predictor.model_fingerprint" not in meta:
        raise ArgumentError(f"{pred_path}: not a predictor file (no optiml.predictor.model_fingerprint); "
                            "make one with `optiml train-predictors`")
    want = str(meta["optiml.predictor.model_fingerprint"])
    have = model_fingerprint(model_path)
    if want != have:
        raise PredictorMismatchError(
            f"{pred_path} was trained for another model ({meta.get('optiml.predictor.model', '?')}, fingerprint "
            f"{want}); {os.path.basename(os.fspath(model_path))} has fingerprint {have}. Train predictors for this "
            "model with `optiml train-predictors`")
    trained_act = meta.get("optiml.predictor.activation")
    if activation is not None and trained_act is not None and str(trained_act) != activation:
        raise PredictorMismatchError(
            f"{pred_path} was trained for another model: its FFN activation was {trained_act}, this model's is "
            f"{activation}. Train predictors for this model with `optiml train-predictors`")
    return meta


def predicted_share(meta: dict) -> float | None:
    """The mean share of neurons a predictor file (check_predictors' metadata) marked active on held-out
    tokens; None when the file does not say."""
    share = meta.get("optiml.predictor.heldout_predicted")
    return float(np.mean(share)) if share is not None and len(share) else None


def write(out: str, layers, res, model_path: str, fingerprint: str, hp: dict) -> None:
    """The companion GGUF, written to a temporary file and renamed (util.atomic). layers: per layer (A, B,
    bias); res: what training found (optiml.offline.predictors.PredictorTraining); hp: the model's
    hyperparameters."""
    import gguf as gg  # gguf-py's writer: about 0.1 s to import, which a program that only reads files skips

    with atomic_output(out) as tmp:  # (the file appears whole or not at all, as every file OptiML writes)
        w = gg.GGUFWriter(tmp, ARCH)
        try:
            w.add_string("optiml.predictor.model_fingerprint", fingerprint)
            w.add_string("optiml.predictor.model", os.path.basename(model_path))
            w.add_string("optiml.predictor.activation", hp["ffn_act"])
            w.add_array("optiml.predictor.threshold", [float(x) for x in res.threshold])
            w.add_array("optiml.predictor.rank", [int(x) for x in res.rank])
            w.add_array("optiml.predictor.label_threshold", [float(x) for x in res.label_threshold])
            w.add_array("optiml.predictor.heldout_recall", [float(x) for x in res.recall])
            w.add_array("optiml.predictor.heldout_predicted", [float(x) for x in res.predicted])
            w.add_float32("optiml.predictor.recall_target", float(res.recall_target))
            w.add_uint32("optiml.predictor.samples", int(res.n_samples))
            for l, (A, B, bias) in enumerate(layers):
                for name, m in (("a", A), ("b", B)):
                    if res.qtype == "q8_0":
                        w.add_tensor(f"blk.{l}.ffn_pred_{name}.weight", quant.quantize(m, "Q8_0"),
                                     raw_dtype=gg.GGMLQuantizationType.Q8_0)
                    else:
                        w.add_tensor(f"blk.{l}.ffn_pred_{name}.weight", m.astype(np.float16))
                w.add_tensor(f"blk.{l}.ffn_pred_b.bias", bias.astype(np.float32))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
