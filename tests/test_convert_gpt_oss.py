"""optiml.convert on gpt-oss (issue #46): tiny random GptOssForCausalLM checkpoints, in the fused float form
transformers' save_pretrained writes and in OpenAI's MXFP4 form (blocks and scales, as the released models
ship), converted and checked against transformers' float32 logits, against llama.cpp (llama-cpp-python) on
the same file, against transformers' own MXFP4 dequantizer bit for bit, and read back with gguf-py."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip("transformers has no GptOssForCausalLM (4.55 or later)", allow_module_level=True)

import gguf  # noqa: E402

import optiml  # noqa: E402
from optiml.convert import ConvertError, convert  # noqa: E402
from optiml.convert.pre_tokenizers import GPT4O_HF_RE  # noqa: E402

from fidelity import TIE, top2_gap  # noqa: E402
from test_convert import save_folder  # noqa: E402
from test_convert_moe import IDS, engines_on, hf_logits, kld, llama_cpp_logits  # noqa: E402
from test_model_hf import rel_err  # noqa: E402

E, D, F, HEADS, WINDOW = 4, 64, 32, 4, 8


def make_model(seed=0, truncate=True, orig_ctx=4096, **over):
    """Two layers (the first with a window of 8, shorter than the 40 test tokens), 4 experts of 32 (top 2),
    YaRN (factor 32 over 4096 positions, as released; truncate=False is the released config's)."""
    cfg = transformers.GptOssConfig(**{**dict(
        vocab_size=300, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
        head_dim=16, intermediate_size=F, num_local_experts=E, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=131072, rms_norm_eps=1e-5, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=orig_ctx, truncate=truncate)), **over})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves biases ~0, norms 1, routers and logits too flat to rank
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or n.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
            elif "embed_tokens" in n or "lm_head" in n or "router" in n:
                p.mul_(10.0)
            elif "experts" in n:
                p.mul_(5.0)
    return model


def route_gap(model, ids) -> float:
    """The smallest margin of a token's 2nd expert over its 3rd, over tokens and layers (transformers' pass)."""
    gaps = []

    def hook(_router, _args, out):
        top = torch.sort(out[0], dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -3]).min()))

    handles = [layer.mlp.router.register_forward_hook(hook) for layer in model.model.layers]
    try:
        hf_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


