"""The forward pass against transformers (float32, CPU) on tiny random models written to GGUF."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import optiml  # noqa: E402
from optiml import _core  # noqa: E402

from hf_gguf import write_and_close, write_gguf  # noqa: E402

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5)

CONFIGS = {
    "llama-mha-tied": ("llama", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-gqa-untied": ("llama", "LlamaForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa-bias": ("llama", "LlamaForCausalLM", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                                                         tie_word_embeddings=False)),
    "llama-rope-linear": ("llama", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_theta=50000.0,
                                                            rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral-gqa": ("llama", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=None,
                                                        tie_word_embeddings=False)),
    "qwen2-bias": ("qwen2", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                                     use_sliding_window=False)),
}


def make_model(name, seed=0):
    arch, cls, extra = CONFIGS[name]
    torch.manual_seed(seed)
    cfg_cls = getattr(transformers, cls.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(**{**BASE, **extra})
    model = getattr(transformers, cls)(cfg).eval()
    # Random init gives near-zero biases and unit norms; make every parameter matter.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
    return arch, model


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    arch, model = make_model(request.param)
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    write_gguf(model, path, arch)
    return request.param, model, path


def check_logits_match_transformers(tiny, seed=1, n_tokens=40, cache="f32", tol=1e-4):
    """n_tokens random tokens (40: 5x Gemma3's test window of 8): all logits within tol of transformers'."""
    name, model, path = tiny
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, n_tokens)
    with torch.no_grad():
        ref = model(torch.tensor(ids[None])).logits[0].numpy()
    s = _core.Session(_core.Model(str(path)), 64, 2, cache)
    ours = s.eval(ids.astype(np.int32), True)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < tol, name


def check_token_by_token_equals_one_batch(tiny):
    """A prompt in batches of 5, then single tokens: every position's logits agree with one batch's."""
    name, model, path = tiny
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, 24).astype(np.int32)
    m = _core.Model(str(path))
    whole = _core.Session(m, 64, 2, "f32").eval(ids, True)
    s = _core.Session(m, 64, 3, "f32", n_batch=5)
    part = s.eval(ids[:16], True)
    steps = [s.eval(ids[i : i + 1], False) for i in range(16, 24)]
    assert rel_err(np.concatenate([part, np.stack(steps)]), whole) < 1e-5, name


def test_logits_match_transformers(tiny):
    check_logits_match_transformers(tiny)


def test_decoding_token_by_token_equals_one_batch(tiny):
    check_token_by_token_equals_one_batch(tiny)


def test_f16_cache_stays_close(tiny):
    check_logits_match_transformers(tiny, seed=3, n_tokens=30, cache="f16", tol=5e-3)


def test_unsupported_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    write_and_close(w)
    with pytest.raises(optiml.UnsupportedModelError, match="gpt2.*supported: llama, mistral, qwen2"):
        _core.Model(str(path))


def test_wrong_tensor_shape_is_a_clear_error(tmp_path):
    arch, model = make_model("llama-gqa-untied")
    path = tmp_path / "bad.gguf"
    write_gguf(model, path, arch)
    import gguf

    # Rewrite with a head count that does not fit the q/k/v shapes.
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad2.gguf"), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        if f.name == "llama.attention.head_count_kv":
            w.add_uint32(f.name, 4)
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed([int(d) for d in t.shape]))), raw_dtype=t.tensor_type)
    write_and_close(w)
    with pytest.raises(optiml.GGUFError, match="attn_k.weight has shape"):
        _core.Model(str(tmp_path / "bad2.gguf"))
