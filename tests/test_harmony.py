"""gpt-oss's harmony-format answers split into reasoning and content (optiml.engine.harmony), whole and in
any chunks, and the server's chat route giving them as content and reasoning_content (llama.cpp's fields)."""

from __future__ import annotations

import pytest

from optiml.engine.harmony import HarmonySplitter

ANSWER = ("<|channel|>analysis<|message|>The user greets. Respond <|kindly|>.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
TOOL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")


def split(chunks):
    sp = HarmonySplitter()
    pieces = [p for c in chunks for p in sp.feed(c)] + sp.flush()
    out = {"content": "", "reasoning": ""}
    for kind, t in pieces:
        out[kind] += t
    return out, sp


@pytest.mark.parametrize("text,want", [
    (ANSWER, {"reasoning": "The user greets. Respond <|kindly|>.", "content": "Hello! How can I help?"}),
    ("<|channel|>final<|message|>Just the answer.", {"reasoning": "", "content": "Just the answer."}),
    ("<|channel|>analysis<|message|>Thinking, cut off by max_tok", {"reasoning": "Thinking, cut off by max_tok",
                                                                  "content": ""}),
    ("No frame at all: <| and <|chan are text.", {"reasoning": "", "content": "No frame at all: <| and <|chan are text."}),
    (TOOL, {"reasoning": "Need the weather.", "content": ""}),
    # The recipient may come in the role instead (gpt-oss's template writes tool calls that way).
    ("<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     "<|message|>{}", {"reasoning": "Call it.", "content": ""}),
    # A commentary preamble addressed to nobody is for the user; stray text between messages is dropped.
    ("<|channel|>commentary<|message|>Checking.<|end|> stray <|start|>assistant<|channel|>final<|message|>Done.",
     {"reasoning": "", "content": "Checking.Done."}),
    # Reasoning only, its message closed (the answer never came: max_tokens right after <|end|>).
    ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|>",
     {"reasoning": "A.B.", "content": ""}),
    # A max_tokens cut inside the header: nothing of the header shows.
    ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>fin", {"reasoning": "Hm.", "content": ""}),
])
def test_every_split_point_gives_the_same_pieces(text, want):
    whole, _ = split([text])
    assert whole == want
    for i in range(len(text) + 1):  # a marker cut anywhere
        assert split([text[:i], text[i:]])[0] == want, i
    assert split(list(text))[0] == want  # a character at a time
    for i in range(len(text)):  # a character on its own between two chunks
        assert split([text[:i], text[i], text[i + 1:]])[0] == want, i


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("text,want,calls", [
    (ANSWER + " :)", {"reasoning": "The user greets. Respond <|kindly|>.", "content": "Hello! How can I help? :)"}, []),
    (TOOL, {"reasoning": "Need the weather.", "content": ""},
     [("assistant commentary to=functions.get_weather  <|constrain|>json", '{"city": "Paris"}')]),
], ids=["answer", "tool"])
def test_random_chunks(seed, text, want, calls):
    """A transcript cut at random places, as a detokenizer holding back incomplete UTF-8 or a possible stop
    string might deliver it: the same pieces and tool calls. (<|return|> and <|call|> are never in the text:
    they end generation and are not rendered.)"""
    import random

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
    got, sp = split([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    assert got == want and sp.tool_calls == calls


def test_split_whole_answer():
    from optiml.engine.harmony import split as split_answer

    assert split_answer(ANSWER) == ("The user greets. Respond <|kindly|>.", "Hello! How can I help?")
    assert split_answer("No frame.") == ("", "No frame.")


def test_pieces_carry_no_frame():
    sp = HarmonySplitter()
    pieces = [p for c in ANSWER for p in sp.feed(c)] + sp.flush()
    assert all(t and "<|channel|>" not in t and "<|message|>" not in t for _, t in pieces)
    assert "analysis" not in "".join(t for _, t in pieces) and "assistant" not in "".join(t for _, t in pieces)


def test_tool_calls_are_kept_apart():
    _, sp = split([TOOL])
    assert sp.tool_calls == [("assistant commentary to=functions.get_weather  <|constrain|>json", '{"city": "Paris"}')]


def test_chat_route_gives_reasoning_content(monkeypatch):
    """The server's chat message and stream deltas for a harmony model (the text is what its tokenizer renders)."""
    from optiml.server import app

    msg = app._assistant_message(ANSWER, "harmony")
    assert msg == {"role": "assistant", "content": "Hello! How can I help?",
                   "reasoning_content": "The user greets. Respond <|kindly|>."}
    assert app._assistant_message(ANSWER, None) == {"role": "assistant", "content": ANSWER}


def test_served_stream_through_the_splitter(smollm2_path, monkeypatch):
    """The chat route's harmony path end to end, through the official client: SmolLM2 writes no harmony frame,
    so with the splitter forced on, the streamed deltas (each piece a chunk, the rest at the finish) still add
    up to the non-streamed content, and neither carries reasoning."""
    openai = pytest.importorskip("openai")
    import optiml
    from conftest import live_server
    from optiml.server import Server

    msgs = [{"role": "user", "content": "Name three colors of the rainbow."}]
    model = optiml.Model(smollm2_path, n_ctx=256, n_seq=1)
    srv = Server(model, n_parallel=1, model_id="smollm2")
    assert srv.harmony is False  # SmolLM2's vocabulary has no harmony markers
    srv.harmony = True
    with live_server(srv):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        full = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=16)
        pieces, reasoning = [], []
        for c in client.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=16,
                                                stream=True):
            for ch in c.choices:
                pieces.append(ch.delta.content or "")
                reasoning.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
    model.close()
    assert full.choices[0].message.content and "".join(pieces) == full.choices[0].message.content
    assert (full.choices[0].message.model_extra or {}).get("reasoning_content") is None and not "".join(reasoning)
