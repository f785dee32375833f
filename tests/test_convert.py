"""optiml.convert: Hugging Face folders (save_pretrained) to GGUF, run in OptiML and compared with
transformers; the real SmolLM2 checkpoint; sharded and bf16 sources; llama.cpp's quant mix; bad input."""

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402

import optiml  # noqa: E402
from optiml import cli  # noqa: E402
from optiml.convert import ConvertError, convert  # noqa: E402
from optiml.convert import pre_tokenizers as PT  # noqa: E402
from optiml.convert.tokenizer import _pre_tokenizer_name  # noqa: E402

from conftest import llama_cpp_module  # noqa: E402
from test_model_hf import BASE, rel_err  # noqa: E402

CONFIGS = {
    "llama-gqa-tied": ("LlamaForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mqa-bias": ("LlamaForCausalLM", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                                                tie_word_embeddings=False)),
    "llama-relu": ("LlamaForCausalLM", dict(num_key_value_heads=2, hidden_act="relu", tie_word_embeddings=False)),
    "llama-rope-linear": ("LlamaForCausalLM", dict(num_key_value_heads=2, rope_theta=50000.0,
                                                   rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama3-rope": ("LlamaForCausalLM", dict(num_key_value_heads=2, max_position_embeddings=512, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral-gqa": ("MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False)),
    "qwen2-bias": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=False)),
    # Qwen3: per-head q/k norms, and a head size of its own (Qwen3-0.6B: 16 heads of 128 in 1024)
    "qwen3-head-dim": ("Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                                use_sliding_window=False)),
    # SmolLM3: llama with no RoPE in every fourth layer (4 layers: the last has none)
    "smollm3-nope": ("SmolLM3ForCausalLM", dict(num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=True,
                                                use_sliding_window=False, pad_token_id=None, bos_token_id=1,
                                                eos_token_id=0)),
    # Phi-3: q/k/v and gate/up fused, 3/4 of each head rotated (Phi-4-mini's), LongRoPE past a context of 32
    "phi3-longrope": ("Phi3ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None,
                                              pad_token_id=None, bos_token_id=1, eos_token_id=0,
                                              partial_rotary_factor=0.75, original_max_position_embeddings=32,
                                              rope_scaling={"rope_type": "longrope",
                                                            "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                                                            "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5]})),
}
PROMPTS = [[5, 77, 123, 9, 250, 31], [200, 3, 3, 41]]


def make_model(name, seed=0, **over):
    cls, extra = CONFIGS[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**{**BASE, **extra, **over})
    model = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():  # random init leaves biases ~0 and norms 1, and logits too flat to rank
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
            elif "embed_tokens" in n or "lm_head" in n:
                p.mul_(10.0)
    return model


def tiny_bpe():
    """A byte-level BPE tokenizer of < 300 tokens (a tokenizers.Tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["The capital of France is Paris. 1234 numbers, and more words here."] * 50, trainer)
    return tok


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """tiny_bpe, saved as transformers saves one."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_bpe(), eos_token="<|endoftext|>",
                                                bos_token="<|im_start|>")
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(d)
    return d


def save_folder(model, folder, tok_dir, **kw):
    model.save_pretrained(folder, **kw)
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), folder)
    return folder


def converted_tiny(name, tmp_path_factory, tok_dir, type="f32"):
    """make_model(name) saved and converted by optiml: (the transformers model, the GGUF's path)."""
    model = make_model(name)
    d = tmp_path_factory.mktemp(name)
    return model, convert(save_folder(model, d / "hf", tok_dir), d / f"{name}.gguf", type=type)


def greedy_hf(model, prompt, n=16):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy_agrees(m, model, prompt, n=16, tie=0.02):
    """transformers' 16 greedy tokens, fed to our model at once: at every step our argmax is the same
    token, except where transformers' top two are closer than `tie` (a coin toss under quantization
    noise; random tiny models have a few such steps). Returns the steps that disagree."""
    hf = greedy_hf(model, prompt, n)
    seq = prompt + hf
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0].numpy()[len(prompt) - 1:-1]
    m.reset()
    ours = m.eval(seq, all_logits=True)[len(prompt) - 1:-1]
    bad = []
    for i in range(n):
        top2 = np.sort(ref[i])[-2:]
        if int(np.argmax(ours[i])) != hf[i] and top2[1] - top2[0] >= tie:
            bad.append(i)
    return bad


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory, tiny_tokenizer):
    model = make_model(request.param)
    d = save_folder(model, tmp_path_factory.mktemp(request.param) / "hf", tiny_tokenizer)
    return request.param, model, d