@pytest.fixture(scope="module")
def o200k_tokenizer(tmp_path_factory):
    """A byte-level BPE behind gpt-oss's pre-tokenizer (o200k's split, then bytes), saved as transformers does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GPT4O_HF_RE), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>", "<|start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["The capital of France is Paris. camelCase HTTPServer don't WE'LL a/b\n/c 12345."] * 50,
                            trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    d = tmp_path_factory.mktemp("o200k")
    fast.save_pretrained(d)
    return d


SEED = 4  # route_gap 0.036 (0.02 or less for seeds 0-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, o200k_tokenizer):
    model = make_model(SEED)
    assert route_gap(model, IDS) > 0.02  # routing decided: a flip would be O(1) in the logits
    return model, save_folder(model, tmp_path_factory.mktemp("oss") / "hf", o200k_tokenizer)


def test_f32_matches_transformers_and_llama_cpp(tiny, tmp_path):
    model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type="f32")
    ref = hf_logits(model, IDS)
    with optiml.Model(out, n_ctx=64, n_threads=2, kv_type="f32") as m:
        h = m.hparams
        ours = m.eval(IDS, all_logits=True)
    assert (h["arch"], h["n_expert"], h["n_expert_used"], h["n_ff_exp"]) == ("gpt-oss", E, 2, F)
    assert rel_err(ours, ref) < 1e-5  # measured 4e-7
    assert kld(ref, llama_cpp_logits(out, IDS)) < 1e-7  # measured 4e-10


# KLD against transformers' float32 logits: q8_0 rounds every matrix; mxfp4_moe the experts to 4 bits (and
# the rest to 8): measured 3.1e-4 and 4.1e-2 (these random experts are large, ~5x transformers' init). Ours
# against llama.cpp on the same file: rounding of the sums only.
KLD_MAX = {"q8_0": 1e-3, "mxfp4_moe": 8e-2}


@pytest.mark.parametrize("qtype", list(KLD_MAX))
def test_quantized_types_agree_with_llama_cpp(tiny, tmp_path, qtype):
    model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type=qtype)
    ref = hf_logits(model, IDS)
    ours, theirs, k_ours, k_theirs = engines_on(out, ref, f"gpt-oss {qtype}")
    assert k_ours < KLD_MAX[qtype] and k_ours <= 1.1 * k_theirs + 1e-6, (k_ours, k_theirs)
    assert kld(theirs, ours) < 1e-5
    decided = (top2_gap(ours) > TIE) & (top2_gap(theirs) > TIE)
    assert (ours.argmax(1) == theirs.argmax(1))[decided].all()
    if qtype == "q8_0":  # (4-bit experts move some of transformers' top tokens: both engines alike)
        decided &= top2_gap(ref) > TIE
        assert decided.sum() >= len(IDS) // 2 and (ours.argmax(1) == ref.argmax(1))[decided].all()


def test_yarn_without_truncation_differs_as_llama_cpp_does(tmp_path, o200k_tokenizer):
    """The released config's truncate = false leaves YaRN's correction range unrounded; GGUF has no key for it
    and llama.cpp always rounds it, as OptiML does on the file: both engines then differ from transformers
    by the same small amount (relative 4e-6 at 40 positions here)."""
    model = make_model(SEED, truncate=False)
    out = convert(save_folder(model, tmp_path / "hf", o200k_tokenizer), tmp_path / "m.gguf", type="f32")
    ref = hf_logits(model, IDS)
    with optiml.Model(out, n_ctx=64, n_threads=2, kv_type="f32") as m:
        ours = m.eval(IDS, all_logits=True)
    assert 1e-6 < rel_err(ours, ref) < 1e-4
    assert kld(llama_cpp_logits(out, IDS), ours) < 1e-7


# ---- OpenAI's MXFP4 checkpoints ---------------------------------------------------------------------
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)  # E2M1 magnitudes; code bit 3 is the sign


def openai_mxfp4(w: np.ndarray):
    """w [..., rows, K] as OpenAI's blocks [..., rows, K/32, 16] and E8M0 scales [..., rows, K/32]: element
    2j of a block in byte j's low nibble, 2j+1 in its high one; each block scaled so its largest fits 6."""
    b = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(b).max(-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    x = b / np.exp2(e)[..., None]
    codes = np.abs(np.abs(x)[..., None] - FP4).argmin(-1).astype(np.uint8) | np.where(x < 0, 8, 0).astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (e + 127).astype(np.uint8)


def save_mxfp4_checkpoint(model, folder, tok_dir):
    """The model's experts as OpenAI ships them, written beside its other tensors; the model's experts are
    replaced by transformers' own dequantization of those blocks (the oracle's weights)."""
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    os.makedirs(folder)
    model.config.architectures = ["GptOssForCausalLM"]
    model.config.save_pretrained(folder)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().numpy()
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            blocks, scales = openai_mxfp4(np.ascontiguousarray(v.transpose(0, 2, 1)))  # (in, out) -> rows
            tensors[k + "_blocks"], tensors[k + "_scales"] = blocks, scales
            deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            with torch.no_grad():
                model.get_parameter(k).copy_(deq)
        else:
            tensors[k] = np.ascontiguousarray(v)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), folder)
    return folder


