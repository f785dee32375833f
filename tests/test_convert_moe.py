"""optiml.convert on mixtures of experts (issue #46 item 4): tiny random Qwen3MoE, Qwen2MoE and Mixtral
checkpoints (save_pretrained, safetensors) converted and checked three ways: OptiML's logits against
transformers' float32 ones; llama.cpp (llama-cpp-python) running the same file; and the file itself read
with gguf-py (llama.cpp's names, 3-D expert shapes, metadata keys, and llama-quantize's per-tensor mix)."""

from __future__ import annotations

import ctypes
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402

import optiml  # noqa: E402
from optiml.convert import ConvertError, convert  # noqa: E402
from optiml.evaluate import perplexity as px  # noqa: E402

from fidelity import TIE, top2_gap  # noqa: E402
from conftest import llama_cpp_module  # noqa: E402
from test_convert import save_folder, tiny_tokenizer  # noqa: E402, F401 (a fixture)
from test_model_hf import rel_err  # noqa: E402

BASE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
CONFIGS = {
    # 8 experts of 32, top 2 renormalized, per-head q/k norms, a head_dim (32) that is not hidden / heads (16)
    "qwen3moe": ("Qwen3MoeForCausalLM", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                             num_experts_per_tok=2, head_dim=32, norm_topk_prob=True)),
    # 8 experts of 32, top 3 not renormalized, a shared expert of 48 behind its sigmoid gate, q/k/v biases
    "qwen2moe": ("Qwen2MoeForCausalLM", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                             num_experts_per_tok=3, shared_expert_intermediate_size=48)),
    # llama with 4 experts of intermediate_size, top 2; q/k rows permuted as llama's
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=None)),
}
ARCH = {"qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "mixtral": "llama"}
IDS = [(i * 7919) % 290 + 5 for i in range(40)]
# Seeds whose routers have no near-tie on IDS (route_gap > 0.02; q8_0 moves router logits by ~0.005).
SEEDS = {"qwen3moe": 6, "qwen2moe": 3, "mixtral": 1}


def make_model(name, seed=0, **over):
    cls, extra = CONFIGS[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**{**BASE, **extra, **over})
    model = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():  # random init leaves biases ~0, norms 1, routers and logits too flat to rank
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
            elif "embed_tokens" in n or "lm_head" in n or n.endswith("gate.weight"):
                p.mul_(10.0)  # (the routers: mlp.gate, block_sparse_moe.gate, shared_expert_gate)
    return model


def route_gap(model, ids) -> float:
    """The smallest margin, over tokens and layers, of a token's k-th expert over its (k+1)-th in
    transformers' float32 pass: far above rounding, so every engine must route as transformers does."""
    k, gaps = model.config.num_experts_per_tok, []

    def hook(block, args, _out):
        h = args[0].reshape(-1, args[0].shape[-1])
        top = torch.sort(h @ block.gate.weight.T, dim=-1).values
        gaps.append(float((top[:, -k] - top[:, -k - 1]).min()))

    blocks = [layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe for layer in model.model.layers]
    handles = [b.register_forward_hook(hook) for b in blocks]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def kld(ref, logits):
    return float(px.token_stats(px.log_softmax(ref), px.log_softmax(logits))["kld"].mean())


def llama_cpp_logits(path, ids):
    llama_cpp = llama_cpp_module()
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, n_threads_batch=2, logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        return np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def engines_on(path, ref, label, **kw):
    """OptiML's and llama.cpp's logits of IDS on the file at `path`, and their KL divergences from
    transformers' `ref` (printed, with the two engines' from each other): ours, theirs, k_ours, k_theirs."""
    with optiml.Model(path, n_ctx=64, n_threads=2, **kw) as m:
        ours = m.eval(IDS, all_logits=True)
    theirs = llama_cpp_logits(path, IDS)
    k_ours, k_theirs = kld(ref, ours), kld(ref, theirs)
    print(f"{label}: KLD against transformers ours {k_ours:.3e}, llama.cpp {k_theirs:.3e}, "
          f"ours against llama.cpp {kld(theirs, ours):.3e}")
    return ours, theirs, k_ours, k_theirs


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory, tiny_tokenizer):  # noqa: F811
    model = make_model(request.param, seed=SEEDS[request.param])
    d = save_folder(model, tmp_path_factory.mktemp(request.param) / "hf", tiny_tokenizer)
    assert route_gap(model, IDS) > 0.02  # routing decided: a flip would be O(1) in the logits
    return request.param, model, d


