"""config.json -> what the GGUF says: the architecture, `{arch}.*` hyper-parameters (llama.cpp's keys)
and the expected shape of every weight, so a checkpoint that disagrees with its config is refused."""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import gpt_oss, moe, phi3
from .common import TensorPlan
from .common import get_value as _get
from .errors import ConvertError

# HF class -> (GGUF architecture, permute q/k rows). llama.cpp writes Mistral as "llama" and permutes
# it like llama; Qwen2 uses NeoX rotation, which matches HF's layout, so no permutation.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),  # qwen2 with per-head q/k RMS norms, no biases, head_dim its own
    "SmolLM3ForCausalLM": ("smollm3", True),  # llama with every fourth layer without RoPE (NoPE)
    "Gemma2ForCausalLM": ("gemma2", False),  # NeoX rotation like HF, no permutation; soft-capped scores
    "Gemma3ForCausalLM": ("gemma3", False),  # text-only; NeoX rotation like HF, no permutation
    # mixtures of experts (moe.py): Mixtral is llama with experts, permuted like llama
    "MixtralForCausalLM": ("llama", True),
    "Qwen2MoeForCausalLM": ("qwen2moe", False),
    "Qwen3MoeForCausalLM": ("qwen3moe", False),
    "GptOssForCausalLM": ("gpt-oss", False),  # gpt_oss.py; NeoX rotation
    "Phi3ForCausalLM": ("phi3", False),  # phi3.py; fused q/k/v and gate/up, NeoX rotation, LongRoPE
}
# Base models without their head, as embedding models are saved (gte-Qwen2, sentence-transformers folders): the
# causal LM's layout (safetensors.Checkpoint adds the "model." prefix their tensors lack).
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
SUPPORTED = ", ".join([*ARCHITECTURES, *BASE_MODELS])
# Bounds on config.json's sizes, far above any model's: the layers OptiML's loader accepts (block_count; llama.cpp
# takes 512), and a vocabulary of 2**30 tokens (the largest tokenizers have about 2**18; token ids are 32-bit).
MAX_LAYERS = 4096
MAX_VOCAB = 1 << 30


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
    # Gemma 2 and 3: sliding window, its layer period (every period-th layer global), the local RoPE base,
    # attention score (Gemma 2) and final logit soft-capping (0 = none). gpt-oss: the window of its even layers.
    n_swa: int = 0
    swa_period: int = 6
    rope_theta_swa: float = 10000.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Mixtures of experts: the experts' count, how many each token uses, their width, the shared
    # expert's width (0 = none); per-head q/k RMS norms (Qwen3); head_dim given by config.json
    # (llama.cpp then writes attention.key_length/value_length).
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    qk_norm: bool = False
    explicit_head_dim: bool = False
    # Phi-3 (phi3.py): the rotated values of each head (0: all of them), the original context, and LongRoPE's
    # divisors (None: no scaling) with its factor on cos and sin.
    n_rot: int = 0
    n_ctx_orig: int = 0
    rope_long: object = None
    rope_short: object = None
    rope_attn_factor: float = 1.0
    # A sentence-transformers folder's pooling (llama.cpp's pooling_type: 1 mean, 2 cls, 3 last; None: none said)
    pooling: int | None = None

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv



def load_config(folder: str) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{path}: missing (is {folder} a Hugging Face model folder?)") from None
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None
    except RecursionError:  # (json recurses once per level: "[" * 100000 is a corrupt file, not a crash)
        raise ConvertError(f"{path}: cannot read: JSON nested too deeply (a corrupt file? download it again)") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: not a JSON object")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConvertError(f"{path}: architectures = {archs!r} is not a list of class names")
    hf_arch = next((BASE_MODELS.get(a, a) for a in archs if a in ARCHITECTURES or a in BASE_MODELS), None)
    if hf_arch is None:
        raise ConvertError(f"{path}: architecture {', '.join(map(str, archs)) or '(none given)'} is not "
                           f"supported; supported: {SUPPORTED}")
    arch, permute = ARCHITECTURES[hf_arch]
    # The sizes everything else is built from, bounded before any of it is (a corrupt 2000000 layers would
    # otherwise cost minutes before the checkpoint disagrees); convert() then checks them against the tensors.
    n_layer = _get(cfg, path, "num_hidden_layers", kind=int)
    if n_layer > MAX_LAYERS:
        raise ConvertError(f"{path}: num_hidden_layers = {n_layer} is more than the {MAX_LAYERS} layers OptiML "
                           "loads (a corrupt config.json?)")
    n_vocab = _get(cfg, path, "vocab_size", kind=int)
    if n_vocab > MAX_VOCAB:
        raise ConvertError(f"{path}: vocab_size = {n_vocab} is more than {MAX_VOCAB} tokens (a corrupt "
                           "config.json?)")

    n_embd = _get(cfg, path, "hidden_size", kind=int)
    n_head = _get(cfg, path, "num_attention_heads", kind=int)
    n_head_kv = _get(cfg, path, "num_key_value_heads", n_head, kind=int)
    head_dim = _get(cfg, path, "head_dim", n_embd // n_head, kind=int) if cfg.get("head_dim") else n_embd // n_head
    if n_head % n_head_kv:
        raise ConvertError(f"{path}: {n_head} attention heads cannot share {n_head_kv} KV heads evenly")

    extra = {}  # the architecture's own fields (Gemma 3's window, a mixture's experts)
    if arch in ("gemma2", "gemma3"):
        act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConvertError(f"{path}: hidden_activation {act!r} is not supported for Gemma (gelu_pytorch_tanh)")
        act = "gelu"
        extra = (_gemma2_extra if arch == "gemma2" else _gemma3_extra)(cfg, path, n_embd, n_head, int(head_dim))
    else:
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act not in ("silu", "swish", "relu"):
            raise ConvertError(f"{path}: hidden_act {act!r} is not supported (silu, relu)")
    n_ctx = cfg.get("max_position_embeddings") or 2048
    if isinstance(n_ctx, float) and n_ctx.is_integer():
        n_ctx = int(n_ctx)
    n_ctx = _get({"max_position_embeddings": n_ctx}, path, "max_position_embeddings", kind=int)
    if hf_arch in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "SmolLM3ForCausalLM", phi3.PHI3):
        n_ctx = _full_attention_context(cfg, path, hf_arch, n_ctx)

    # transformers 5 folds rope_theta and rope_scaling into rope_parameters; older configs have both.
    # Gemma 3's rope_parameters has one entry per layer type: the global layers' is the main one.
    rope = _dict_or_none(cfg, path, "rope_parameters")
    if "full_attention" in rope:
        rope = _dict_or_none(rope, path, "full_attention", "rope_parameters.")
    rope.update(_dict_or_none(cfg, path, "rope_scaling"))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = rope_type
    if rope_type == "linear":
        _get(rope, path, "factor", kind=float)
    if hf_arch in moe.ARCHITECTURES:
        extra = dict(moe.read_config(cfg, path, hf_arch), explicit_head_dim=cfg.get("head_dim") is not None)
    elif hf_arch == "Qwen3ForCausalLM":  # (llama.cpp writes key_length whenever config.json has head_dim)
        extra = dict(qk_norm=True, explicit_head_dim=cfg.get("head_dim") is not None)
    elif hf_arch == "SmolLM3ForCausalLM":
        _check_nope_layers(cfg, path, n_layer)
    elif hf_arch == gpt_oss.GPT_OSS:
        extra = dict(gpt_oss.read_config(cfg, path, rope), explicit_head_dim=cfg.get("head_dim") is not None)
    elif hf_arch == phi3.PHI3:
        extra = phi3.read_config(cfg, path, rope, n_embd, n_head)
    # (gpt-oss's YaRN and Phi-3's LongRoPE are checked by their read_config)
    if hf_arch not in (gpt_oss.GPT_OSS, phi3.PHI3) and rope_type not in ("default", "linear", "llama3"):
        raise ConvertError(f"{path}: rope scaling {rope_type!r} is not supported (default, linear, llama3; "
                           "yarn for gpt-oss)")

    extra["pooling"] = _pooling_type(folder)
    return ModelConfig(
        hf_arch=hf_arch, arch=arch, permute_qk=permute,
        n_vocab=n_vocab, n_embd=n_embd,
        n_ff=_get(cfg, path, "intermediate_size", kind=int), n_layer=n_layer,
        n_head=n_head, n_head_kv=n_head_kv, head_dim=int(head_dim),
        n_ctx=n_ctx, rms_eps=float(_get(cfg, path, "rms_norm_eps", 1e-6, kind=float)),
        rope_theta=float(_get({"rope_theta": theta}, path, "rope_theta", kind=float)),
        rope_scaling=rope, activation=act if act in ("relu", "gelu") else "silu",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", arch in ("gemma2", "gemma3"))), raw=cfg, **extra)


def _pooling_type(folder: str) -> int | None:
    """The pooling a sentence-transformers folder (an embedding model: modules.json and its Pooling module's
    config.json) asks for, as llama.cpp's converter reads it: 1 mean, 2 cls, 3 last; None without one."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            modules = json.load(f)
        sub = next((m["path"] for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
        if sub is None:
            return None
        path = os.path.join(folder, sub, "config.json")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise ConvertError(f"{path}: cannot read the sentence-transformers pooling: {e}") from None
    for key, kind in (("pooling_mode_mean_tokens", 1), ("pooling_mode_cls_token", 2), ("pooling_mode_lasttoken", 3)):
        if cfg.get(key):
            return kind
    mode = {"mean": 1, "cls": 2, "lasttoken": 3}.get(cfg.get("pooling_mode"))
    if mode is None:
        raise ConvertError(f"{path}: pooling {cfg!r} is not supported (mean, cls, lasttoken)")
    return mode


def _check_nope_layers(cfg: dict, path: str, n_layer: int) -> None:
    """SmolLM3's layers without RoPE: llama.cpp's smollm3 graph (which our engine follows) leaves it out of every
    fourth layer and the file does not say which; a checkpoint with another pattern is refused."""
    want = [int((i + 1) % 4 != 0) for i in range(n_layer)]
    got = cfg.get("no_rope_layers")
    if got is None and cfg.get("no_rope_layer_interval", 4) == 4:
        return
    if got != want:
        raise ConvertError(f"{path}: no_rope_layers = {got!r} (interval {cfg.get('no_rope_layer_interval')!r}) is not "
                           "every fourth layer without RoPE, the only pattern llama.cpp's smollm3 reads")


def _dict_or_none(cfg: dict, path: str, key: str, prefix: str = "") -> dict:
    """cfg[key] as a new dict ({} when missing or null), refused when it is something else."""
    v = cfg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConvertError(f"{path}: {prefix}{key} = {v!r} is not an object")
    return dict(v)


def _full_attention_context(cfg: dict, path: str, hf_arch: str, n_ctx: int) -> int:
    """The context a Mistral, Mixtral, Qwen2 or Qwen3 file says. llama.cpp's graphs for them (llama, qwen2: which
    OptiML's engine follows) attend to every position, as transformers does within a sliding window's
    length. A Mistral or Mixtral window shorter than max_position_embeddings (Mistral-7B-v0.1: 4096 of 32768)
    becomes the file's context_length, so that both engines compute what transformers does up to their
    trained context. Qwen2's (and Qwen3's) use_sliding_window windows the layers from max_window_layers on (or those
    layer_types names): refused where that changes anything."""
    if hf_arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM"):
        if cfg.get("use_sliding_window") and (cfg.get("sliding_window") or n_ctx) < n_ctx:
            types = cfg.get("layer_types")
            n_layer = cfg.get("num_hidden_layers") or 0
            windowed = ("sliding_attention" in types if isinstance(types, list) else
                        (cfg.get("max_window_layers") if cfg.get("max_window_layers") is not None else 0) < n_layer)
            if windowed:
                raise ConvertError(f"{path}: use_sliding_window = true with a window of {cfg['sliding_window']} "
                                   f"positions is not supported (full attention)")
        return n_ctx
    window = cfg.get("sliding_window")
    if window is None:
        return n_ctx
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConvertError(f"{path}: sliding_window = {window!r} is not a positive integer or null")
    if window >= n_ctx:
        return n_ctx
    warnings.warn(f"{path}: sliding_window = {window} is shorter than max_position_embeddings = {n_ctx}; "
                  f"llama.cpp and OptiML attend to every position, which equals the window up to {window} "
                  f"positions, so the file's context_length is {window}", stacklevel=2)
    return window


def _check_query_scalar(cfg: dict, path: str, expected: int, head_dim: int, model: str) -> None:
    """Gemma's query_pre_attn_scalar (transformers' default: the head size) against the one llama.cpp's graph
    uses (it knows the 27B by its layers)."""
    scalar = cfg.get("query_pre_attn_scalar", head_dim)
    if scalar != expected:
        raise ConvertError(f"{path}: query_pre_attn_scalar {scalar} is not supported (llama.cpp's {model} scales q "
                           f"by 1/sqrt({expected}))")


def _gemma2_extra(cfg: dict, path: str, n_embd: int, n_head: int, head_dim: int) -> dict:
    """Gemma 2's scalings, soft-caps and alternating sliding window, refused where llama.cpp's gemma2 graph
    (which our engine follows) would compute something else than the checkpoint means."""
    n_layer = _get(cfg, path, "num_hidden_layers", kind=int)
    _check_query_scalar(cfg, path, n_embd // n_head if n_layer == 46 else head_dim, head_dim, "Gemma 2")  # (27B: 46)
    out = {}
    # (null would leave the scores or the logits uncapped, which llama.cpp's gemma2 graph cannot do: refused)
    out["attn_softcap"] = float(_get(cfg, path, "attn_logit_softcapping", kind=float))
    out["final_softcap"] = float(_get(cfg, path, "final_logit_softcapping", kind=float))
    window = _get(cfg, path, "sliding_window", kind=int)
    types = cfg.get("layer_types")
    if types is not None and types != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]:
        raise ConvertError(f"{path}: layer_types is not Gemma 2's alternation of sliding and global layers "
                           "(sliding first), the only one llama.cpp's gemma2 reads")
    if not cfg.get("tie_word_embeddings", True):
        raise ConvertError(f"{path}: tie_word_embeddings = false is not supported for Gemma 2 (llama.cpp's gemma2 "
                           "reads no output matrix: it would run the file with the embeddings instead)")
    if (cfg.get("rope_scaling") or {}).get("rope_type", "default") not in ("default", None):
        raise ConvertError(f"{path}: RoPE scaling is not supported for Gemma 2")
    out.update(n_swa=window, swa_period=2)
    return out


def _gemma3_extra(cfg: dict, path: str, n_embd: int, n_head: int, head_dim: int) -> dict:
    """Gemma 3's sliding-window layout and scalings, refused where llama.cpp's gemma3 graph (which our
    engine follows) would compute something else than the checkpoint means."""
    n_layer = _get(cfg, path, "num_hidden_layers", kind=int)
    _check_query_scalar(cfg, path, n_embd // n_head if n_layer == 62 else head_dim, head_dim, "Gemma 3")  # (27B: 62)
    if cfg.get("attn_logit_softcapping"):
        raise ConvertError(f"{path}: attn_logit_softcapping is not supported")
    out = {"final_softcap": float(cfg.get("final_logit_softcapping") or 0.0)}
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        period = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)) or 6)
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n_layer)]
    if not window or "sliding_attention" not in types:
        out["n_swa"] = 0
    else:
        out["n_swa"] = int(window)
        period = types.index("full_attention") + 1 if "full_attention" in types else n_layer + 1
        if types != ["sliding_attention" if i % period < period - 1 else "full_attention" for i in range(n_layer)]:
            raise ConvertError(f"{path}: layer_types is not a repeating pattern of sliding layers then one "
                               "global layer")
        out["swa_period"] = period
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else {}
    if local.get("rope_type", "default") != "default":
        raise ConvertError(f"{path}: RoPE scaling on the sliding-window layers is not supported")
    out["rope_theta_swa"] = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    return out


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
    ]
    if a not in ("gemma2", "gemma3"):  # llama.cpp's Gemma converters write neither
        kv += [("u32", f"{a}.vocab_size", c.n_vocab), ("u32", f"{a}.rope.dimension_count", c.n_rot or c.head_dim)]
    if c.head_dim != c.n_embd // c.n_head or a in ("gemma2", "gemma3") or c.explicit_head_dim:
        kv += [("u32", f"{a}.attention.key_length", c.head_dim), ("u32", f"{a}.attention.value_length", c.head_dim)]
    if c.arch == "phi3":
        kv += phi3.hparams_kv(c)
    if c.arch == "gpt-oss":
        kv += gpt_oss.yarn_kv(c) + [("u32", f"{a}.attention.sliding_window", c.n_swa)]
    if c.rope_scaling["rope_type"] == "linear":
        kv += [("str", f"{a}.rope.scaling.type", "linear"),
               ("f32", f"{a}.rope.scaling.factor", float(c.rope_scaling["factor"]))]
    if c.n_expert:  # llama.cpp writes the experts' width for the Qwen MoEs only (Mixtral's is n_ff)
        kv += [("u32", f"{a}.expert_count", c.n_expert), ("u32", f"{a}.expert_used_count", c.n_expert_used)]
        if a != "llama":
            kv.append(("u32", f"{a}.expert_feed_forward_length", c.n_ff_exp))
        if c.n_ff_shexp:
            kv.append(("u32", f"{a}.expert_shared_feed_forward_length", c.n_ff_shexp))
    if c.pooling is not None:  # (llama.cpp's converter writes it for Qwen2/3 and a few others; every reader reads it)
        kv.append(("u32", f"{a}.pooling_type", c.pooling))
    if c.activation == "relu":
        kv.append(("str", "optiml.ffn.activation", "relu"))  # the engine's switch to relu(gate) * up
    if a == "gemma2":  # gelu is gemma2's own activation; its caps and window as llama.cpp's converter writes them
        kv += [("f32", f"{a}.attn_logit_softcapping", c.attn_softcap),
               ("f32", f"{a}.final_logit_softcapping", c.final_softcap),
               ("u32", f"{a}.attention.sliding_window", c.n_swa)]
    if a == "gemma3":  # gelu is gemma3's own activation; the window, and what differs from llama.cpp's defaults
        if c.n_swa:
            kv.append(("u32", f"{a}.attention.sliding_window", c.n_swa))
            if c.swa_period != 6:
                kv.append(("u32", f"{a}.attention.sliding_window_pattern", c.swa_period))
        if c.rope_theta_swa != 10000.0:
            kv.append(("f32", f"{a}.rope.freq_base_swa", c.rope_theta_swa))
        if c.final_softcap:
            kv.append(("f32", f"{a}.final_logit_softcapping", c.final_softcap))
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


def tensor_plan(c: ModelConfig, available: set) -> list[TensorPlan]:
    """Every tensor of the GGUF in llama.cpp's order, checked against the checkpoint's names."""
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    if c.arch in ("gemma2", "gemma3"):
        return _gemma_plan(c, available)
    plan = [TensorPlan("token_embd.weight", "model.embed_tokens.weight", (c.n_vocab, c.n_embd))]
    for i in range(c.n_layer):
        if c.arch == "phi3":
            plan += phi3.layer_plan(c, i)
            continue
        p, b = f"model.layers.{i}.", f"blk.{i}."
        perm_q = c.n_head if c.permute_qk else 0
        perm_k = c.n_head_kv if c.permute_qk else 0
        plan.append(TensorPlan(b + "attn_norm.weight", p + "input_layernorm.weight", (c.n_embd,)))
        for src, dst, rows, perm in (("q_proj", "attn_q", q, perm_q), ("k_proj", "attn_k", kv, perm_k),
                                     ("v_proj", "attn_v", kv, 0)):
            plan.append(TensorPlan(f"{b}{dst}.weight", f"{p}self_attn.{src}.weight", (rows, c.n_embd), perm))
            if f"{p}self_attn.{src}.bias" in available:
                plan.append(TensorPlan(f"{b}{dst}.bias", f"{p}self_attn.{src}.bias", (rows,), perm))
        if c.qk_norm:  # Qwen3: RMS norms over each head's q and k
            plan += [TensorPlan(f"{b}attn_{w}_norm.weight", f"{p}self_attn.{w}_norm.weight", (c.head_dim,))
                     for w in "qk"]
        plan.append(TensorPlan(b + "attn_output.weight", p + "self_attn.o_proj.weight", (c.n_embd, q)))
        if p + "self_attn.o_proj.bias" in available:
            plan.append(TensorPlan(b + "attn_output.bias", p + "self_attn.o_proj.bias", (c.n_embd,)))
        if c.arch == "gpt-oss":  # a sink logit per head; llama.cpp names the FFN's norm post_attention_norm
            plan += [TensorPlan(b + "attn_sinks.weight", p + "self_attn.sinks", (c.n_head,)),
                     TensorPlan(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", (c.n_embd,))]
            plan += gpt_oss.ffn_plan(c, i, available)
            continue
        plan.append(TensorPlan(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (c.n_embd,)))
        if c.n_expert:
            plan += moe.ffn_plan(c, i, available)
            continue
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
    elif c.arch == "qwen2moe":  # llama.cpp's qwen2moe requires output.weight: a tied model gets a copy
        plan.append(TensorPlan("output.weight", "model.embed_tokens.weight", (c.n_vocab, c.n_embd)))
    return plan


def _gemma_plan(c: ModelConfig, available: set) -> list[TensorPlan]:
    """Gemma 2 and 3: every norm stored as 1 + w, norms after the attention and the FFN too; q/k norms (Gemma 3)."""
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    plan = [TensorPlan("token_embd.weight", "model.embed_tokens.weight", (c.n_vocab, c.n_embd))]
    for i in range(c.n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        plan += [
            TensorPlan(b + "attn_norm.weight", p + "input_layernorm.weight", (c.n_embd,), add_one=True),
            TensorPlan(b + "attn_q.weight", p + "self_attn.q_proj.weight", (q, c.n_embd)),
            TensorPlan(b + "attn_k.weight", p + "self_attn.k_proj.weight", (kv, c.n_embd)),
            TensorPlan(b + "attn_v.weight", p + "self_attn.v_proj.weight", (kv, c.n_embd)),
        ]
        if c.arch == "gemma3":
            plan += [TensorPlan(f"{b}attn_{w}_norm.weight", f"{p}self_attn.{w}_norm.weight", (c.head_dim,),
                                add_one=True) for w in "qk"]
        plan += [
            TensorPlan(b + "attn_output.weight", p + "self_attn.o_proj.weight", (c.n_embd, q)),
            TensorPlan(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", (c.n_embd,),
                       add_one=True),
            TensorPlan(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight", (c.n_embd,), add_one=True),
            TensorPlan(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (c.n_ff, c.n_embd)),
            TensorPlan(b + "ffn_up.weight", p + "mlp.up_proj.weight", (c.n_ff, c.n_embd)),
            TensorPlan(b + "ffn_down.weight", p + "mlp.down_proj.weight", (c.n_embd, c.n_ff)),
            TensorPlan(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight", (c.n_embd,),
                       add_one=True),
        ]
    plan.append(TensorPlan("output_norm.weight", "model.norm.weight", (c.n_embd,), add_one=True))
    if not c.tie_embeddings and "lm_head.weight" in available:
        plan.append(TensorPlan("output.weight", "lm_head.weight", (c.n_vocab, c.n_embd)))
    return plan


def add_one(w: np.ndarray, dtype: str) -> np.ndarray:
    """1 + w in the checkpoint's precision: llama.cpp adds 1 to the torch tensor before converting, so a
    BF16 or F16 checkpoint's sums are rounded to that type."""
    y = w.astype(np.float32) + np.float32(1.0)
    if dtype == "F16":
        return y.astype(np.float16).astype(np.float32)
    if dtype == "BF16":  # round to nearest even on the upper 16 bits
        b = y.view(np.uint32).astype(np.uint64)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.astype(np.uint32).view(np.float32)
    return y


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF stores q/k rows for rotating halves of each head (NeoX style); llama.cpp's llama rotates
    adjacent pairs, so its converter interleaves the two halves of every head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