@pytest.fixture(scope="module")
def mxfp4_ckpt(tmp_path_factory, o200k_tokenizer):
    model = make_model(SEED)
    d = save_mxfp4_checkpoint(model, tmp_path_factory.mktemp("oss-mxfp4") / "hf", o200k_tokenizer)
    assert route_gap(model, IDS) > 0.02
    return model, d


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_mxfp4_checkpoint_experts_copied_bit_for_bit(mxfp4_ckpt, tmp_path, qtype):
    """Whatever the output type, the experts stay MXFP4 and dequantize (gguf-py) to exactly the weights
    transformers' MXFP4 dequantizer gives; the rest takes the output type; the logits match transformers'
    as far as the engines' 8-bit activations in the MXFP4 products allow, and llama.cpp's."""
    model, d = mxfp4_ckpt
    out = convert(d, tmp_path / "m.gguf", type=qtype)
    t = {x.name: x for x in gguf.GGUFReader(out).tensors}
    sd = model.state_dict()
    for il in range(2):
        gate_up = sd[f"model.layers.{il}.mlp.experts.gate_up_proj"].numpy().transpose(0, 2, 1)  # [E, 2F, D]
        down = sd[f"model.layers.{il}.mlp.experts.down_proj"].numpy().transpose(0, 2, 1)  # [E, D, F]
        for name, want in (("gate", gate_up[:, 0::2]), ("up", gate_up[:, 1::2]), ("down", down)):
            x = t[f"blk.{il}.ffn_{name}_exps.weight"]
            assert x.tensor_type == gguf.GGMLQuantizationType.MXFP4
            got = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type).reshape(want.shape)
            assert np.array_equal(got, want), (il, name)
        assert t[f"blk.{il}.attn_q.weight"].tensor_type.name == qtype.upper()
    ours, theirs, k_ours, k_theirs = engines_on(out, hf_logits(model, IDS), f"gpt-oss MXFP4 checkpoint, {qtype}")
    assert k_ours < KLD_MAX["q8_0"] and k_ours <= 1.1 * k_theirs + 1e-6
    assert kld(theirs, ours) < 1e-5


# ---- the file as llama.cpp's converter writes it ------------------------------------------------------
def test_names_shapes_and_metadata_follow_llama_cpp(tiny, tmp_path):
    model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type="f16")
    r = gguf.GGUFReader(out)
    f = {k: v.contents() for k, v in r.fields.items()}
    a = "gpt-oss"
    assert f["general.architecture"] == a and f["tokenizer.ggml.pre"] == "gpt-4o"
    assert (f[f"{a}.expert_count"], f[f"{a}.expert_used_count"], f[f"{a}.expert_feed_forward_length"]) == (E, 2, F)
    assert (f[f"{a}.attention.sliding_window"], f[f"{a}.attention.key_length"]) == (WINDOW, 16)
    assert (f[f"{a}.rope.scaling.type"], f[f"{a}.rope.scaling.factor"]) == ("yarn", 32.0)
    assert (f[f"{a}.rope.scaling.original_context_length"], f[f"{a}.rope.freq_base"]) == (4096, 150000.0)
    assert not any("yarn_beta" in k for k in f)  # llama.cpp's defaults (32, 1)
    t = {x.name: (x.tensor_type.name, [int(n) for n in x.shape]) for x in r.tensors}  # shape as ggml's ne
    want = {"attn_sinks.weight": ("F32", [HEADS]), "attn_q.bias": ("F32", [64]), "attn_output.bias": ("F32", [D]),
            "post_attention_norm.weight": ("F32", [D]), "ffn_gate_inp.weight": ("F32", [D, E]),
            "ffn_gate_inp.bias": ("F32", [E]), "ffn_gate_exps.weight": ("F16", [D, F, E]),
            "ffn_up_exps.weight": ("F16", [D, F, E]), "ffn_down_exps.weight": ("F16", [F, D, E]),
            "ffn_gate_exps.bias": ("F32", [F, E]), "ffn_up_exps.bias": ("F32", [F, E]),
            "ffn_down_exps.bias": ("F32", [D, E])}
    for il in range(2):
        layer = {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"blk.{il}.")}
        assert {k: layer.get(k) for k in want} == want, il
        assert "ffn_norm.weight" not in layer
    # the gate at even and the up at odd columns of the fused tensor; their biases likewise
    x = {n.name: np.array(n.data) for n in r.tensors if n.name.startswith("blk.1.ffn_")}
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    bias = model.model.layers[1].mlp.experts.gate_up_proj_bias.detach().numpy()
    for name, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
        assert np.array_equal(x[f"blk.1.ffn_{name}_exps.weight"], gate_up[:, :, cols].transpose(0, 2, 1).astype(np.float16))
        assert np.array_equal(x[f"blk.1.ffn_{name}_exps.bias"], bias[:, cols])