# ---- tiny random models of every supported architecture ----------------------------------------
def test_f32_logits_match_transformers(tiny, tmp_path):
    name, model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type="f32")
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 40)
    with torch.no_grad():
        ref = model(torch.tensor(ids[None])).logits[0].numpy()
    with optiml.Model(out, n_ctx=64, n_threads=2, kv_type="f32") as m:
        ours = m.eval(ids.tolist(), all_logits=True)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4, name


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_greedy_16_matches_transformers(tiny, tmp_path, qtype):
    name, model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type=qtype)
    with optiml.Model(out, n_ctx=64, n_threads=2) as m:
        for p in PROMPTS:
            assert greedy_agrees(m, model, p) == [], (name, qtype, p)


def test_metadata_follows_llama_cpp(tiny, tmp_path):
    name, model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type="q8_0")
    r = gguf.GGUFReader(out)
    f = {k: v.contents() for k, v in r.fields.items()}
    arch = name.split("-")[0] if name.startswith(("qwen", "smollm3", "phi3")) else "llama"
    assert f["general.architecture"] == arch
    assert f["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert f[f"{arch}.block_count"] == model.config.num_hidden_layers
    assert f[f"{arch}.attention.head_count_kv"] == model.config.num_key_value_heads
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"  # llama.cpp's spelling
    assert f["tokenizer.ggml.eos_token_id"] == 0 and f["tokenizer.ggml.bos_token_id"] == 1
    assert len(f["tokenizer.ggml.tokens"]) == model.config.vocab_size
    assert f["tokenizer.ggml.token_type"][0] == 3 and f["tokenizer.ggml.tokens"][-1] == "[PAD299]"
    assert f.get("optiml.ffn.activation") == ("relu" if name == "llama-relu" else None)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    qkv = "attn_qkv" if arch == "phi3" else "attn_q"  # (Phi-3's fused q, k, v: tests/test_phi3.py)
    assert types[f"blk.0.{qkv}.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert ("output.weight" in types) == (not model.config.tie_word_embeddings)
    assert ("rope_freqs.weight" in types) == (name == "llama3-rope")


# ---- llama.cpp runs what the converter writes -------------------------------------------------
# Positions where llama.cpp's top two logits are closer than this may go either way (llama.cpp's AVX-512
# kernels put SmolLM2 Q8_0's top two 0.066 apart where OptiML had them 0.156 the other way round).
TIE_GAP = 0.1


def llama_cpp_greedy_agrees(path, prompt, n=24, n_ctx=128):
    """llama.cpp's greedy continuation of `prompt` (text) on the file, then both engines scored on it
    (teacher forcing): OptiML's prompt tokens equal llama.cpp's and its argmax equals llama.cpp's at every
    step where llama.cpp's top two logits are at least TIE_GAP apart. Returns (steps that
    disagree, max |logit difference| / logit spread, the greedy ids)."""
    llama_cpp = llama_cpp_module()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                          n_threads=1, n_threads_batch=1)  # 2 spinning threads crawl on a busy 2-core machine
    try:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.eval(ids)
        for _ in range(n):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        seq = [int(t) for t in llm.eval_tokens]
    finally:
        llm.close()
    # llama.cpp scored on the whole sequence at once, as OptiML is below: its batch and one-token kernels
    # differ by more than rounding ties on some CPUs (AVX-512: a 0.05 margin flipped between the two).
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                          n_threads=1, n_threads_batch=1)
    try:
        llm.eval(seq)
        ref = np.array(llm.scores[: len(seq)], dtype=np.float32)
    finally:
        llm.close()
    with optiml.Model(path, n_ctx=n_ctx, n_threads=2) as m:
        assert m.tokenize(prompt, special=True) == ids
        ours = m.eval(seq, all_logits=True)
    ref, ours = ref[len(ids) - 1:-1], ours[len(ids) - 1:-1]
    want = [int(t) for t in ref.argmax(1)]
    top2 = np.sort(ref, axis=1)[:, -2:]
    bad = [i for i in range(n) if int(np.argmax(ours[i])) != want[i] and top2[i, 1] - top2[i, 0] >= TIE_GAP]
    rel = float((np.abs(ours - ref).max(1) / (ref.max(1) - ref.min(1))).max())
    return bad, rel, seq


