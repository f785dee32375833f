"""Model.embed: final hidden states (after the output norm) pooled, against transformers' last_hidden_state on a
tiny random Qwen3 (float32), and llama.cpp's embeddings (llama-cpp-python, run live) on the real SmolLM2."""

import numpy as np
import pytest

import optiml
from optiml import ArgumentError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_convert import converted_tiny, make_model, save_folder, tiny_tokenizer  # noqa: E402,F401  (a fixture)

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"  # (the server's id for the reference file: its name)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_tokenizer):  # noqa: F811
    return converted_tiny("qwen3-head-dim", tmp_path_factory, tiny_tokenizer)


def reference(model, ids, pooling):
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    v = {"mean": h.mean(0), "cls": h[0], "last": h[-1], "none": h}[pooling]
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "none"])
def test_embeddings_are_transformers_hidden_states_pooled(qwen3, pooling):
    """Inputs longer than a batch (n_batch 8: the states of every chunk), given as token ids and as text."""
    model, path = qwen3
    rng = np.random.default_rng(3)
    inputs = [[int(t) for t in rng.integers(0, 300, n)] for n in (5, 21)]
    with optiml.Model(path, n_ctx=64, n_batch=8, kv_type="f32") as m:
        got = m.embed(inputs, pooling=pooling)
        text = m.embed("The capital of France is", pooling=pooling)
        ids = m.tokenize("The capital of France is")
    for g, ids_ in zip(got, inputs):
        want = reference(model, ids_, pooling)
        assert g.dtype == np.float32 and g.shape == want.shape
        np.testing.assert_allclose(g, want, atol=2e-5)
    np.testing.assert_allclose(text, reference(model, ids, pooling), atol=2e-5)


def test_pooling_and_normalization_choices(qwen3, tmp_path):
    """The file's pooling_type is the default (a Qwen3-Embedding file says last), else mean; normalize=False
    keeps the length; a reranker's file, an unknown pooling and an empty text are refused with a reason."""
    from optiml.formats.gguf_edit import GGUFValueType as VT
    from optiml.formats.gguf_edit import rewrite_gguf

    model, path = qwen3
    ids = [5, 77, 123, 9]
    last = tmp_path / "last.gguf"
    rewrite_gguf(path, last, set_kv={"qwen3.pooling_type": (3, VT.UINT32)}, progress=False)
    with optiml.Model(last, n_ctx=32, kv_type="f32") as m:
        assert m.hparams["pooling"] == "last"
        np.testing.assert_allclose(m.embed(ids), reference(model, ids, "last"), atol=2e-5)
    with optiml.Model(path, n_ctx=32, kv_type="f32") as m:
        assert m.hparams["pooling"] is None
        np.testing.assert_allclose(m.embed(ids), reference(model, ids, "mean"), atol=2e-5)
        raw = m.embed(ids, normalize=False)
        assert np.linalg.norm(raw) > 1.5
        with pytest.raises(ArgumentError, match="pooling must be one of"):
            m.embed(ids, pooling="max")
        with pytest.raises(ArgumentError, match="gives no tokens"):
            m.embed(["fine", ""])
        with pytest.raises(optiml.ContextOverflowError):
            m.embed(list(range(40)))
    rank = tmp_path / "rank.gguf"
    rewrite_gguf(path, rank, set_kv={"qwen3.pooling_type": (4, VT.UINT32)}, progress=False)
    with optiml.Model(rank, n_ctx=32) as m, pytest.raises(ArgumentError, match="reranker"):
        m.embed(ids)


def test_the_context_is_empty_after_and_generation_unchanged(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=128) as m:
        before = m.generate("Once upon a time", max_tokens=12, temperature=0)
        m.eval(m.tokenize("some earlier context"))
        m.embed(["a", "longer text to embed, twice over"])
        assert m.n_past == 0
        assert m.generate("Once upon a time", max_tokens=12, temperature=0) == before


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_smollm2_embeddings_follow_llama_cpp(smollm2_path, pooling):
    """llama.cpp's embeddings of the same file (its output norm's states, pooled, normalized): the same direction
    within the two engines' Q4_1 kernel noise."""
    from conftest import llama_cpp_module

    llama_cpp = llama_cpp_module()
    texts = ["The capital of France is Paris.", "A quick brown fox jumps over the lazy dog, twice."]
    with optiml.Model(smollm2_path, n_ctx=128) as m:
        ours = m.embed(texts, pooling=pooling)
    kind = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}[pooling]
    llm = llama_cpp.Llama(str(smollm2_path), embedding=True, pooling_type=kind, n_ctx=128, n_threads=1,
                          verbose=False)
    try:
        theirs = np.array(llm.embed(texts, normalize=True), dtype=np.float32)
    finally:
        llm.close()
    cos = (ours * theirs).sum(1)
    assert (cos > 0.999).all(), cos
    assert (ours[0] * ours[1]).sum() < 0.99  # (different texts are not the same vector)


