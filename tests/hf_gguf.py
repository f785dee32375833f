"""Writes a transformers model to GGUF with gguf-py, the way llama.cpp's converter lays it out (tensor
names, metadata keys, the q/k row permutation of llama-arch models). Test helper, independent of
OptiML's own converter, so the engine is checked against transformers without trusting our writer."""

from __future__ import annotations

import gguf
import numpy as np


def write_and_close(w: gguf.GGUFWriter) -> None:
    """Writes what was added to w (header, metadata, tensors) to its file and closes it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows: HF rotates halves (NeoX), GGUF llama rotates pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, arch: str = "llama", extra: dict | None = None) -> None:
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-random")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    w.add_rope_freq_base(float(base))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    for k, v in (extra or {}).items():
        w.add_string(k, v)

    permute = arch in ("llama", "mistral")
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for src, dst, heads in (("q_proj", "attn_q", n_head), ("k_proj", "attn_k", n_kv)):
            for kind in ("weight", "bias"):
                if p + f"self_attn.{src}.{kind}" in sd:
                    t = sd[p + f"self_attn.{src}.{kind}"]
                    w.add_tensor(f"{b}{dst}.{kind}", permute_qk(t, heads) if permute else t)
        names = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                if p + f"{src}.{kind}" in sd:
                    w.add_tensor(f"{b}{dst}.{kind}", sd[p + f"{src}.{kind}"])
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    write_and_close(w)


def write_gguf_gemma3(model, path) -> None:
    """A Gemma3ForCausalLM (text) laid out as llama.cpp's Gemma3Model converter writes it: every RMSNorm
    scale stored as 1 + w, no q/k permutation (NeoX rotation), the sliding window in metadata and the
    global layers' RoPE base as rope.freq_base (the local base, 10000, is what llama.cpp assumes)."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    rope = cfg.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] == 10000.0, "llama.cpp fixes the local RoPE base at 10000"
    assert cfg.query_pre_attn_scalar == cfg.head_dim, "llama.cpp scales q by 1/sqrt(head_dim)"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-random")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    if rope["full_attention"].get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["full_attention"]["factor"]))
    w.add_sliding_window(cfg.sliding_window)
    norm = lambda name: sd[name] + 1.0  # noqa: E731  Gemma's RMSNorm multiplies by (1 + w)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", norm("model.norm.weight"))
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for src, dst in names.items():
            w.add_tensor(f"{b}{dst}.weight", sd[f"{p}{src}.weight"])
        for src, dst in norms.items():
            w.add_tensor(f"{b}{dst}.weight", norm(f"{p}{src}.weight"))
    write_and_close(w)


# ---- the other way: a GGUF (quantized, as llama.cpp writes it) back to a float32 transformers model ----
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
            12: "<f8"}  # GGUF value types; 8 is a string, 9 an array


def read_gguf(path) -> tuple[dict, dict]:
    """(metadata without the tokenizer's arrays, {name: float32 array in numpy's row-major shape}).
    A small reader of its own, faster than gguf-py's GGUFReader on a 262k-token vocabulary (which
    transformers' GGUF loader runs twice, ~1 minute per load); dequantized by gguf-py."""
    data = np.memmap(path, np.uint8, mode="r")
    pos = 0

    def take(dtype, count=1):
        nonlocal pos
        a = np.frombuffer(data, dtype, count, pos)
        pos += a.nbytes
        return a

    def string():
        n = int(take("<u8")[0])
        s = bytes(take("u1", n))
        return s.decode("utf-8", "replace")

    def value(t, keep=True):
        if t == 8:
            return string()
        if t == 9:
            et, n = int(take("<u4")[0]), int(take("<u8")[0])
            if et == 8:
                items = [string() for _ in range(n)]
                return items if keep else None
            a = take(_SCALARS[et], n)
            return a.tolist() if keep else None
        v = take(_SCALARS[t])[0]
        return bool(v) if t == 7 else v.item()

    assert bytes(take("u1", 4)) == b"GGUF", path
    version = int(take("<u4")[0])
    assert version >= 2, version
    n_tensors, n_kv = (int(x) for x in take("<u8", 2))
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(int(take("<u4")[0]), keep=not key.startswith("tokenizer.ggml."))
    infos = []
    for _ in range(n_tensors):
        name = string()
        n_dims = int(take("<u4")[0])
        dims = [int(d) for d in take("<u8", n_dims)]
        qtype, offset = int(take("<u4")[0]), int(take("<u8")[0])
        infos.append((name, dims, qtype, offset))
    align = meta.get("general.alignment", 32)
    start = pos + (-pos % align)
    tensors = {}
    for name, dims, qtype, offset in infos:
        qt = gguf.GGMLQuantizationType(qtype)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        n_bytes = int(np.prod(dims)) // block * size
        raw = np.asarray(data[start + offset : start + offset + n_bytes])
        shape = tuple(reversed(dims))
        if qt == gguf.GGMLQuantizationType.F32:
            t = raw.view(np.float32).reshape(shape).copy()
        else:
            t = gguf.quants.dequantize(raw.reshape(*shape[:-1], -1), qt).astype(np.float32).reshape(shape)
        tensors[name] = t
    return meta, tensors


def hf_from_gguf(path):
    """A float32 transformers model with a GGUF's dequantized weights: llama (q/k rows un-permuted) or
    gemma3 (RMSNorm scales stored as 1 + w), the configuration from the GGUF's metadata."""
    import torch
    import transformers

    meta, t = read_gguf(path)
    arch = meta["general.architecture"]
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    n_head, n_kv = g("attention.head_count"), g("attention.head_count_kv")
    n_embd = g("embedding_length")
    head_dim = g("attention.key_length", n_embd // n_head)
    common = dict(vocab_size=t["token_embd.weight"].shape[0], hidden_size=n_embd, intermediate_size=g("feed_forward_length"),
                  num_hidden_layers=g("block_count"), num_attention_heads=n_head, num_key_value_heads=n_kv,
                  head_dim=head_dim, max_position_embeddings=g("context_length"),
                  rms_norm_eps=g("attention.layer_norm_rms_epsilon"), tie_word_embeddings="output.weight" not in t)
    assert g("rope.scaling.type") in (None, "none"), "rope scaling: not mapped by this helper"
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"]}
    if "output.weight" in t:
        sd["lm_head.weight"] = t["output.weight"]
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=g("rope.freq_base", 10000.0))
        norms = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
        unpermute = {"attn_q": n_head, "attn_k": n_kv}
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common, query_pre_attn_scalar=head_dim, sliding_window=g("attention.sliding_window"),
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": g("rope.freq_base")}})
        norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
        unpermute = {}
        sd["model.norm.weight"] = sd["model.norm.weight"] - 1.0
    else:
        raise NotImplementedError(arch)
    for i in range(cfg.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for src, dst in names.items():
            w = t[f"{b}{src}.weight"]
            if src in unpermute:  # the inverse of permute_qk
                h = unpermute[src]
                w = w.reshape(h, w.shape[0] // h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            sd[f"{p}{dst}.weight"] = w
        for src, dst in norms.items():
            sd[f"{p}{dst}.weight"] = t[f"{b}{src}.weight"] - (1.0 if arch == "gemma3" else 0.0)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Gemma3ForCausalLM
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():  # every weight is assigned below: skip the random init (seconds at this size)
        model = cls(cfg).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=False,
                                                assign=True)
    assert not unexpected and missing in ([], ["lm_head.weight"]), (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model