def test_o200k_tokenizer_matches_transformers_and_llama_cpp(tiny, tmp_path):
    model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type="f16")
    hf = transformers.AutoTokenizer.from_pretrained(d)
    texts = ["The capital of France is Paris.", "camelCase HTTPServer don't WE'LL", "a/b\n/c 1234567 x"]
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(out), n_ctx=64, vocab_only=True, verbose=False)
    try:
        with optiml.Model(out, n_ctx=64) as m:
            for text in texts:
                want = hf.encode(text, add_special_tokens=False)
                assert m.tokenize(text, add_bos=False) == want, text
                assert llm.tokenize(text.encode(), add_bos=False) == want, text  # ASCII: llama.cpp splits alike
    finally:
        llm.close()


# ---- what is refused ---------------------------------------------------------------------------------
REFUSED = [
    ("swiglu_limit", 5.0, "swiglu_limit = 5.0 is not supported"),
    ("swiglu_alpha", 1.0, "swiglu_alpha = 1.0 is not supported"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types is not sliding_attention on even layers"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 150000.0}, "gpt-oss needs YaRN RoPE scaling"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 150000.0}, "factor is missing"),
    ("num_experts_per_tok", 5, "num_experts_per_tok = 5 is more than the 4 experts"),
    ("attention_bias", False, "attention_bias = false is not supported"),
    ("sliding_window", None, "sliding_window is missing"),
    ("intermediate_size", 48, r"gate_up_proj has shape \[4, 64, 64\], config.json implies \[4, 64, 96\]"),
]


def edited_copy(src, dst, edit):
    """A copy of the checkpoint folder src at dst (its files linked) whose config.json is edit(config)."""
    dst.mkdir()
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(src / f, dst / f)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("key,value,message", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_unsupported_configs_are_refused(tiny, tmp_path, key, value, message):
    def edit(cfg):
        cfg[key] = value
        if key == "rope_parameters":
            cfg.pop("rope_scaling", None)

    d = edited_copy(tiny[1], tmp_path / "hf", edit)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConvertError, match=message):
        convert(d, out / "m.gguf", type="f16")
    assert os.listdir(out) == []


def test_mxfp4_blocks_of_a_float_type_are_refused(tmp_path, o200k_tokenizer):
    from safetensors.numpy import load_file, save_file

    d = save_mxfp4_checkpoint(make_model(SEED), tmp_path / "hf", o200k_tokenizer)
    t = load_file(os.path.join(d, "model.safetensors"))
    k = "model.layers.0.mlp.experts.down_proj_scales"
    t[k] = t[k].astype(np.float32)
    save_file(t, os.path.join(d, "model.safetensors"))
    with pytest.raises(ConvertError, match="down_proj_scales is F32, bytes \\(U8\\) expected"):
        convert(d, tmp_path / "m.gguf", type="f16")


def test_released_config_form_converts_alike(tiny, tmp_path):
    """The released config.json spells RoPE as transformers 4 did (rope_theta beside rope_scaling) and
    carries a quantization_config: the same file comes out as from transformers 5's rope_parameters."""
    def edit(cfg):
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}

    src = tiny[1]
    d = edited_copy(src, tmp_path / "hf", edit)
    a = convert(src, tmp_path / "a.gguf", type="f16", name="x")
    b = convert(d, tmp_path / "b.gguf", type="f16", name="x")
    assert open(a, "rb").read() == open(b, "rb").read()
