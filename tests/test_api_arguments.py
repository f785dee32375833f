"""Arguments of the Python API that were accepted or failed badly (review findings): each is refused with the
documented exception type and a message naming what was wrong, and nothing is run or changed by a refused
call."""

import sys

import numpy as np
import pytest

import optiml
from optiml.engine import model as model_module

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=256, n_threads=1) as m:
        yield m


# ---- 1: the KV cache against the memory available now -------------------------------------------------------
def test_kv_cache_larger_than_the_available_memory_is_refused(smollm2_path, monkeypatch):
    # SmolLM2's f16 cache takes 23040 bytes a position: 100_000 positions are 2.1 GiB, more than 1 GiB available
    monkeypatch.setattr(model_module, "_mem_available", lambda: 2**30)
    with pytest.raises(optiml.ArgumentError, match=r"2\.1 GiB on the host, more than the 1\.0 GiB of memory "
                                                   r"available now .*smaller n_ctx.*q8_0 or q4_0"):
        optiml.Model(smollm2_path, n_ctx=100_000, n_threads=1)
    # the same context in a quantized cache (q4_0: 9/32 of f16's bytes, 0.6 GiB) fits
    with optiml.Model(smollm2_path, n_ctx=100_000, n_threads=1, kv_type="q4_0") as m:
        assert m.n_ctx == 100_000


