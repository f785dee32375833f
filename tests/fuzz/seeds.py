"""Seed inputs for the fuzz targets, generated (no model file is committed).

GGUF seeds are tiny models written with gguf-py (independent of OptiML's own writer): llama with a
byte-level BPE vocabulary and a chat template, its tensors in F32, F16, Q8_0, Q4_0 and Q4_K, with
optiml.sparsity.* thresholds and optiml.placement.* keys; a SentencePiece (llama) vocabulary; gemma3
and qwen2 (biases) layouts. Each loads in OptiML, so the fuzzer starts from files that reach the model
loader and one forward pass, not only the header parser.

    python tests/fuzz/seeds.py gguf OUT_DIR
"""

from __future__ import annotations

import os
import sys

import gguf
import numpy as np

T = gguf.GGMLQuantizationType


def _bpe_vocab():
    # GPT-2's byte-to-unicode map makes every byte one token, plus a few merges and specials.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_tokens = [chr(c) for _, c in sorted(zip(bs, cs))]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = byte_tokens + ["Ġt", "he", "Ġthe", "in", "Ġa", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return tokens, types, merges


def _spm_vocab():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "▁the", "e", "t", "h", "▁a"]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    types = [2, 3, 3] + [6] * 256 + [1] * 6
    return tokens, scores, types


def _quant(a: np.ndarray, qtype):
    if qtype == T.F32:
        return a.astype(np.float32), None
    if qtype == T.F16:
        return a.astype(np.float16), None
    if qtype == T.Q4_K:  # gguf-py has no K-quant quantizer: OptiML's (a seed need not be independent)
        from optiml import quant

        rows = [quant.quantize(r, "Q4_K") for r in a.astype(np.float32)]
        return np.stack(rows).astype(np.uint8), qtype
    return gguf.quants.quantize(a.astype(np.float32), qtype), qtype


def write_model(path, arch="llama", qtype=T.F32, n_embd=32, n_ff=64, n_layer=1, n_head=2, n_head_kv=1,
                spm=False, optiml_keys=True, biases=False, seed=0):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("fuzz-seed")
    w.add_context_length(64)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_sliding_window(4)
        w.add_key_length(n_embd // n_head)
        w.add_value_length(n_embd // n_head)
    if spm:
        tokens, scores, types = _spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    else:
        tokens, types, merges = _bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm" if seed % 2 else "llama-bpe")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_eos_token_id(len(tokens) - 2)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    n_vocab = len(tokens)
    if optiml_keys:
        w.add_array("optiml.sparsity.threshold", [0.01] * n_layer)
        w.add_array("optiml.sparsity.neuron_scale", [1.0] * (n_layer * n_ff))
        w.add_float32("optiml.sparsity.target", 0.5)
        w.add_array("optiml.placement.gpu_neurons", [n_ff // 2] * n_layer)
        w.add_array("optiml.placement.neuron_order", [int(i) for _ in range(n_layer) for i in rng.permutation(n_ff)])

    def tensor(name, shape, q=qtype):
        data, raw = _quant(rng.normal(0, 0.05, shape), q)
        w.add_tensor(name, data, raw_dtype=raw)

    def norm(name, n):
        w.add_tensor(name, np.ones(n, np.float32))

    head_dim = n_embd // n_head
    tensor("token_embd.weight", (n_vocab, n_embd))
    norm("output_norm.weight", n_embd)
    for i in range(n_layer):
        b = f"blk.{i}."
        tensor(b + "attn_q.weight", (n_head * head_dim, n_embd))
        tensor(b + "attn_k.weight", (n_head_kv * head_dim, n_embd))
        tensor(b + "attn_v.weight", (n_head_kv * head_dim, n_embd))
        tensor(b + "attn_output.weight", (n_embd, n_head * head_dim))
        if biases:
            norm(b + "attn_q.bias", n_head * head_dim)
            norm(b + "attn_k.bias", n_head_kv * head_dim)
            norm(b + "attn_v.bias", n_head_kv * head_dim)
        tensor(b + "ffn_gate.weight", (n_ff, n_embd))
        tensor(b + "ffn_up.weight", (n_ff, n_embd))
        tensor(b + "ffn_down.weight", (n_embd, n_ff), T.F32 if qtype == T.Q4_K and n_ff % 256 else qtype)
        norm(b + "attn_norm.weight", n_embd)
        norm(b + "ffn_norm.weight", n_embd)
        if arch == "gemma3":
            norm(b + "post_attention_norm.weight", n_embd)
            norm(b + "post_ffw_norm.weight", n_embd)
            norm(b + "attn_q_norm.weight", head_dim)
            norm(b + "attn_k_norm.weight", head_dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_SEEDS = {
    "llama-bpe-f32.gguf": dict(),
    "llama-bpe-f16.gguf": dict(qtype=T.F16, seed=1),
    "llama-bpe-q8_0.gguf": dict(qtype=T.Q8_0, optiml_keys=False),
    "llama-bpe-q4_0-2layers.gguf": dict(qtype=T.Q4_0, n_layer=2, seed=3),
    "llama-bpe-q4_k.gguf": dict(qtype=T.Q4_K, n_embd=256, n_ff=256, n_head=4, n_head_kv=2),
    "llama-spm-f32.gguf": dict(spm=True),
    "gemma3-spm-f32.gguf": dict(arch="gemma3", spm=True, n_layer=2),
    "qwen2-bpe-f32.gguf": dict(arch="qwen2", biases=True),
}


def write_gguf_seeds(out_dir) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, kw in GGUF_SEEDS.items():
        path = os.path.join(out_dir, name)
        write_model(path, **kw)
        paths.append(path)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "gguf":
        raise SystemExit(__doc__)
    for p in write_gguf_seeds(sys.argv[2]):
        print(p, os.path.getsize(p))