@pytest.fixture(scope="module", params=["llama-gqa-tied", "mistral-gqa", "qwen2-bias", "qwen3-head-dim", "smollm3-nope",
                                        "phi3-longrope", "gemma2", "gemma3"])
def arch_folder(request, tmp_path_factory, tiny_tokenizer):
    """A tiny checkpoint of each architecture the converter writes: llama as SmolLM2 lays it out (tied;
    such a random model keeps repeating its last token), mistral (written as llama, untied), qwen2, qwen3, phi3
    (llama.cpp's context of 128 takes the long LongRoPE factors), gemma2 (soft-capped scores and logits, sliding
    and global layers alternating) and gemma3 (7 layers: sliding and global ones)."""
    if request.param == "gemma2":
        from test_gemma2 import make_model as make_gemma2

        model = make_gemma2("mqa-6-layers")
    elif request.param == "gemma3":
        from test_gemma3 import make_model as make_gemma3

        model = make_gemma3("mqa-untied-7-layers")
        with torch.no_grad():  # logits peaked enough that greedy steps are rarely coin tosses
            model.lm_head.weight.mul_(10.0)
    else:
        model = make_model(request.param)
    return request.param, save_folder(model, tmp_path_factory.mktemp(request.param) / "hf", tiny_tokenizer)


@pytest.mark.parametrize("qtype", ["f16", "q8_0", "q4_1", "q4_k_m", "iq4_xs"])
def test_llama_cpp_runs_converted_files(arch_folder, tmp_path, qtype):
    """Every file the converter writes loads in llama.cpp, tokenizes as OptiML does and gives OptiML's
    greedy tokens (near-ties aside)."""
    name, d = arch_folder
    out = convert(d, tmp_path / "m.gguf", type=qtype)
    for prompt in ("The capital of France is", "1234 numbers, and more"):
        bad, rel, _ = llama_cpp_greedy_agrees(out, prompt)
        assert bad == [], (name, qtype, prompt, bad)
        assert rel < 0.02, (name, qtype, prompt, rel)


# ---- sharded and bf16 checkpoints --------------------------------------------------------------
def tensors_of(path):
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}


def test_sharded_and_bf16_equal_their_f32_twins(tmp_path, tiny_tokenizer):
    model = make_model("qwen2-bias", seed=3)
    single = convert(save_folder(model, tmp_path / "single", tiny_tokenizer), tmp_path / "single.gguf", type="f32")
    sharded_dir = save_folder(model, tmp_path / "sharded", tiny_tokenizer, max_shard_size="60KB")
    assert os.path.isfile(sharded_dir / "model.safetensors.index.json")
    sharded = convert(sharded_dir, tmp_path / "sharded.gguf", type="f32")
    a, b = tensors_of(single), tensors_of(sharded)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    model16 = model.to(torch.bfloat16)
    bf16 = convert(save_folder(model16, tmp_path / "bf16", tiny_tokenizer), tmp_path / "bf16.gguf", type="f32")
    twin = convert(save_folder(model16.to(torch.float32), tmp_path / "twin", tiny_tokenizer), tmp_path / "twin.gguf",
                   type="f32")
    a, b = tensors_of(bf16), tensors_of(twin)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- the real SmolLM2 checkpoint ----------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_hf(smollm2_path, tmp_path_factory):
    """SmolLM2-135M-Instruct dequantized by transformers from llama.cpp's Q4_1 GGUF, saved as a HF
    folder (f32, ~540 MB), and that folder converted by OptiML to f32."""
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    d = tmp_path_factory.mktemp("smol")
    folder, name = str(smollm2_path.parent), smollm2_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.hf_quantizer = None  # the weights are plain f32 now; let save_pretrained write them
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(d / "hf")
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(d / "hf")
    out = convert(d / "hf", d / "smol.f32.gguf", type="f32")
    return model, d / "hf", out


