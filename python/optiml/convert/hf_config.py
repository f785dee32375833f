"""config.json -> what the GGUF says: the architecture, `{arch}.*` hyper-parameters (llama.cpp's keys)
and the expected shape of every weight, so a checkpoint that disagrees with its config is refused."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .errors import ConvertError

# HF class -> (GGUF architecture, permute q/k rows). llama.cpp writes Mistral as "llama" and permutes
# it like llama; Qwen2 uses NeoX rotation, which matches HF's layout, so no permutation.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
}
SUPPORTED = ", ".join(ARCHITECTURES)


@dataclass
class ModelConfig:
    hf_arch: str
    arch: str  # GGUF general.architecture
    permute_qk: bool
    n_vocab: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    activation: str = "silu"
    tie_embeddings: bool = False
    raw: dict = field(default_factory=dict)

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv


def _get(cfg: dict, path: str, key: str, default=None, kind=None):
    v = cfg.get(key, default)
    if v is None:
        raise ConvertError(f"{path}: {key} is missing")
    if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise ConvertError(f"{path}: {key} = {v!r} is not a positive integer")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        raise ConvertError(f"{path}: {key} = {v!r} is not a positive number")
    return v


def load_config(folder: str) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{path}: missing (is {folder} a Hugging Face model folder?)") from None
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: not a JSON object")
    archs = cfg.get("architectures") or []
    hf_arch = next((a for a in archs if a in ARCHITECTURES), None)
    if hf_arch is None:
        raise ConvertError(f"{path}: architecture {', '.join(map(str, archs)) or '(none given)'} is not "
                           f"supported; supported: {SUPPORTED}")
    arch, permute = ARCHITECTURES[hf_arch]

    n_embd = _get(cfg, path, "hidden_size", kind=int)
    n_head = _get(cfg, path, "num_attention_heads", kind=int)
    n_head_kv = _get(cfg, path, "num_key_value_heads", n_head, kind=int)
    head_dim = cfg.get("head_dim") or n_embd // n_head
    if n_head % n_head_kv:
        raise ConvertError(f"{path}: {n_head} attention heads cannot share {n_head_kv} KV heads evenly")

    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish", "relu"):
        raise ConvertError(f"{path}: hidden_act {act!r} is not supported (silu, relu)")

    # transformers 5 folds rope_theta and rope_scaling into rope_parameters; older configs have both.
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ConvertError(f"{path}: rope scaling {rope_type!r} is not supported (default, linear, llama3)")
    rope["rope_type"] = rope_type

    return ModelConfig(
        hf_arch=hf_arch, arch=arch, permute_qk=permute,
        n_vocab=_get(cfg, path, "vocab_size", kind=int), n_embd=n_embd,
        n_ff=_get(cfg, path, "intermediate_size", kind=int), n_layer=_get(cfg, path, "num_hidden_layers", kind=int),
        n_head=n_head, n_head_kv=n_head_kv, head_dim=int(head_dim),
        n_ctx=int(cfg.get("max_position_embeddings") or 2048),
        rms_eps=float(_get(cfg, path, "rms_norm_eps", 1e-6, kind=float)),
        rope_theta=float(_get({"rope_theta": theta}, path, "rope_theta", kind=float)),
        rope_scaling=rope, activation="relu" if act == "relu" else "silu",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), raw=cfg)


def hparams_kv(c: ModelConfig) -> list[tuple[str, str, object]]:
    """(kind, key, value) metadata llama.cpp's converter writes for these models."""
    a = c.arch
    kv = [
        ("u32", f"{a}.block_count", c.n_layer),
        ("u32", f"{a}.context_length", c.n_ctx),
        ("u32", f"{a}.embedding_length", c.n_embd),
        ("u32", f"{a}.feed_forward_length", c.n_ff),
        ("u32", f"{a}.attention.head_count", c.n_head),
        ("u32", f"{a}.attention.head_count_kv", c.n_head_kv),
        ("f32", f"{a}.rope.freq_base", c.rope_theta),
        ("f32", f"{a}.attention.layer_norm_rms_epsilon", c.rms_eps),
        ("u32", f"{a}.vocab_size", c.n_vocab),
        ("u32", f"{a}.rope.dimension_count", c.head_dim),
    ]
    if c.head_dim != c.n_embd // c.n_head:
        kv += [("u32", f"{a}.attention.key_length", c.head_dim), ("u32", f"{a}.attention.value_length", c.head_dim)]
    if c.rope_scaling["rope_type"] == "linear":
        kv += [("str", f"{a}.rope.scaling.type", "linear"),
               ("f32", f"{a}.rope.scaling.factor", float(c.rope_scaling["factor"]))]
    if c.activation == "relu":
        kv.append(("str", "optiml.ffn.activation", "relu"))  # the engine's switch to relu(gate) * up
    return kv