def test_cli_prints_the_api_vectors(smollm2_path, tmp_path, capsys):
    import json

    from optiml import cli

    (tmp_path / "texts.txt").write_text("first text\n\nsecond one\n")
    assert cli.main(["embed", "-m", str(smollm2_path), "-c", "64", "-f", str(tmp_path / "texts.txt"),
                     "--embd-output-format", "json", "--pooling", "last"]) == 0
    doc = json.loads(capsys.readouterr().out)
    with optiml.Model(smollm2_path, n_ctx=64) as m:
        want = m.embed(["first text", "second one"], pooling="last")
    assert [d["index"] for d in doc["data"]] == [0, 1]
    np.testing.assert_allclose(np.array([d["embedding"] for d in doc["data"]]), want, atol=1e-6)
    assert cli.main(["embed", "-m", str(smollm2_path), "-c", "64", "-p", "x", "-p", "y z"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and len(lines[0].split()) == 576
    assert cli.main(["embed", "-m", str(smollm2_path), "-f", str(tmp_path / "missing.txt")]) == 2


def test_v1_embeddings_with_the_openai_client_beside_generation(smollm2_path):
    """/v1/embeddings: the official client (base64 by default) and plain JSON give Model.embed's vectors, while a
    streamed completion runs in another slot and still gives its greedy text; bad requests are 400s."""
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    import threading

    from conftest import live_server
    from optiml.server import Server

    texts = ["The capital of France is Paris.", "second", "A quick brown fox jumps over the lazy dog. " * 6]
    with optiml.Model(smollm2_path, n_ctx=128) as m:
        want = m.embed(texts)
        greedy = m.generate("Once upon a time", max_tokens=24, temperature=0)
        assert len(m.tokenize(texts[2])) > 3 * 16
    model = optiml.Model(smollm2_path, n_ctx=128, n_seq=2)
    with live_server(Server(model, n_parallel=2, chunk=16)) as srv:  # (the long input in pieces of 16 tokens)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        text = []
        stream = dict(model=MODEL_ID, prompt="Once upon a time", max_tokens=24, temperature=0, stream=True)
        t = threading.Thread(target=lambda: text.extend(c.choices[0].text
                                                        for c in client.completions.create(**stream)))
        t.start()
        r = client.embeddings.create(model=MODEL_ID, input=texts)
        t.join(120)
        assert "".join(text) == greedy
        assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens == sum(
            len(model.tokenize(x)) for x in texts)
        np.testing.assert_allclose(np.array([d.embedding for d in r.data]), want, atol=1e-5)
        j = httpx.post(srv.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "float"}).json()
        np.testing.assert_allclose(j["data"][0]["embedding"], want[0], atol=1e-5)
        for body, why in (({"input": ""}, "empty string"), ({"input": []}, "'input' must be"),
                          ({"input": ["a"] * 2049}, "at most 2048"),
                          ({"input": "x", "dimensions": 8}, "'dimensions' is not supported"),
                          ({"input": "word " * 200}, "the context holds 128")):
            r = httpx.post(srv.url + "/v1/embeddings", json=body)
            assert r.status_code == 400 and why in r.json()["error"]["message"], (body, r.text)
    model.close()


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3Model"])
def test_an_embedding_model_folder_converts_with_its_pooling(tmp_path, tiny_tokenizer, arch):  # noqa: F811
    """A sentence-transformers folder as Qwen3-Embedding ships it (the base model's tensors without "model." and
    no head; modules.json naming a last-token Pooling module): the file says pooling_type last (llama.cpp's
    converter's key), embed() pools so by default and gives transformers' normalized last hidden state, and
    llama.cpp's embeddings of the file agree."""
    import json
    import os

    import gguf

    from conftest import llama_cpp_module
    from optiml.convert import convert

    model = make_model("qwen3-head-dim")
    d = tmp_path / "st"
    model.model.save_pretrained(d)
    save_folder(model.model, d, tiny_tokenizer)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch], tie_word_embeddings=True)))
    (d / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type":
                                                "sentence_transformers.models.Transformer"},
                                               {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                                                "sentence_transformers.models.Pooling"}]))
    os.makedirs(d / "1_Pooling")
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                             "pooling_mode_lasttoken": True}))
    out = convert(d, tmp_path / "emb.gguf", type="f32")
    assert gguf.GGUFReader(out).fields["qwen3.pooling_type"].contents() == 3
    text = "The capital of France is Paris"
    with optiml.Model(out, n_ctx=32, kv_type="f32") as m:
        ours = m.embed(text)
        ids = m.tokenize(text)
    np.testing.assert_allclose(ours, reference(model, ids, "last"), atol=2e-5)
    llama_cpp = llama_cpp_module()
    llm = llama_cpp.Llama(str(out), embedding=True, n_ctx=32, n_threads=1, verbose=False)  # (the file's pooling)
    try:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids
        theirs = np.array(llm.embed(text, normalize=True), dtype=np.float32)
    finally:
        llm.close()
    assert float(ours @ theirs) > 0.9999


def test_the_pipeline_reserves_a_slot_and_drops_what_is_cancelled(smollm2_path):
    """An input runs piece by piece in a slot no prompt is admitted to meanwhile; a cancelled request frees it at
    the next turn; requests beyond --queue are refused."""
    from optiml.server.pipeline import Pipeline, QueueFull

    with optiml.Model(smollm2_path, n_ctx=128, n_seq=2) as m:
        p = Pipeline(m, n_parallel=2, max_queue=2, chunk=8)
        ids = m.tokenize("A quick brown fox jumps over the lazy dog, twice over and more.")
        a, b = p.embed([ids, ids[:3]], "mean"), p.embed([ids], "mean")
        with pytest.raises(QueueFull, match="2 embedding requests are already waiting"):
            p.embed([ids], "mean")
        p._embed_next()  # a's first input, its first 8 tokens
        slot = a.slot
        assert slot.reserved and not slot.free and len(a.states) == 1
        while len(a.vectors) < 1:
            p._embed_next()
        assert not slot.reserved and list(p._embeds) == [b, a]  # b's turn next
        b.cancelled = True
        p._embed_next()
        assert b.fut.cancelled() and list(p._embeds) == [a] and all(x.free for x in p.scheduler.slots)
        p._embed_next()
        np.testing.assert_allclose(np.stack(a.fut.result()), m.embed([ids, ids[:3]]), atol=1e-5)