def test_memory_that_cannot_be_read_is_not_checked(smollm2_path, monkeypatch):
    monkeypatch.setattr(model_module, "_mem_available", lambda: None)
    with optiml.Model(smollm2_path, n_ctx=64, n_threads=1) as m:
        assert m.n_ctx == 64
    with pytest.raises(optiml.ArgumentError, match="more than this machine's .* GiB of memory"):  # still checked
        optiml.Model(smollm2_path, n_ctx=2**30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MemAvailable is Linux's")
def test_mem_available_is_read():
    available = model_module._mem_available()
    assert available is not None and 0 < available


# ---- 2: a closed model --------------------------------------------------------------------------------------
def test_closed_model_chat_template_and_with_raise(smollm2_path):
    m = optiml.Model(smollm2_path, n_ctx=64, n_threads=1)
    assert m.chat_template  # read once before closing: the closed model must not hand back what it kept
    m.close()
    with pytest.raises(optiml.OptimlError, match="closed"):
        m.chat_template
    with pytest.raises(optiml.OptimlError, match="closed"):
        m.chat_template = None
    with pytest.raises(optiml.OptimlError, match="closed"):
        with m:
            pass
    with pytest.raises(optiml.OptimlError, match="closed"):
        m.chat([{"role": "user", "content": "Hi"}])


# ---- 3: token ids that are floats or bools ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [1.5, True, np.float32(2.0), np.bool_(True), "7"])
def test_detokenize_refuses_ids_that_are_not_integers(model, bad):
    with pytest.raises(optiml.ArgumentError, match="token ids must be integers"):
        model.detokenize([bad])
    with pytest.raises(optiml.ArgumentError, match="token ids must be integers"):
        model.tokenizer.detokenizer().push(bad)
    with pytest.raises(optiml.ArgumentError, match="token ids must be integers"):
        model.tokenizer.token_to_piece(bad)


def test_detokenize_takes_integers(model):
    ids = model.tokenize(PROMPT)
    assert model.detokenize(ids) == model.detokenize(np.array(ids, np.int32)) == PROMPT
    d = model.tokenizer.detokenizer()
    assert "".join(d.push(i) for i in np.array(ids, np.int64)) + d.flush() == PROMPT


# ---- 4: Batch values, decode's argument, seq_len ------------------------------------------------------------
@pytest.mark.parametrize("kw, said", [
    (dict(seq=2**33), "seq must be at most 2147483647"),
    (dict(pos=2**33), "pos must be at most 2147483647"),
    (dict(token=2**31), "token must be at most 2147483647"),
    (dict(seq=-1), "seq must be a non-negative integer"),
    (dict(pos=1.0), "pos must be a non-negative integer"),
    (dict(seq=True), "seq must be a non-negative integer"),
    (dict(logits="no"), "logits must be True or False"),
])
def test_batch_add_refuses_what_decode_cannot_take(kw, said):
    args = dict(token=1, seq=0, pos=0, logits=False) | kw
    b = optiml.Batch()
    with pytest.raises(optiml.ArgumentError, match=said):
        b.add(**args)
    assert len(b) == 0


def test_batch_add_sequence_checks_before_adding(model):
    b = optiml.Batch()
    with pytest.raises(optiml.ArgumentError, match="seq must be at most"):
        b.add_sequence([1, 2], seq=2**40)
    with pytest.raises(optiml.ArgumentError, match="token must be a non-negative integer, got 2.5"):
        b.add_sequence([1, 2.5], seq=0)
    with pytest.raises(optiml.ArgumentError, match="positions .* must be at most 2147483647"):
        b.add_sequence([1, 2, 3], seq=0, pos=2**31 - 2)
    with pytest.raises(optiml.ArgumentError, match="tokens must be a sequence of token ids"):
        b.add_sequence("abc", seq=0)
    assert len(b) == 0  # nothing of a refused call was added
    ids = model.tokenize(PROMPT)
    b.add_sequence(np.array(ids), seq=0)
    assert (b.tokens, b.pos, b.logits) == (ids, list(range(len(ids))), [False] * (len(ids) - 1) + [True])
    assert repr(b) == f"<optiml.Batch {len(ids)} token(s) of sequence(s) [0], 1 with logits>"
    model.reset()
    assert model.decode(b).shape == (1, model.n_vocab)
    model.reset()


@pytest.mark.parametrize("bad", [None, [1, 2, 3], "tokens"])
def test_decode_needs_a_batch(model, bad):
    with pytest.raises(TypeError, match="decode takes an optiml.Batch"):
        model.decode(bad)


@pytest.mark.parametrize("bad, said", [("a", "seq must be a non-negative integer"), (2**40, "seq must be at most"),
                                       (-1, "seq must be a non-negative integer"), (5, "outside")])
def test_seq_len_checks_its_argument(model, bad, said):
    with pytest.raises(optiml.ArgumentError, match=said):
        model.seq_len(bad)


# ---- 5: flags must be bools ---------------------------------------------------------------------------------
@pytest.mark.parametrize("call, name", [
    (lambda m: m.eval([1], all_logits="no"), "all_logits"),
    (lambda m: m.chat([{"role": "user", "content": "Hi"}], stream="yes"), "stream"),
    (lambda m: m.tokenize("Hi", add_bos="no"), "add_bos"),
    (lambda m: m.tokenize("Hi", special=1), "special"),
    (lambda m: m.chat_prompt([{"role": "user", "content": "Hi"}], add_generation_prompt="no"),
     "add_generation_prompt"),
    (lambda m: m.sparsity_stats(reset="no"), "reset"),
    (lambda m: m.tokenizer.decode([1], render_special="no"), "render_special"),
])
def test_flags_must_be_bools(model, call, name):
    model.reset()
    with pytest.raises(optiml.ArgumentError, match=f"{name} must be True or False, got"):
        call(model)
    assert model.n_past == 0  # nothing ran


def test_numpy_bools_are_flags(model):
    model.reset()
    assert model.eval([1, 2], all_logits=np.bool_(True)).shape == (2, model.n_vocab)
    model.reset()


# ---- 6: a folder as the model, sparsity_meter's history -----------------------------------------------------
def test_folder_as_the_model_is_an_argument_error(tmp_path):
    with pytest.raises(optiml.ArgumentError, match=f"{tmp_path} is a folder: give a GGUF file"):
        optiml.Model(tmp_path)
    with pytest.raises(optiml.ArgumentError, match="is a folder: give a GGUF file"):
        optiml.tokenizer.load(tmp_path)


@pytest.mark.parametrize("bad", [-1, 0, 1.5, "10"])
def test_sparsity_meter_history_is_named(model, bad):
    with pytest.raises(optiml.ArgumentError, match="history must be a positive integer"):
        model.sparsity_meter(bad)


# ---- 7: signatures, reprs, py.typed -------------------------------------------------------------------------
def test_generate_shows_the_sampling_parameters(model):
    import inspect

    params = inspect.signature(model.generate).parameters
    assert list(params) == list(inspect.signature(model.stream).parameters)
    assert all(params[p].default == inspect.signature(model.stream).parameters[p].default for p in params)
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        model.generate(PROMPT, foo=1)
    assert model.detokenize.__doc__ and "str | Iterator[str]" in str(inspect.signature(model.chat).return_annotation)
    # the same greedy text through generate as through stream
    assert model.generate(PROMPT, 8, temperature=0) == "".join(model.stream(PROMPT, 8, temperature=0))


def test_reprs_and_py_typed(model):
    import os

    assert repr(model.chat_template).startswith("<optiml ChatTemplate: the chat template of SmolLM2")
    assert repr(optiml.Batch()) == "<optiml.Batch 0 token(s) of sequence(s) [], 0 with logits>"
    assert os.path.isfile(os.path.join(os.path.dirname(optiml.__file__), "py.typed"))


# ---- 8: a stream kept alive after it was abandoned ----------------------------------------------------------
def _abandon_a_stream(m):
    """Starts a stream and leaves with an exception: the traceback keeps this frame, and with it the stream."""
    s = m.stream(PROMPT, max_tokens=16, temperature=0)
    next(s)
    raise RuntimeError("left the stream unfinished")


def test_a_stream_kept_alive_holds_the_model_until_closed(smollm2_path, model):
    with optiml.Model(smollm2_path, n_ctx=256, n_threads=1) as fresh:
        want = fresh.generate(PROMPT, max_tokens=12, temperature=0)
    model.reset()
    try:
        _abandon_a_stream(model)
    except RuntimeError as e:
        kept = e  # the saved exception keeps the stream's generator alive
    with pytest.raises(optiml.OptimlError, match=r"unfinished stream: finish it or call its close\(\)"):
        model.generate(PROMPT, max_tokens=12, temperature=0)
    kept.__traceback__.tb_next.tb_frame.f_locals["s"].close()  # what the message says to do
    assert model.generate(PROMPT, max_tokens=12, temperature=0) == want
    del kept