# ---- against transformers and llama.cpp -------------------------------------------------------------
def test_f32_logits_match_transformers(tiny, tmp_path):
    name, model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type="f32")
    ref = hf_logits(model, IDS)
    with optiml.Model(out, n_ctx=64, n_threads=2, kv_type="f32") as m:
        h = m.hparams
        ours = m.eval(IDS, all_logits=True)
    cfg = model.config
    n_expert = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    assert (h["n_expert"], h["n_expert_used"]) == (n_expert, cfg.num_experts_per_tok)
    assert h["n_ff_exp"] == getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)
    assert h["n_ff_shexp"] == getattr(cfg, "shared_expert_intermediate_size", 0)
    assert rel_err(ours, ref) < 1e-4, name


# KLD of each engine against transformers' float32 logits: f32 is rounding only (measured 3e-9); f16
# and q8_0 round the weights (2e-7 and 1.5e-4 on these models). The two engines on the same file: 1e-9.
KLD_MAX = {"f32": 1e-7, "f16": 2e-6, "q8_0": 1e-3}


@pytest.mark.parametrize("qtype", list(KLD_MAX))
def test_llama_cpp_runs_converted_files(tiny, tmp_path, qtype):
    """llama.cpp loads each output type and computes what OptiML computes on it; both are as close to
    transformers as the type's rounding allows, and pick transformers' top token wherever it is decided."""
    name, model, d = tiny
    out = convert(d, tmp_path / "m.gguf", type=qtype)
    ref = hf_logits(model, IDS)
    ours, theirs, k_ours, k_theirs = engines_on(out, ref, f"{name} {qtype}")
    assert k_ours < KLD_MAX[qtype] and k_theirs < KLD_MAX[qtype], (name, qtype, k_ours, k_theirs)
    assert kld(theirs, ours) < 1e-6, (name, qtype)
    decided = (top2_gap(ref) > TIE) & (top2_gap(ours) > TIE) & (top2_gap(theirs) > TIE)
    assert decided.sum() >= len(IDS) // 2
    assert (ours.argmax(1) == ref.argmax(1))[decided].all() and (theirs.argmax(1) == ref.argmax(1))[decided].all()


def test_mxfp4_moe(tiny, tmp_path, tiny_tokenizer):  # noqa: F811
    """mxfp4_moe (llama-quantize's MXFP4_MOE): the experts MXFP4, the other matrices Q8_0 (the output too),
    routers and vectors F32; llama.cpp computes what OptiML
    computes on the file, both as close to transformers as 4-bit experts allow, and both pick transformers'
    top token wherever it is decided."""
    name, model, d = tiny
    if name == "qwen2moe":  # a shared expert of 48 does not split into Q8_0 blocks: refused, as llama-quantize does
        with pytest.raises(ConvertError, match="row length 48 does not split into Q8_0 blocks"):
            convert(d, tmp_path / "m48.gguf", type="mxfp4_moe")
        model = make_model(name, seed=1, shared_expert_intermediate_size=64)  # seed 1: route_gap 0.028
        assert route_gap(model, IDS) > 0.02
        d = save_folder(model, tmp_path / "hf", tiny_tokenizer)
    out = convert(d, tmp_path / "m.gguf", type="mxfp4_moe")
    r = gguf.GGUFReader(out)
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    for t in r.tensors:
        want = ("MXFP4" if len(t.shape) == 3 else
                "F32" if len(t.shape) == 1 or t.name.endswith("ffn_gate_inp.weight") else "Q8_0")
        assert t.tensor_type.name == want, (t.name, t.tensor_type.name)
    ref = hf_logits(model, IDS)
    ours, theirs, k_ours, k_theirs = engines_on(out, ref, f"{name} mxfp4_moe")
    assert k_ours <= 1.1 * k_theirs + 1e-6, (name, k_ours, k_theirs)
    assert kld(theirs, ours) < 1e-5, name
    decided = (top2_gap(ref) > TIE) & (top2_gap(ours) > TIE) & (top2_gap(theirs) > TIE)
    assert decided.sum() >= len(IDS) // 2
    assert (ours.argmax(1) == ref.argmax(1))[decided].all() and (theirs.argmax(1) == ref.argmax(1))[decided].all()


