"""Writes a transformers model to GGUF with gguf-py, the way llama.cpp's converter lays it out (tensor
names, metadata keys, the q/k row permutation of llama-arch models). Test helper, independent of
OptiML's own converter, so the engine is checked against transformers without trusting our writer."""

from __future__ import annotations

import gguf
import numpy as np


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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
