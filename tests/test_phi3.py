"""Phi-3 (Phi3ForCausalLM: Phi-3, Phi-3.5, Phi-4-mini): tiny random transformers models converted by `optiml
convert`: fused q/k/v and gate/up, a rotation over 3/4 of each head, LongRoPE's long and short factors chosen
by the context as llama.cpp chooses them, against transformers in float32. The generic checks (greedy text,
llama.cpp running the converted files) are tests/test_convert.py's "phi3-longrope"."""

import math
import os

import numpy as np
import pytest

import optiml
from optiml import _core

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402

from optiml.convert import ConvertError, convert  # noqa: E402
from test_convert import converted_tiny, make_model, save_folder, tiny_tokenizer  # noqa: E402,F401  (a fixture)
from test_model_hf import rel_err  # noqa: E402

ORIG = 32  # the config's original_max_position_embeddings; max_position_embeddings is 256


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tiny_tokenizer):  # noqa: F811
    return converted_tiny("phi3-longrope", tmp_path_factory, tiny_tokenizer)


def ours(path, ids, n_ctx):
    return _core.Session(_core.Model(str(path)), n_ctx, 2, "f32").eval(np.asarray(ids, np.int32), True)


def theirs(model, ids):
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()


def test_long_and_short_factors_follow_the_context(phi3):
    """llama.cpp (and so OptiML) turns q and k with the long factors when a sequence's context is longer than the
    original one, transformers when the sequence is: both agree where the two coincide (1e-4), and a context of 64
    gives 20 tokens other logits than transformers' short factors (the choice is the context's, not the tokens';
    2e-3 apart: a random model's attention hardly depends on positions)."""
    model, path = phi3
    rng = np.random.default_rng(1)
    long_ids, short_ids = rng.integers(0, 300, 48), rng.integers(0, 300, 20)
    assert rel_err(ours(path, long_ids, 64), theirs(model, long_ids)) < 1e-4  # both long
    assert rel_err(ours(path, short_ids, ORIG), theirs(model, short_ids)) < 1e-4  # both short
    assert rel_err(ours(path, short_ids, 64), theirs(model, short_ids)) > 1e-3  # long against short


def test_metadata_and_tensors_follow_llama_cpp(phi3):
    """What llama.cpp's Phi3MiniModel writes: the rotated width, the original context, LongRoPE's cos/sin factor
    and its two factor lists first; q/k/v and gate/up as the checkpoint fuses them (the quant mixes against
    llama-quantize: tests/test_convert.py)."""
    model, path = phi3
    r = gguf.GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "phi3"
    assert f["phi3.rope.dimension_count"] == 12  # int(0.75 * 64) // 4
    assert f["phi3.rope.scaling.original_context_length"] == ORIG
    assert f["phi3.rope.scaling.attn_factor"] == pytest.approx(math.sqrt(1 + math.log(256 / ORIG) / math.log(ORIG)))
    assert f["phi3.attention.sliding_window"] == 0
    names = [t.name for t in r.tensors]
    assert names[:3] == ["rope_factors_long.weight", "rope_factors_short.weight", "token_embd.weight"]
    t = {t.name: t for t in r.tensors}
    rope = model.config.rope_parameters
    np.testing.assert_array_equal(np.array(t["rope_factors_long.weight"].data), np.float32(rope["long_factor"]))
    np.testing.assert_array_equal(np.array(t["rope_factors_short.weight"].data), np.float32(rope["short_factor"]))
    assert list(t["blk.0.attn_qkv.weight"].shape) == [64, 64 + 2 * 32]
    assert list(t["blk.0.ffn_up.weight"].shape) == [64, 2 * 160]
    assert not any(n.endswith(("attn_q.weight", "ffn_gate.weight")) for n in names)


