"""Gemma 2: tiny random transformers models converted by `optiml convert` (soft-capped attention scores and
logits, sliding and global layers alternating, context past the window) against transformers in float32;
llama.cpp runs the converted files (tests/test_convert.py's arch_folder); the GPU's run against the CPU's
(tests/test_cuda.py)."""

import numpy as np
import pytest

from optiml import _core

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402

from optiml.convert import ConvertError, convert  # noqa: E402
from test_convert import save_folder, tiny_tokenizer  # noqa: E402,F401  (a module fixture)
from test_model_hf import check_logits_match_transformers, check_token_by_token_equals_one_batch, rel_err  # noqa: E402

# Caps far below Gemma 2's 50 and 30, so that a tiny random model's scores and logits reach them (a test
# that passes with the caps left out checks nothing: test_the_caps_matter).
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=256,
            rms_norm_eps=1e-6, sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
            attn_implementation="eager")  # (transformers' SDPA path leaves the score cap out)
CONFIGS = {
    "gqa-tied": dict(),
    "mqa-6-layers": dict(num_key_value_heads=1, num_hidden_layers=6),
    # the 27B's rule (llama.cpp knows it by its 46 layers): q scaled by 1/sqrt(n_embd / n_head), not the head size
    "46-layers": dict(num_hidden_layers=46, hidden_size=64, num_attention_heads=8, head_dim=32,
                      query_pre_attn_scalar=8),
}


def make_model(name, seed=0, **over):
    torch.manual_seed(seed)
    cfg = transformers.Gemma2Config(**{**BASE, **CONFIGS[name], **over})
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # zero-initialized offsets from 1: make them matter
                p.copy_(torch.randn_like(p) * 0.3)
            elif "proj" in n:  # scores large enough to be capped
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory, tiny_tokenizer):  # noqa: F811
    model = make_model(request.param)
    d = tmp_path_factory.mktemp("gemma2")
    path = convert(save_folder(model, d / "hf", tiny_tokenizer), d / f"{request.param}.gguf", type="f32")
    return request.param, model, path


def test_tiny_logits_match_transformers(tiny):
    check_logits_match_transformers(tiny)  # 40 tokens: five windows of 8


def test_tiny_token_by_token_equals_one_batch(tiny):
    check_token_by_token_equals_one_batch(tiny)


def test_the_caps_matter(tiny):
    """The same weights without either cap give other logits than ours by far more than the bound above."""
    name, model, path = tiny
    ids = np.random.default_rng(6).integers(0, model.config.vocab_size, 40)
    ours = _core.Session(_core.Model(str(path)), 64, 2, "f32").eval(ids.astype(np.int32), True)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = make_model(name, **{cap: None})
        uncapped.load_state_dict(model.state_dict())
        with torch.no_grad():
            ref = uncapped(torch.tensor(ids[None])).logits[0].numpy()
        assert rel_err(ours, ref) > 1e-2, (name, cap)


def test_long_context_past_the_window(tiny):
    """60 tokens, 7.5 windows, decoded one at a time after a prompt of 20: the last positions, where the
    sliding layers see only their window and the global ones everything, still agree with transformers."""
    name, model, path = tiny
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, 60).astype(np.int32)
    with torch.no_grad():
        ref = model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    s = _core.Session(_core.Model(str(path)), 64, 2, "f32")
    s.eval(ids[:20], False)
    ours = np.stack([s.eval(ids[i:i + 1], False) for i in range(20, 60)])
    assert rel_err(ours[-20:], ref[-20:]) < 1e-4, name


def test_metadata_follows_llama_cpp(tiny):
    """The keys and tensors llama.cpp's Gemma2Model converter writes: key/value length, both caps and the
    window; no q/k norms; every norm stored as 1 + w; no output.weight (Gemma 2 is tied)."""
    name, model, path = tiny
    r = gguf.GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "gemma2"
    assert f["gemma2.attention.key_length"] == f["gemma2.attention.value_length"] == 32
    assert f["gemma2.attn_logit_softcapping"] == pytest.approx(2.0)
    assert f["gemma2.final_logit_softcapping"] == pytest.approx(3.0)
    assert f["gemma2.attention.sliding_window"] == 8
    tensors = {t.name: np.array(t.data) for t in r.tensors}
    assert not any("attn_q_norm" in n or "attn_k_norm" in n for n in tensors)
    assert "output.weight" not in tensors
    want = model.model.layers[1].post_feedforward_layernorm.weight.detach().numpy() + 1.0
    np.testing.assert_array_equal(tensors["blk.1.post_ffw_norm.weight"], want)


@pytest.mark.parametrize("over, why", [
    (dict(query_pre_attn_scalar=16), "query_pre_attn_scalar 16"),
    (dict(attn_logit_softcapping=None), "attn_logit_softcapping is missing"),
    (dict(final_logit_softcapping=0.0), "final_logit_softcapping = 0.0"),
    (dict(layer_types=["full_attention", "sliding_attention"] * 2 + ["full_attention"]), "layer_types"),
    (dict(tie_word_embeddings=False), "reads no output matrix"),
])
def test_what_llama_cpp_would_read_otherwise_is_refused(tmp_path, tiny_tokenizer, over, why):  # noqa: F811
    import json

    d = save_folder(make_model("gqa-tied"), tmp_path / "hf", tiny_tokenizer)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(over)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match=why):
        convert(d, tmp_path / "m.gguf", type="f32")
    assert not (tmp_path / "m.gguf").exists()