def test_smollm2_f32_logits_match_transformers(smol_hf):
    model, _, out = smol_hf
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
           2, 198, 1, 4093, 198, 504, 3575, 282, 4649, 314]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    with optiml.Model(out, n_ctx=64, n_threads=2, kv_type="f32") as m:
        ours = m.eval(ids, all_logits=True)
    assert rel_err(ours, ref) < 1e-4


def test_smollm2_q8_0_runs_in_llama_cpp(smol_hf, smollm2_path, tmp_path):
    """The converted SmolLM2 loads in llama.cpp and gives OptiML's greedy text. The folder's
    tokenizer.json comes from transformers' reading of the GGUF (plain GPT-2 splitting); given the
    pre-tokenizer of SmolLM2's own tokenizer.json (each digit alone) it becomes "smollm", and llama.cpp
    then tokenizes it as it tokenizes llama.cpp's own SmolLM2 file."""
    llama_cpp = llama_cpp_module()
    _, hf, _ = smol_hf
    d = tmp_path / "hf"
    shutil.copytree(hf, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    out = convert(d, tmp_path / "smol.q8_0.gguf", type="q8_0")
    assert gguf.GGUFReader(out).fields["tokenizer.ggml.pre"].contents() == "smollm"
    bad, _, seq = llama_cpp_greedy_agrees(out, "The capital of France is", n=32)
    assert bad == []
    with optiml.Model(out, n_threads=1) as m:
        assert m.detokenize(seq[5:]).startswith(" Paris")
    text = b"In 1888, 12345 + 678 = 13023 people met at 221B Baker Street."
    ref = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=64, verbose=False, vocab_only=True)
    ours = llama_cpp.Llama(model_path=str(out), n_ctx=64, verbose=False, vocab_only=True)
    assert ours.tokenize(text, add_bos=False) == ref.tokenize(text, add_bos=False)
    ref.close()
    ours.close()


@pytest.mark.parametrize("text", ["The capital of France is", "Hello world! 12345 + 678 = ?\n\n  indented\ttabs",
                                  "<|im_start|>user\nCafé naïve 東京<|im_end|>", " leading space, émoji 🚀"])
def test_smollm2_tokenization_matches_transformers(smol_hf, text):
    _, hf, out = smol_hf
    ref = transformers.AutoTokenizer.from_pretrained(hf)(text)["input_ids"]
    with optiml.Model(out, n_ctx=64, n_threads=1) as m:
        assert m.tokenize(text, special=True) == ref


def test_smollm2_chat_template_and_specials(smol_hf):
    _, _, out = smol_hf
    f = {k: v.contents() for k, v in gguf.GGUFReader(out).fields.items()}
    assert "<|im_start|>" in f["tokenizer.chat_template"]
    assert f["tokenizer.ggml.bos_token_id"] == 1 and f["tokenizer.ggml.eos_token_id"] == 2
    assert f["tokenizer.ggml.add_bos_token"] is False
    assert len(f["tokenizer.ggml.merges"]) > 40000


