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
from optiml.convert.tokenizer import _pre_tokenizer_name  # noqa: E402

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


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer of < 300 tokens, saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["The capital of France is Paris. 1234 numbers, and more words here."] * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|im_start|>")
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(d)
    return d


def save_folder(model, folder, tok_dir, **kw):
    model.save_pretrained(folder, **kw)
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), folder)
    return folder


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
    arch = "qwen2" if name.startswith("qwen2") else "llama"
    assert f["general.architecture"] == arch
    assert f["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert f[f"{arch}.block_count"] == 3 and f[f"{arch}.attention.head_count_kv"] == model.config.num_key_value_heads
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt2"
    assert f["tokenizer.ggml.eos_token_id"] == 0 and f["tokenizer.ggml.bos_token_id"] == 1
    assert len(f["tokenizer.ggml.tokens"]) == model.config.vocab_size
    assert f["tokenizer.ggml.token_type"][0] == 3 and f["tokenizer.ggml.tokens"][-1] == "[PAD299]"
    assert f.get("optiml.ffn.activation") == ("relu" if name == "llama-relu" else None)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert ("output.weight" in types) == (not model.config.tie_word_embeddings)
    assert ("rope_freqs.weight" in types) == (name == "llama3-rope")


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


@pytest.mark.parametrize("tied", [False, True])
def test_quant_mixes_match_llama_quantize(tmp_path, tiny_tokenizer, tied):
    """Per-tensor types of every quantized output type against llama-quantize on the same weights, on a
    model whose rows split into 256-blocks (so the k-quant rules, not the fallbacks, decide) with
    16 layers (so the "more bits" layers show)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes

    from optiml.convert.quant_mix import TYPES

    model = make_model("llama-gqa-tied", hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                       num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=tied)
    d = save_folder(model, tmp_path / "hf", tiny_tokenizer)
    f32 = convert(d, tmp_path / "f32.gguf", type="f32")
    for name, t in TYPES.items():
        if not t.kquant_mix and name != "q8_0":
            continue
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
    assert _pre_tokenizer_name({"type": "ByteLevel", "use_regex": True}, "t") == "gpt2"
    for model, want in (("Qwen/Qwen2", "qwen2"), ("meta/llama3", "llama-bpe")):
        from optiml.convert import tokenizer as T

        regex = T._QWEN2_RE if want == "qwen2" else T._LLAMA3_RE
        pre = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": regex}},
                                                     {"type": "ByteLevel", "use_regex": False}]}
        assert _pre_tokenizer_name(pre, "t") == want, model
    with pytest.raises(ConvertError, match="pre-tokenizer"):
        _pre_tokenizer_name({"type": "Whitespace"}, "t")


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


def test_unknown_type(good, tmp_path):
    with pytest.raises(ConvertError, match="q3_k.*supported: f32, f16, bf16, q8_0"):
        convert(good, tmp_path / "m.gguf", type="q3_k")


def test_cli_convert(good, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert cli.main(["convert", str(good), "-o", str(out), "--type", "q4_1"]) == 0
    assert "wrote" in capsys.readouterr().err
    with optiml.Model(out, n_threads=1) as m:
        assert m.hparams["arch"] == "llama"
    assert cli.main(["convert", str(tmp_path / "nope"), "-o", str(tmp_path / "x.gguf")]) == 1
    assert "not a folder" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()