def llama3_rope_factors(c: ModelConfig) -> np.ndarray:
    """rope_freqs.weight for rope_type llama3 (Llama 3.1+): per-frequency divisors, as llama.cpp writes."""
    r = c.rope_scaling
    factor = float(r.get("factor", 8.0))
    lo, hi = float(r.get("low_freq_factor", 1.0)), float(r.get("high_freq_factor", 4.0))
    old_ctx = float(r.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float32) / c.head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


@dataclass
class TensorPlan:
    """One output tensor: its GGUF name, the HF tensor it comes from, the expected HF shape, and the
    head count to permute q/k rows with (0 = no permutation)."""
    name: str
    source: str
    shape: tuple
    permute_heads: int = 0


def tensor_plan(c: ModelConfig, available: set) -> list[TensorPlan]:
    """Every tensor of the GGUF in llama.cpp's order, checked against the checkpoint's names."""
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    plan = [TensorPlan("token_embd.weight", "model.embed_tokens.weight", (c.n_vocab, c.n_embd))]
    for i in range(c.n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        perm_q = c.n_head if c.permute_qk else 0
        perm_k = c.n_head_kv if c.permute_qk else 0
        plan.append(TensorPlan(b + "attn_norm.weight", p + "input_layernorm.weight", (c.n_embd,)))
        for src, dst, rows, perm in (("q_proj", "attn_q", q, perm_q), ("k_proj", "attn_k", kv, perm_k),
                                     ("v_proj", "attn_v", kv, 0)):
            plan.append(TensorPlan(f"{b}{dst}.weight", f"{p}self_attn.{src}.weight", (rows, c.n_embd), perm))
            if f"{p}self_attn.{src}.bias" in available:
                plan.append(TensorPlan(f"{b}{dst}.bias", f"{p}self_attn.{src}.bias", (rows,), perm))
        plan.append(TensorPlan(b + "attn_output.weight", p + "self_attn.o_proj.weight", (c.n_embd, q)))
        if p + "self_attn.o_proj.bias" in available:
            plan.append(TensorPlan(b + "attn_output.bias", p + "self_attn.o_proj.bias", (c.n_embd,)))
        plan.append(TensorPlan(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (c.n_embd,)))
        for src, dst, shape in (("gate_proj", "ffn_gate", (c.n_ff, c.n_embd)), ("up_proj", "ffn_up", (c.n_ff, c.n_embd)),
                                ("down_proj", "ffn_down", (c.n_embd, c.n_ff))):
            plan.append(TensorPlan(f"{b}{dst}.weight", f"{p}mlp.{src}.weight", shape))
            if f"{p}mlp.{src}.bias" in available:
                plan.append(TensorPlan(f"{b}{dst}.bias", f"{p}mlp.{src}.bias", (shape[0],)))
    plan.append(TensorPlan("output_norm.weight", "model.norm.weight", (c.n_embd,)))
    # A tied model has no lm_head (transformers saves none): llama.cpp then writes no output.weight and
    # its loader, like ours, uses token_embd. A checkpoint without lm_head is treated the same way.
    if not c.tie_embeddings and "lm_head.weight" in available:
        plan.append(TensorPlan("output.weight", "lm_head.weight", (c.n_vocab, c.n_embd)))
    return plan


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF stores q/k rows for rotating halves of each head (NeoX style); llama.cpp's llama rotates
    adjacent pairs, so its converter interleaves the two halves of every head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