def test_sparse_and_split_runs(phi3):
    """The fused matrices' parts run everywhere the separate ones do: neurons split across cpu:1, or whole layers
    there, give the CPU's logits."""
    _, path = phi3
    ids = list(range(10, 50))
    with optiml.Model(path, n_ctx=64) as m:
        ref = m.eval(ids, all_logits=True)
    with optiml.Model(path, n_ctx=64, device="cpu:1", n_gpu_layers=2) as m:
        np.testing.assert_allclose(m.eval(ids, all_logits=True), ref, rtol=1e-5, atol=1e-5)
    with optiml.Model(path, n_ctx=64, device="cpu:1", gpu_neurons=96) as m:
        assert rel_err(m.eval(ids, all_logits=True), ref) < 1e-3


@pytest.mark.parametrize("over, why", [
    (dict(rope_scaling={"rope_type": "longrope", "long_factor": [1.0] * 5, "short_factor": [1.0] * 6}),
     "long_factor must be 6 positive numbers"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope scaling 'yarn' is not supported for Phi-3"),
    (dict(rope_scaling={"rope_type": "longrope", "long_factor": [1.0] * 6, "short_factor": [1.0] * 6,
                        "attention_factor": 2.0}), "attention_factor 2.0 is not supported"),
    (dict(partial_rotary_factor=0.01), "an even number from 2"),
])
def test_what_llama_cpp_would_read_otherwise_is_refused(tmp_path, tiny_tokenizer, over, why):  # noqa: F811
    import json

    d = save_folder(make_model("phi3-longrope"), tmp_path / "hf", tiny_tokenizer)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)  # (transformers 5 folds rope_scaling and partial_rotary_factor into it)
    cfg.update({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 6, "short_factor": [1.0] * 6},
                "partial_rotary_factor": 0.75, **over})
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match=why):
        convert(d, tmp_path / "m.gguf", type="f32")
    assert not (tmp_path / "m.gguf").exists()


def test_offline_tools_say_what_they_do_not_handle(phi3, tmp_path):
    from optiml.formats import gguf as ogguf
    from optiml.formats.placement import ffn_layout
    from optiml import UnsupportedModelError

    _, path = phi3
    with ogguf.open(path) as f, pytest.raises(UnsupportedModelError, match="gate and up in one tensor"):
        ffn_layout(f)
    with pytest.raises(optiml.OptimlError, match="gate and up in one tensor"):
        optiml.train_predictors(str(path), texts=["word " * 200], out=tmp_path / "p.gguf")


def test_special_tokens_take_the_whitespace_after_them_as_llama_cpp(phi3, tmp_path):
    """llama.cpp gives a model named Phi-3 (general.name) special tokens that swallow the whitespace after them
    (but <unk>, <s> and <|endoftext|>), as Phi-3's tokenizer_config marks its chat tokens rstrip: the same ids
    from both engines, with and without the name."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from conftest import llama_cpp_module

    llama_cpp = llama_cpp_module()
    model, _ = phi3
    tok = Tokenizer(models.BPE())  # (Phi-3's special tokens: llama.cpp looks up <unk>, <s> and </s> by name)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, and more words here."] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>", "<unk>", "<s>", "</s>", "<|user|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>",
                                         unk_token="<unk>").save_pretrained(tmp_path / "tok")
    hf = save_folder(model, tmp_path / "hf", tmp_path / "tok")
    text = "<|user|>\n  hello<|end|>\nworld<|endoftext|>\n<s> x</s>\t\n"
    got = {}
    for name in ("Phi-3-mini-test", "tiny"):
        out = convert(hf, tmp_path / f"{name}.gguf", type="f16", name=name)
        llm = llama_cpp.Llama(model_path=out, vocab_only=True, verbose=False)
        try:
            theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
        finally:
            llm.close()
        with optiml.Model(out, n_ctx=32) as m:
            got[name] = m.tokenize(text, add_bos=False, special=True)
            assert got[name] == theirs, name
            newline = m.tokenize("\n", add_bos=False)[0]
    assert got["tiny"].count(newline) > got["Phi-3-mini-test"].count(newline) > 0  # <|endoftext|>'s kept
