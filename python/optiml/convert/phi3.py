"""Phi3ForCausalLM (Phi-3, Phi-3.5 and Phi-4-mini) to llama.cpp's phi3 layout: q, k and v in one matrix
(attn_qkv) and gate and up in one (ffn_up, the gate's rows first), both copied as the checkpoint fuses them;
a rotation over part of each head (Phi-4-mini: 3/4); LongRoPE's two lists of frequency divisors
(rope_factors_long/short, the long one for a context past the original) and its cos/sin factor.

llama.cpp's phi3 graph attends to every position (it reads sliding_window and leaves it out): a window shorter
than max_position_embeddings becomes the file's context_length, as for Mistral (hf_config)."""

from __future__ import annotations

import math

import numpy as np

from .common import TensorPlan, get_value
from .errors import ConvertError

PHI3 = "Phi3ForCausalLM"


def read_config(cfg: dict, path: str, rope: dict, n_embd: int, n_head: int) -> dict:
    """The phi3 fields of ModelConfig, refused where llama.cpp's converter and graph compute otherwise."""
    rot_pct = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if isinstance(rot_pct, bool) or not isinstance(rot_pct, (int, float)) or not 0 < rot_pct <= 1:
        raise ConvertError(f"{path}: partial_rotary_factor = {rot_pct!r} is not in (0, 1]")
    n_rot = int(rot_pct * n_embd) // n_head
    if n_rot < 2 or n_rot % 2:
        raise ConvertError(f"{path}: partial_rotary_factor {rot_pct} turns {n_rot} values of each head; an even "
                           "number from 2 is needed")
    max_pos = get_value(cfg, path, "max_position_embeddings", kind=int)
    orig = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos))
    orig = get_value({"original_max_position_embeddings": orig}, path, "original_max_position_embeddings", kind=int)
    out = {"n_rot": n_rot, "n_ctx_orig": orig, "n_swa": cfg.get("sliding_window") or 0}
    kind = str(rope.get("rope_type", "default")).lower()
    if kind == "default":
        return out
    if kind not in ("longrope", "su"):
        raise ConvertError(f"{path}: rope scaling {kind!r} is not supported for Phi-3 (default, longrope)")
    factors = []
    for key in ("long_factor", "short_factor"):
        v = rope.get(key)
        if not isinstance(v, list) or len(v) != n_rot // 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v):
            raise ConvertError(f"{path}: rope scaling {key} must be {n_rot // 2} positive numbers (one per pair of "
                               "rotated values)")
        factors.append(np.asarray(v, np.float32))
    scale = max_pos / orig
    if rope.get("factor") is not None and not math.isclose(float(rope["factor"]), scale, rel_tol=1e-6):
        raise ConvertError(f"{path}: rope scaling factor {rope['factor']} is not max_position_embeddings / "
                           f"original_max_position_embeddings = {scale:.6g}, the factor llama.cpp computes with")
    attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    given = rope.get("attention_factor")
    if given is not None and not math.isclose(float(given), attn_factor, rel_tol=1e-6):
        raise ConvertError(f"{path}: rope scaling attention_factor {given} is not supported (llama.cpp computes "
                           f"{attn_factor:.6g} from the two context lengths)")
    return dict(out, rope_long=factors[0], rope_short=factors[1], rope_attn_factor=attn_factor)


def hparams_kv(c) -> list[tuple[str, str, object]]:
    """What llama.cpp's Phi3MiniModel writes beyond the common keys."""
    a = c.arch
    kv = [("u32", f"{a}.rope.scaling.original_context_length", c.n_ctx_orig),
          ("u32", f"{a}.attention.sliding_window", c.n_swa)]
    if c.rope_long is not None:
        kv.append(("f32", f"{a}.rope.scaling.attn_factor", c.rope_attn_factor))
    return kv


def extra_tensors(c) -> list[tuple[str, np.ndarray]]:
    """LongRoPE's divisors (written first, as llama.cpp's converter does)."""
    if c.rope_long is None:
        return []
    return [("rope_factors_long.weight", c.rope_long), ("rope_factors_short.weight", c.rope_short)]


def layer_plan(c, i: int) -> list[TensorPlan]:
    p, b = f"model.layers.{i}.", f"blk.{i}."
    qkv = (c.n_head + 2 * c.n_head_kv) * c.head_dim
    return [
        TensorPlan(b + "attn_norm.weight", p + "input_layernorm.weight", (c.n_embd,)),
        TensorPlan(b + "attn_qkv.weight", p + "self_attn.qkv_proj.weight", (qkv, c.n_embd)),
        TensorPlan(b + "attn_output.weight", p + "self_attn.o_proj.weight", (c.n_embd, c.n_head * c.head_dim)),
        TensorPlan(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (c.n_embd,)),
        TensorPlan(b + "ffn_up.weight", p + "mlp.gate_up_proj.weight", (2 * c.n_ff, c.n_embd)),
        TensorPlan(b + "ffn_down.weight", p + "mlp.down_proj.weight", (c.n_embd, c.n_ff)),
    ]
