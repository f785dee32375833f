"""GptOssForCausalLM (OpenAI's gpt-oss) to llama.cpp's gpt-oss layout: attention with biases and one sink
logit per head, a sliding window on the even layers, YaRN RoPE, and experts with biases behind a biased
router. The experts come in one of two forms:

- fused float tensors, as transformers' save_pretrained writes them: gate_up_proj [E, in, 2F] with the
  gate and up columns interleaved (gate at even, up at odd), down_proj [E, F, out], both (in, out);
- OpenAI's MXFP4 (the released checkpoints): gate_up_proj_blocks [E, 2F, in/32, 16] and _scales
  [E, 2F, in/32] (uint8), down_proj_blocks / _scales likewise. These are copied into GGUF MXFP4 blocks
  without rounding, whatever the output type (as llama.cpp's converter does): each block's nibbles are
  reordered, its E8M0 scale byte kept.
"""

from __future__ import annotations

import numpy as np

from .common import TensorPlan, get_value
from .errors import ConvertError

GPT_OSS = "GptOssForCausalLM"
# The clamped SwiGLU's constants: llama.cpp (and OptiML's kernels) fix them to the released models' values.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
MXFP4 = 39  # ggml's type id
# gate_up's gate and up halves: the even and the odd of its 2F outputs
HALVES = (("gate", slice(0, None, 2)), ("up", slice(1, None, 2)))


def read_config(cfg: dict, path: str, rope: dict) -> dict:
    """The gpt-oss fields of ModelConfig, refused where llama.cpp's gpt-oss graph computes otherwise."""
    n_expert = get_value(cfg, path, "num_local_experts", kind=int)
    used = get_value(cfg, path, "num_experts_per_tok", kind=int)
    if used > n_expert:
        raise ConvertError(f"{path}: num_experts_per_tok = {used} is more than the {n_expert} experts "
                           "(num_local_experts)")
    for key, want in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        if cfg.get(key, want) != want:
            raise ConvertError(f"{path}: {key} = {cfg[key]!r} is not supported (llama.cpp's gpt-oss fixes it "
                               f"to {want})")
    if cfg.get("attention_bias", True) is not True:
        raise ConvertError(f"{path}: attention_bias = false is not supported (gpt-oss's attention has biases)")
    n_layer = get_value(cfg, path, "num_hidden_layers", kind=int)
    window = get_value(cfg, path, "sliding_window", kind=int)
    want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    if cfg.get("layer_types", want) != want:
        raise ConvertError(f"{path}: layer_types is not sliding_attention on even layers and full_attention on "
                           "odd ones (llama.cpp's gpt-oss)")
    if rope.get("rope_type") != "yarn":
        raise ConvertError(f"{path}: gpt-oss needs YaRN RoPE scaling (rope_type 'yarn'), not "
                           f"{rope.get('rope_type')!r}")
    get_value(rope, path, "factor", kind=float)
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if rope.get(key) is not None:
            raise ConvertError(f"{path}: YaRN {key} is not supported for gpt-oss (llama.cpp's attention factor "
                               "is 1 + 0.1 ln(factor))")
    return {"n_expert": n_expert, "n_expert_used": used, "n_ff_exp": get_value(cfg, path, "intermediate_size",
                                                                              kind=int), "n_swa": window}


def yarn_kv(c) -> list[tuple[str, str, object]]:
    """YaRN as llama.cpp's gpt-oss converter writes it, plus beta_fast/beta_slow where they differ from
    llama.cpp's defaults (32, 1). transformers' truncate = false (the released config's) leaves the
    correction range unrounded; llama.cpp, and OptiML on a GGUF, always round it (floor, ceil): logits
    differ by a few 1e-4 relative."""
    r, a = c.rope_scaling, c.arch
    kv = [("str", f"{a}.rope.scaling.type", "yarn"), ("f32", f"{a}.rope.scaling.factor", float(r["factor"])),
          ("u32", f"{a}.rope.scaling.original_context_length", int(r.get("original_max_position_embeddings", 4096)))]
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        if float(r.get(key, default)) != default:
            kv.append(("f32", f"{a}.rope.scaling.yarn_{key}", float(r[key])))
    return kv


def ffn_plan(c, i: int, available: set) -> list[TensorPlan]:
    """Layer i's router and experts, from either form (see the module's docstring)."""
    p, b = f"model.layers.{i}.mlp.", f"blk.{i}."
    E, D, F = c.n_expert, c.n_embd, c.n_ff_exp
    plan = [TensorPlan(b + "ffn_gate_inp.weight", p + "router.weight", (E, D)),
            TensorPlan(b + "ffn_gate_inp.bias", p + "router.bias", (E,))]
    x = p + "experts."
    if x + "gate_up_proj_blocks" in available:
        for which, rows in HALVES:
            plan.append(_mxfp4(f"{b}ffn_{which}_exps.weight", x + "gate_up_proj", (E, 2 * F, D), rows))
        plan.append(_mxfp4(b + "ffn_down_exps.weight", x + "down_proj", (E, D, F), slice(None)))
    else:
        for which, cols in HALVES:
            plan.append(TensorPlan(f"{b}ffn_{which}_exps.weight", x + "gate_up_proj", (E, D, 2 * F),
                                   out_shape=(E, F, D), build=_fused_gate_up(cols)))
        plan.append(TensorPlan(b + "ffn_down_exps.weight", x + "down_proj", (E, F, D), out_shape=(E, D, F),
                               build=lambda t: np.ascontiguousarray(t[0].transpose(0, 2, 1))))
    for which, sl in HALVES:
        plan.append(TensorPlan(f"{b}ffn_{which}_exps.bias", x + "gate_up_proj_bias", (E, 2 * F), out_shape=(E, F),
                               build=lambda t, sl=sl: np.ascontiguousarray(t[0][:, sl])))
    plan.append(TensorPlan(b + "ffn_down_exps.bias", x + "down_proj_bias", (E, D)))
    return plan


def _fused_gate_up(cols: slice):
    # [E, in, 2F] (in, out) -> the gate's or the up's [E, F, in] (rows, row length)
    return lambda t: np.ascontiguousarray(t[0][:, :, cols].transpose(0, 2, 1))


def _mxfp4(name: str, src: str, shape: tuple, rows: slice) -> TensorPlan:
    """A GGUF MXFP4 expert tensor from OpenAI's blocks and scales of `shape` [E, rows, row length]."""
    E, R, K = shape
    if K % 32:
        raise ConvertError(f"{src}_blocks: a row of {K} does not split into MXFP4 blocks of 32")
    n_rows = len(range(R)[rows])
    return TensorPlan(name, src + "_blocks", (E, R, K // 32, 16), out_shape=(E, n_rows, K), raw=MXFP4,
                      inputs=((src + "_scales", (E, R, K // 32)),),
                      build=lambda t: mxfp4_blocks(t[0][:, rows], t[1][:, rows]))


def mxfp4_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 ([..., n_blocks, 16] bytes holding element 2j in the low nibble of byte j and 2j+1
    in its high one; [..., n_blocks] E8M0 scales) as ggml's block_mxfp4 rows ([..., n_blocks * 17] bytes:
    the scale, then byte j holding element j low and element j + 16 high). Both store the same 4-bit
    code (sign, then the E2M1 magnitude index) and the same biased exponent, so nothing is rounded."""
    codes = np.empty(blocks.shape[:-1] + (32,), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    out = np.empty(blocks.shape[:-1] + (17,), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(*blocks.shape[:-2], -1)
