"""optiml serve with a gpt-oss (harmony) model or one that thinks in <think> tags (Qwen3, DeepSeek-R1):
/v1/chat/completions splits the answer into message.reasoning_content (analysis channel, <think> block) and
message.content (final channel, the rest), as llama.cpp's server does; reasoning_format "none",
/v1/completions and other models pass the text through. The model is a stub: its pipeline replays
a scripted generation in the chunks given, so only the server's shaping is under test (the splitter is
tests/test_harmony.py's, the markers' rendering tests/test_tokenizer.py's)."""

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
httpx = pytest.importorskip("httpx")

from conftest import live_server  # noqa: E402
from optiml.engine import harmony, reasoning  # noqa: E402
from optiml.server import Server  # noqa: E402
from optiml.server.metrics import Metrics  # noqa: E402

ANALYSIS, FINAL = "The user greets. Respond.", "Hello! How can I help?"
# The text as the detokenizer streams it, markers and tags cut between deltas.
HARMONY = ["<|chan", "nel|>analysis<|message|>The user", " greets. Respond.<|end|><|start|>assistant<|",
           "channel|>final<|message|>Hello!", " How can I help?"]
THINK = ["<thi", "nk>\nThe user", " greets. Respond.\n</th", "ink>\n\nHello!", " How can I help?"]
CHUNKS = {"harmony": HARMONY, "think": THINK, "other": HARMONY}
# the tokens each kind's vocabulary has (optiml.engine.harmony.is_harmony, optiml.engine.reasoning.is_thinking)
TOKENS = {"harmony": {"<|channel|>", "<|message|>", "<|return|>"}, "think": {"<think>", "</think>"}, "other": set()}


class StubTokenizer:
    add_bos, bos_id = False, -1

    def __init__(self, kind: str):
        self.kind = kind

    def token_id(self, text):
        return 7 if text in TOKENS[self.kind] else -1

    def encode(self, text, add_special=True, parse_special=False):
        return [1, 2, 3]

    def token_to_piece(self, tok, render_special=False):
        return b"t"


class StubTemplate:
    stop = []

    def render(self, messages, add_generation_prompt=True, **variables):
        return "prompt"


class StubModel:
    n_vocab, n_ctx = 100, 512
    chat_template = StubTemplate()


class StubPipeline:
    n_parallel = 1

    def __init__(self, chunks):
        self.chunks = chunks

    def submit(self, jobs):
        for j in jobs:
            for text in self.chunks:
                lps = [(5, -0.5, [])] if j.top_logprobs >= 0 else []
                j.sink({"type": "delta", "index": j.index, "text": text, "logprobs": lps})
            j.sink({"type": "done", "index": j.index, "finish_reason": "stop", "prompt_tokens": 3,
                    "completion_tokens": len(self.chunks), "cached_tokens": 0})

    def cancel(self, jobs):
        pass

    def start(self):
        pass

    stop = start


class StubServer(Server):
    # Server.__init__ wants a loaded model and starts a real pipeline: only the fields the routes read are set.
    def __init__(self, kind: str):
        self.model, self.tokenizer = StubModel(), StubTokenizer(kind)
        self.model_id, self.created, self.api_key, self.max_body = "stub", 0, None, 1 << 20
        self.model_names, self.cors_origins = {"stub"}, None
        self.metrics, self.pipeline, self._grammars = Metrics(), StubPipeline(CHUNKS[kind]), None
        self.harmony = harmony.is_harmony(self.tokenizer)
        self.thinking = not self.harmony and reasoning.is_thinking(self.tokenizer)
        self.template_variables = {}
        self.kind = kind


@pytest.fixture(scope="module", params=["harmony", "think", "other"])
def server(request):
    with live_server(StubServer(request.param)) as srv:
        yield srv


def raw(server):
    return "".join(CHUNKS[server.kind])


def post(server, path, **body):
    return httpx.post(server.url + path, json=dict(model="stub", **body), timeout=60)


def stream(server, path, **body):
    """The data of each server-sent event, parsed."""
    with httpx.stream("POST", server.url + path, json=dict(model="stub", stream=True, **body), timeout=60) as r:
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


MSGS = [{"role": "user", "content": "Hi"}]


def test_chat(server):
    msg = post(server, "/v1/chat/completions", messages=MSGS).json()["choices"][0]["message"]
    if server.kind != "other":
        assert msg == {"role": "assistant", "content": FINAL, "reasoning_content": ANALYSIS}
    else:
        assert msg == {"role": "assistant", "content": raw(server)}
    # llama-server's reasoning_format "none": the text as generated
    msg = post(server, "/v1/chat/completions", messages=MSGS, reasoning_format="none").json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": raw(server)}


def test_chat_stream(server):
    deltas = [c["choices"][0]["delta"] for c in stream(server, "/v1/chat/completions", messages=MSGS)]
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    if server.kind != "other":
        assert (reasoning, content) == (ANALYSIS, FINAL)
        assert not any(m in v for d in deltas for v in d.values() for m in ("<|", "<th", "</"))  # no marker or tag
    else:
        assert (reasoning, content) == ("", raw(server))


def test_chat_stream_logprobs(server):
    # Every token's logprob arrives once, even a delta that was all frame (an empty delta carries it).
    chunks = stream(server, "/v1/chat/completions", messages=MSGS, logprobs=True)
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    assert sum(len(lp["content"]) for lp in lps) == len(CHUNKS[server.kind])


def test_completions_unchanged(server):
    assert post(server, "/v1/completions", prompt="Hi").json()["choices"][0]["text"] == raw(server)
    texts = [c["choices"][0]["text"] for c in stream(server, "/v1/completions", prompt="Hi")]
    assert "".join(texts) == raw(server)


def test_official_client(server):
    # The OpenAI client keeps fields it does not know (reasoning_content) in model_extra.
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    msg = client.chat.completions.create(model="stub", messages=MSGS).choices[0].message
    content, reasoning = [], []
    for c in client.chat.completions.create(model="stub", messages=MSGS, stream=True):
        for ch in c.choices:
            content.append(ch.delta.content or "")
            reasoning.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
    want = (FINAL, ANALYSIS) if server.kind != "other" else (raw(server), None)
    assert (msg.content, (msg.model_extra or {}).get("reasoning_content")) == want
    assert ("".join(content), "".join(reasoning) or None) == want