def test_smollm2_q4_k_m_mix_and_size_match_llama_cpp(smol_hf, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes

    _, hf, f32 = smol_hf
    ours = convert(hf, tmp_path / "ours.gguf", type="q4_k_m")
    theirs = str(tmp_path / "llama.cpp.gguf")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = int(gguf.LlamaFileType.MOSTLY_Q4_K_M), 2
    assert llama_cpp.llama_model_quantize(str(f32).encode(), theirs.encode(), ctypes.byref(p)) == 0
    a = {t.name: t.tensor_type for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: t.tensor_type for t in gguf.GGUFReader(theirs).tensors}
    assert a == b
    assert abs(os.path.getsize(ours) / os.path.getsize(theirs) - 1) < 0.05
    with optiml.Model(ours, n_threads=2) as m:
        assert m.generate("The capital of France is", max_tokens=3, temperature=0).startswith(" Paris")


@pytest.mark.parametrize("arch, tied", [("llama-gqa-tied", False), ("llama-gqa-tied", True), ("phi3-longrope", False)])
def test_quant_mixes_match_llama_quantize(tmp_path, tiny_tokenizer, arch, tied):
    """Per-tensor types of every quantized output type against llama-quantize on the same weights, on a
    model whose rows split into 256-blocks (so the k-quant rules, not the fallbacks, decide) with
    16 layers (so the "more bits" layers show); Phi-3's fused q/k/v takes attn_v's rules."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes

    from optiml.convert.quant_mix import TYPES

    phi3 = dict(rope_scaling={"rope_type": "longrope", "long_factor": [1.0] * 24, "short_factor": [1.0] * 24})
    model = make_model(arch, hidden_size=256, intermediate_size=512, num_hidden_layers=16, num_attention_heads=4,
                       num_key_value_heads=1, tie_word_embeddings=tied, **(phi3 if arch.startswith("phi3") else {}))
    d = save_folder(model, tmp_path / "hf", tiny_tokenizer)
    f32 = convert(d, tmp_path / "f32.gguf", type="f32")
    for name, t in TYPES.items():
        if (not t.kquant_mix and name != "q8_0" or arch.startswith("phi3") and name not in ("q4_k_m", "q5_k_m")
                or tied and name.startswith("iq4")):
            continue  # (Phi-3: the types whose rules its fused q/k/v meets; the slow IQ4 search once)
        ours = convert(d, tmp_path / f"{name}.gguf", type=name)
        theirs = str(tmp_path / f"{name}.llama.cpp.gguf")
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.nthread = int(t.ftype), 2
        assert llama_cpp.llama_model_quantize(str(f32).encode(), theirs.encode(), ctypes.byref(p)) == 0
        a = {x.name: x.tensor_type.name for x in gguf.GGUFReader(ours).tensors}
        b = {x.name: x.tensor_type.name for x in gguf.GGUFReader(theirs).tensors}
        assert a == b, (name, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)})
        assert os.path.getsize(ours) == pytest.approx(os.path.getsize(theirs), rel=0.01)


# ---- tokenizer details --------------------------------------------------------------------------
def test_pre_tokenizer_names():
    digits = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                     {"type": "ByteLevel", "use_regex": True}]}
    assert _pre_tokenizer_name(digits, "t") == "smollm"
    assert _pre_tokenizer_name({"type": "ByteLevel", "use_regex": True}, "t") == "gpt-2"
    for regex, want in ((PT.QWEN2_HF_RE, "qwen2"), (PT.LLAMA3_HF_RE, "llama-bpe")):
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
        assert _pre_tokenizer_name(pre, "t") == want
    for bad in ({"type": "Whitespace"}, {"type": "ByteLevel", "add_prefix_space": True},
                {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False},
                                                       {"type": "ByteLevel"}]}):
        with pytest.raises(ConvertError, match="pre-tokenizer .* supported: GPT-2 byte level \\(gpt-2\\)"):
            _pre_tokenizer_name(bad, "t")


def _hf_pre_tokenizer(entry):
    """A tokenizers pre-tokenizer built from a table entry's steps (so the test covers the table)."""
    from tokenizers import Regex, pre_tokenizers

    steps = []
    for kind, detail in entry.steps:
        if kind == "ByteLevel":
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=detail == "regex"))
        elif kind == "Digits":
            steps.append(pre_tokenizers.Digits(individual_digits=detail == "each"))
        else:
            steps.append(pre_tokenizers.Split(Regex(detail), behavior="isolated", invert=False))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _llama_cpp_split(text, regexes):
    """llama.cpp's splitting: each regex cuts every piece into its matches and the text between them."""
    regex = pytest.importorskip("regex")
    pieces = [text]
    for r in regexes:
        out = []
        for p in pieces:
            pos = 0
            for m in regex.finditer(r, p):
                out += [p[pos:m.start()]] if m.start() > pos else []
                out += [m.group()] if m.end() > m.start() else []
                pos = m.end()
            out += [p[pos:]] if pos < len(p) else []
        pieces = out
    return pieces


PRE_TEXTS = ["Hello world! It's 2024: 12345 + 678 = 13023.\n\n  indented\ttabs   trailing  ",
             "I'M HERE, they'LL go; we'd've\r\n\r\nCafé naïve 東京 émoji 🚀 ١٢٣ x²",
             " leading space\n   \n$$100,000.50 -- (a|b) <tag> __init__"]