# ---- the file as llama.cpp's converter writes it ------------------------------------------------------
def test_names_shapes_and_metadata_follow_llama_cpp(tiny, tmp_path):
    name, model, d = tiny
    cfg, arch = model.config, ARCH[name]
    out = convert(d, tmp_path / "m.gguf", type="f16")
    r = gguf.GGUFReader(out)
    f = {k: v.contents() for k, v in r.fields.items()}
    t = {x.name: (x.tensor_type.name, [int(n) for n in x.shape]) for x in r.tensors}  # shape as ggml's ne

    E, D = f[f"{arch}.expert_count"], cfg.hidden_size
    F = getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)
    S = getattr(cfg, "shared_expert_intermediate_size", 0)
    assert f["general.architecture"] == arch and f["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert E == (getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    assert f[f"{arch}.expert_used_count"] == cfg.num_experts_per_tok
    assert f[f"{arch}.feed_forward_length"] == cfg.intermediate_size
    # llama.cpp writes the experts' width for the Qwen MoEs (Mixtral's is feed_forward_length), the
    # shared expert's for qwen2moe, head_dim as key/value length where config.json gives it, and no
    # expert_weights_norm (each architecture's graph fixes it)
    assert f.get(f"{arch}.expert_feed_forward_length") == (None if name == "mixtral" else F)
    assert f.get(f"{arch}.expert_shared_feed_forward_length") == (S or None)
    assert f.get(f"{arch}.attention.key_length") == (32 if name == "qwen3moe" else None)
    assert not any("expert_weights" in k or "expert_gating" in k for k in f)

    want = {"ffn_gate_inp.weight": ("F32", [D, E]), "ffn_gate_exps.weight": ("F16", [D, F, E]),
            "ffn_up_exps.weight": ("F16", [D, F, E]), "ffn_down_exps.weight": ("F16", [F, D, E]),
            "ffn_norm.weight": ("F32", [D])}
    if S:
        want.update({"ffn_gate_inp_shexp.weight": ("F32", [D]), "ffn_gate_shexp.weight": ("F16", [D, S]),
                     "ffn_up_shexp.weight": ("F16", [D, S]), "ffn_down_shexp.weight": ("F16", [S, D])})
    if name == "qwen3moe":
        want.update({"attn_q_norm.weight": ("F32", [32]), "attn_k_norm.weight": ("F32", [32])})
    for il in range(cfg.num_hidden_layers):
        layer = {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"blk.{il}.")}
        assert {k: layer.get(k) for k in want} == want, (name, il)
        assert not {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"} & layer.keys()
        assert ("attn_q.bias" in layer) == (name == "qwen2moe")
    assert t["output.weight"] == ("F16", [D, cfg.vocab_size])


def test_experts_stacked_in_order_and_mixtral_permuted(tmp_path, tiny_tokenizer):  # noqa: F811
    """Expert j of layer i is slice j of the 3-D tensor, bit for bit; Mixtral's q/k rows are permuted
    for llama's rotation (adjacent pairs), its w1/w3/w2 are gate/up/down."""
    from optiml.convert.hf_config import permute_qk

    model = make_model("mixtral", seed=2)
    out = convert(save_folder(model, tmp_path / "hf", tiny_tokenizer), tmp_path / "m.gguf", type="f32")
    t = {x.name: np.array(x.data) for x in gguf.GGUFReader(out).tensors}
    layer = model.model.layers[1]
    moe = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
    sd = {k: v.numpy() for k, v in moe.state_dict().items()}
    for dst, src in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        for j in range(4):
            hf = sd.get(f"experts.{j}.{src}.weight")
            if hf is None:  # transformers 5 holds the experts fused in memory (and saves them one by one)
                hf = _fused_expert(sd, j, dst)
            assert np.array_equal(t[f"blk.1.ffn_{dst}_exps.weight"][j], hf), (dst, j)
    q = layer.self_attn.q_proj.weight.detach().numpy()
    assert np.array_equal(t["blk.1.attn_q.weight"], permute_qk(q, 4))


def _fused_expert(sd, j, which):
    if which == "down":
        return sd["experts.down_proj"][j]
    gate_up = sd["experts.gate_up_proj"][j]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if which == "gate" else gate_up[half:]


def test_quant_mix_matches_llama_quantize(tmp_path, tiny_tokenizer):  # noqa: F811
    """Q4_K_M of an 8-expert model with a shared expert: llama-quantize's MoE rules (attn_k and attn_v
    Q8_0 and attn_output Q5_K at 8 experts, more bits for ffn_down_exps / ffn_down_shexp in the first,
    last and every third layer, the router kept F32) on rows that split into 256-blocks; and MXFP4_MOE's."""
    llama_cpp = llama_cpp_module()
    model = make_model("qwen2moe", hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1,
                       intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256)
    d = save_folder(model, tmp_path / "hf", tiny_tokenizer)
    f32 = convert(d, tmp_path / "f32.gguf", type="f32")
    ours = convert(d, tmp_path / "q4_k_m.gguf", type="q4_k_m")
    theirs = str(tmp_path / "llama.cpp.gguf")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = int(gguf.LlamaFileType.MOSTLY_Q4_K_M), 2
    assert llama_cpp.llama_model_quantize(str(f32).encode(), theirs.encode(), ctypes.byref(p)) == 0
    a = {x.name: x.tensor_type.name for x in gguf.GGUFReader(ours).tensors}
    b = {x.name: x.tensor_type.name for x in gguf.GGUFReader(theirs).tensors}
    assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    assert (a["blk.0.attn_k.weight"], a["blk.0.attn_output.weight"], a["blk.0.ffn_gate_inp.weight"]) == \
        ("Q8_0", "Q5_K", "F32")
    assert (a["blk.0.ffn_down_exps.weight"], a["blk.1.ffn_down_exps.weight"]) == ("Q6_K", "Q4_K")
    assert os.path.getsize(ours) == pytest.approx(os.path.getsize(theirs), rel=0.01)
    # MXFP4_MOE: every expert tensor MXFP4, the other matrices Q8_0 (the output too), the routers F32.
    ours = convert(d, tmp_path / "mxfp4_moe.gguf", type="mxfp4_moe")
    p.ftype = int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    assert llama_cpp.llama_model_quantize(str(f32).encode(), theirs.encode(), ctypes.byref(p)) == 0
    a = {x.name: x.tensor_type.name for x in gguf.GGUFReader(ours).tensors}
    b = {x.name: x.tensor_type.name for x in gguf.GGUFReader(theirs).tensors}
    assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    assert (a["blk.0.ffn_up_exps.weight"], a["blk.0.ffn_down_shexp.weight"], a["output.weight"]) == \
        ("MXFP4", "Q8_0", "Q8_0")
    assert os.path.getsize(ours) == pytest.approx(os.path.getsize(theirs), rel=0.01)


def test_tied_qwen2moe_gets_an_output_copy(tmp_path, tiny_tokenizer):  # noqa: F811
    """llama.cpp's qwen2moe requires output.weight: a tied checkpoint (no lm_head) gets the embeddings'
    copy, so both engines load it and agree with transformers."""
    model = make_model("qwen2moe", seed=1, tie_word_embeddings=True)
    out = convert(save_folder(model, tmp_path / "hf", tiny_tokenizer), tmp_path / "m.gguf", type="f32")
    t = {x.name: np.array(x.data) for x in gguf.GGUFReader(out).tensors}
    assert np.array_equal(t["output.weight"], t["token_embd.weight"])
    ref = hf_logits(model, IDS)
    with optiml.Model(out, n_ctx=64, n_threads=2, kv_type="f32") as m:
        assert rel_err(m.eval(IDS, all_logits=True), ref) < 1e-4
    assert kld(ref, llama_cpp_logits(out, IDS)) < 1e-7


# ---- what is refused ---------------------------------------------------------------------------------
REFUSED = [
    ("qwen3moe", "norm_topk_prob", False, "norm_topk_prob = False is not supported for Qwen3MoeForCausalLM"),
    ("qwen2moe", "norm_topk_prob", True, "norm_topk_prob = True is not supported for Qwen2MoeForCausalLM"),
    ("qwen2moe", "decoder_sparse_step", 2, "decoder_sparse_step = 2 is not supported"),
    ("qwen3moe", "mlp_only_layers", [1], r"mlp_only_layers = \[1\] is not supported"),
    ("qwen2moe", "use_sliding_window", True, "use_sliding_window = true is not supported"),
    ("qwen3moe", "num_experts_per_tok", 9, "num_experts_per_tok = 9 is more than the 8 experts"),
    ("mixtral", "num_local_experts", 0, "num_local_experts = 0 is not a positive integer"),
    ("mixtral", "hidden_act", "relu", "hidden_act 'relu' is not supported for a mixture of experts"),
    ("qwen2moe", "shared_expert_intermediate_size", None, "shared_expert_intermediate_size is missing"),
    ("qwen3moe", "moe_intermediate_size", 48,
     r"experts.0.gate_proj.weight has shape \[32, 64\], config.json implies \[48, 64\]"),
    ("mixtral", "num_local_experts", 5,
     r"block_sparse_moe.gate.weight has shape \[4, 64\], config.json implies \[5, 64\]"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer):  # noqa: F811
    root = tmp_path_factory.mktemp("refused")
    return {n: save_folder(make_model(n), root / n, tiny_tokenizer) for n in CONFIGS}


@pytest.mark.parametrize("name,key,value,message", REFUSED, ids=[f"{r[0]}-{r[1]}-{r[2]}" for r in REFUSED])
def test_unsupported_configs_are_refused(folders, tmp_path, name, key, value, message):
    d = tmp_path / "hf"
    d.mkdir()
    for f in os.listdir(folders[name]):
        os.symlink(folders[name] / f, d / f)
    cfg = json.loads((folders[name] / "config.json").read_text())
    if value is None:
        cfg.pop(key)
    else:
        cfg[key] = value
    os.remove(d / "config.json")
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConvertError, match=message):
        convert(d, out / "m.gguf", type="f16")
    assert os.listdir(out) == []


def test_mixtral_window_sets_the_context(folders, tmp_path):
    """A Mixtral sliding_window shorter than the context: both engines attend to every position, which is
    transformers' window up to its length, so the file's context is the window (with a warning)."""
    import gguf

    d = tmp_path / "hf"
    d.mkdir()
    for f in os.listdir(folders["mixtral"]):
        if f != "config.json":
            os.symlink(folders["mixtral"] / f, d / f)
    cfg = json.loads((folders["mixtral"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    with pytest.warns(UserWarning, match="sliding_window = 64 is shorter than max_position_embeddings"):
        convert(d, tmp_path / "m.gguf", type="f16")
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["llama.context_length"].parts[-1][0] == 64


def test_fused_expert_tensors_are_refused(tmp_path):
    from optiml.convert import hf_config, moe

    c = hf_config.ModelConfig(hf_arch=moe.QWEN3MOE, arch="qwen3moe", permute_qk=False, n_vocab=300, n_embd=64,
                              n_ff=96, n_layer=1, n_head=4, n_head_kv=2, head_dim=16, n_ctx=256, rms_eps=1e-6,
                              rope_theta=1e4, n_expert=8, n_expert_used=2, n_ff_exp=32)
    with pytest.raises(ConvertError, match="experts.gate_up_proj: fused expert tensors are not supported"):
        hf_config.tensor_plan(c, {"model.layers.0.mlp.experts.gate_up_proj"})