@pytest.mark.parametrize("entry", PT.PRE_TOKENIZERS, ids=lambda e: e.name)
def test_pre_tokenizer_table_splits_as_tokenizers_and_llama_cpp(entry, tmp_path):
    """Each table entry: the regexes it says llama.cpp runs split text as the tokenizers pre-tokenizer
    it matches does; a model converted with it loads in llama.cpp (which refuses names it does not know)
    and llama.cpp, OptiML and tokenizers give the same token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf_pre = _hf_pre_tokenizer(entry)
    for text in PRE_TEXTS:
        theirs = [text[a:b] for _, (a, b) in hf_pre.pre_tokenize_str(text)]
        assert _llama_cpp_split(text, entry.regexes) == theirs, text

    llama_cpp = llama_cpp_module()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = hf_pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(PRE_TEXTS * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    d = tmp_path / "hf"
    make_model("llama-gqa-tied").save_pretrained(d)
    fast.save_pretrained(d)
    out = convert(d, tmp_path / "m.gguf", type="f16")
    assert gguf.GGUFReader(out).fields["tokenizer.ggml.pre"].contents() == entry.name
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, verbose=False, n_threads=1)
    with optiml.Model(out, n_ctx=64, n_threads=1) as m:
        for text in PRE_TEXTS + ["The capital of France is 42"]:
            want = fast(text, add_special_tokens=False)["input_ids"]
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == want, text
            assert m.tokenize(text) == want, text
    llm.close()


def test_sentencepiece_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["The capital of France is Paris.", "Numbers 12345 and words."] * 100))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    model = make_model("llama-gqa-tied")
    d = tmp_path / "hf"
    model.save_pretrained(d)
    shutil.copy(tmp_path / "m.model", d / "tokenizer.model")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "add_bos_token": True, "chat_template": "{{ x }}"}))
    out = convert(d, tmp_path / "m.gguf", type="f16")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    f = {k: v.contents() for k, v in gguf.GGUFReader(out).fields.items()}
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.add_space_prefix"] is True
    assert f["tokenizer.ggml.tokens"][:sp.get_piece_size()] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert np.allclose(f["tokenizer.ggml.scores"][:10], [sp.get_score(i) for i in range(10)])
    assert f["tokenizer.chat_template"] == "{{ x }}"
    with optiml.Model(out, n_ctx=64, n_threads=1) as m:
        for text in ["The capital of France is Paris.", "Numbers 987 and ÿ"]:
            assert m.tokenize(text) == [sp.bos_id()] + sp.encode(text)


# ---- bad input ------------------------------------------------------------------------------------
@pytest.fixture
def good(tmp_path, tiny_tokenizer):
    return save_folder(make_model("llama-gqa-tied"), tmp_path / "hf", tiny_tokenizer)


def _header(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _rewrite(path, header, data):
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def _break(kind, d):
    st = d / "model.safetensors"
    if kind == "no-config":
        os.remove(d / "config.json")
    elif kind == "no-weights":
        os.remove(st)
    elif kind == "no-tokenizer":
        os.remove(d / "tokenizer.json")
    elif kind == "truncated":
        st.write_bytes(st.read_bytes()[:-100])
    elif kind == "bad-header":
        raw = st.read_bytes()
        st.write_bytes(raw[:8] + b"{not json" + raw[17:])
    elif kind == "header-too-long":
        st.write_bytes((10**9).to_bytes(8, "little") + st.read_bytes()[8:])
    elif kind == "bad-offsets":
        h, data = _header(st)
        h["model.norm.weight"]["data_offsets"][1] += 4
        _rewrite(st, h, data)
    elif kind == "dtype":
        h, data = _header(st)
        h["model.norm.weight"]["dtype"] = "I32"
        _rewrite(st, h, data)
    elif kind == "shape":
        cfg = json.loads((d / "config.json").read_text())
        cfg["intermediate_size"] = 128
        (d / "config.json").write_text(json.dumps(cfg))
    elif kind == "arch":
        cfg = json.loads((d / "config.json").read_text())
        cfg["architectures"] = ["GPT2LMHeadModel"]
        (d / "config.json").write_text(json.dumps(cfg))
    elif kind == "activation":
        cfg = json.loads((d / "config.json").read_text())
        cfg["hidden_act"] = "gelu"
        (d / "config.json").write_text(json.dumps(cfg))
    elif kind in CONFIG_VALUES:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(CONFIG_VALUES[kind])
        (d / "config.json").write_text(json.dumps(cfg))
    elif kind in TOKENIZER_EDITS:
        tj = json.loads((d / "tokenizer.json").read_text())
        TOKENIZER_EDITS[kind](tj)
        (d / "tokenizer.json").write_text(json.dumps(tj))


CONFIG_VALUES = {  # config.json fields of the wrong type or shape
    "ctx-string": {"max_position_embeddings": "x"},
    "rope-no-factor": {"rope_scaling": {"rope_type": "linear"}},
    "rope-list": {"rope_parameters": [1, 2]},
    "rope-string": {"rope_scaling": "linear"},
}
TOKENIZER_EDITS = {  # tokenizer.json entries of the wrong type or shape
    "added-no-content": lambda tj: tj["added_tokens"][0].pop("content"),
    "added-string-id": lambda tj: tj["added_tokens"][0].update(id="0"),
    "added-dict": lambda tj: tj.update(added_tokens={"a": 1}),
    "vocab-string-id": lambda tj: tj["model"]["vocab"].update({"zz": "5"}),
    "merges-not-pairs": lambda tj: tj["model"].update(merges=[1, 2]),
    "merges-empty": lambda tj: tj["model"].update(merges=[]),
    "processor-junk": lambda tj: tj.update(post_processor={"type": "TemplateProcessing", "single": [{"SpecialToken": 5}]}),
}


BAD = {
    "no-config": "config.json: missing",
    "no-weights": "no model.safetensors",
    "no-tokenizer": "no tokenizer.json or tokenizer.model",
    "truncated": "past the end of the file.*truncated",
    "bad-header": "malformed JSON header",
    "header-too-long": "header length .* does not fit",
    "bad-offsets": "data_offsets",
    "dtype": "dtype I32; supported: F32, F16, BF16",
    "shape": r"mlp.gate_proj.weight has shape \[160, 64\], config.json implies \[128, 64\]",
    "arch": "GPT2LMHeadModel is not supported; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
    "activation": "hidden_act 'gelu' is not supported",
    "ctx-string": "max_position_embeddings = 'x' is not a positive integer",
    "rope-no-factor": "factor is missing",
    "rope-list": r"rope_parameters = \[1, 2\] is not an object",
    "rope-string": "rope_scaling = 'linear' is not an object",
    "added-no-content": "added_tokens is not a list of",
    "added-string-id": "added_tokens is not a list of",
    "added-dict": "added_tokens is not a list of",
    "vocab-string-id": "model.vocab gives token 'zz' the id '5'",
    "merges-not-pairs": "model.merges is not a list of merges",
    "merges-empty": "model.merges is missing or empty",
    "processor-junk": "the tokenizer files: a value of an unexpected type or shape",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_input_is_a_clear_error_and_leaves_nothing(good, tmp_path, kind):
    _break(kind, good)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    with pytest.raises(ConvertError, match=BAD[kind]):
        convert(good, out, type="q8_0")
    assert os.listdir(out.parent) == []


def test_failure_while_writing_leaves_nothing(good, tmp_path, monkeypatch):
    from optiml.convert import writer

    calls = []
    real = writer.encode

    def failing(x, t):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("disk full")
        return real(x, t)

    monkeypatch.setattr(writer, "encode", failing)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    out.write_bytes(b"old")  # an existing output is kept until a new one is complete
    with pytest.raises(RuntimeError, match="disk full"):
        convert(good, out, type="q4_0")
    assert os.listdir(out.parent) == ["m.gguf"] and out.read_bytes() == b"old"


def test_an_output_among_the_checkpoints_files_is_refused(good, tmp_path):
    """The output may sit in the checkpoint's folder, but it may replace only a GGUF file there (an earlier
    conversion), never one of the files being converted."""
    weights = good / "model.safetensors"
    before = weights.read_bytes()
    with pytest.raises(ConvertError, match="a file of the checkpoint being converted"):
        convert(good, weights, type="q8_0")
    assert weights.read_bytes() == before
    assert cli.main(["convert", str(good), "-o", str(good / "config.json"), "-q"]) == 2  # (bad input, as elsewhere)
    # a Hugging Face cache's snapshot: its files are links into the blobs, and renaming over one replaces it
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    os.replace(good / "config.json", blobs / "cfg")
    (good / "config.json").symlink_to(blobs / "cfg")
    with pytest.raises(ConvertError, match="a file of the checkpoint being converted"):
        convert(good, good / "config.json", type="q8_0")
    assert (good / "config.json").is_symlink()
    out = good / "m.gguf"
    convert(good, out, type="q8_0")
    convert(good, out, type="q4_0")  # an earlier output is replaced
    assert gguf.GGUFReader(out).fields["general.file_type"].parts[-1][0] == 2


def test_conversion_warnings(tmp_path, tiny_tokenizer):
    """What converts but deserves a word: a Mistral window shorter than the context (the file's context is
    the window, where full attention is what transformers computes), a ReLU llama (llama.cpp would run it
    with SiLU), tensors config.json's model does not use, f16 overflow; and BOS/EOS from config.json when the
    tokenizer files name none (llama.cpp would take GPT-2's 11)."""
    d = save_folder(make_model("mistral-gqa", sliding_window=8), tmp_path / "mistral", tiny_tokenizer)
    with pytest.warns(UserWarning, match="sliding_window = 8 is shorter than max_position_embeddings = 256"):
        convert(d, tmp_path / "m.gguf")
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["llama.context_length"].parts[-1][0] == 8

    model = make_model("llama-relu")
    d = save_folder(model, tmp_path / "relu", tiny_tokenizer)
    with pytest.warns(UserWarning, match="llama.cpp runs this file with SiLU"):
        convert(d, tmp_path / "r.gguf")

    from safetensors.numpy import load_file, save_file

    t = load_file(d / "model.safetensors")
    t["model.layers.9.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"]
    t["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(bos_token_id=3, eos_token_id=4)
    (d / "config.json").write_text(json.dumps(cfg))
    os.remove(d / "tokenizer_config.json")
    with pytest.warns(UserWarning) as caught:
        convert(d, tmp_path / "u.gguf")
    said = " ".join(str(w.message) for w in caught)
    assert "1 tensors of the checkpoint are not in config.json's model" in said and "layers.9.mlp.up_proj" in said
    assert "blk.0.ffn_down.weight has values beyond f16's range" in said
    f = gguf.GGUFReader(tmp_path / "u.gguf").fields
    assert (f["tokenizer.ggml.bos_token_id"].parts[-1][0], f["tokenizer.ggml.eos_token_id"].parts[-1][0]) == (3, 4)


def test_qwen2_window_is_refused(tmp_path, tiny_tokenizer):
    """Qwen2 windows its layers from max_window_layers on: refused where a layer is windowed, converted where
    none is (transformers then attends to every position too)."""
    d = save_folder(make_model("qwen2-bias", use_sliding_window=True, sliding_window=8, max_window_layers=1),
                    tmp_path / "q", tiny_tokenizer)
    with pytest.raises(ConvertError, match="use_sliding_window = true with a window of 8 positions is not supported"):
        convert(d, tmp_path / "q.gguf")
    d = save_folder(make_model("qwen2-bias", use_sliding_window=True, sliding_window=8, max_window_layers=3),
                    tmp_path / "none", tiny_tokenizer)
    convert(d, tmp_path / "q.gguf")


def test_unknown_type(good, tmp_path):
    with pytest.raises(ConvertError, match="q3_k.*supported: f32, f16, bf16, q8_0"):
        convert(good, tmp_path / "m.gguf", type="q3_k")


def test_cli_convert(good, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert cli.main(["convert", str(good), "-o", str(out), "--type", "Q4_1"]) == 0  # (types in any case)
    assert "wrote" in capsys.readouterr().err
    with optiml.Model(out, n_threads=1) as m:
        assert m.hparams["arch"] == "llama"
    assert cli.main(["convert", str(tmp_path / "nope"), "-o", str(tmp_path / "x.gguf")]) == 2  # bad input
    assert "not a folder" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()
