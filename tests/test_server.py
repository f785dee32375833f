"""optiml serve: a live server on loopback, driven by the official openai client and raw HTTP.

The oracle for generated text is optiml.Model run alone (chat/generate, greedy), which the engine's own
tests hold to transformers and llama.cpp; logprobs are checked against numpy float64 log-softmax of the
model's logits; JSON-schema answers are validated with jsonschema.
"""

import concurrent.futures
import json
import math
import socket
import time

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import optiml  # noqa: E402
from conftest import live_server, stream_long_and_short  # noqa: E402

KEY = "sk-test-key"
PARALLEL = 2
QUEUE = 3
N_CTX = 512


@pytest.fixture(scope="module")
def ref(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=N_CTX) as m:
        yield m


@pytest.fixture(scope="module")
def server(smollm2_path):
    from optiml.server import Server

    model = optiml.Model(smollm2_path, n_ctx=N_CTX, n_seq=PARALLEL)
    srv = Server(model, n_parallel=PARALLEL, api_key=KEY, model_id="smollm2", max_queue=QUEUE, chunk=32)
    with live_server(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(server, method, path, key=KEY, **kw):
    headers = kw.pop("headers", {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    kw.setdefault("timeout", 120)
    return httpx.request(method, server.url + path, headers=headers, **kw)


def wait_for(server, cond, what):
    for _ in range(400):  # bounded: 20 s
        h = http(server, "GET", "/health").json()
        if cond(h):
            return h
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {h}")


MSGS = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colors of the rainbow."}]


def test_chat_greedy_equals_model_chat(client, ref):
    want = ref.chat(MSGS, temperature=0, max_tokens=24)
    r = client.chat.completions.create(model="smollm2", messages=MSGS, temperature=0, max_tokens=24)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(ref.chat_prompt(MSGS))
    assert 0 < r.usage.completion_tokens <= 24
    # The same prompt again: the prefix cache serves all but the last prompt token, and the text is the same.
    r2 = client.chat.completions.create(model="smollm2", messages=MSGS, temperature=0, max_tokens=24)
    assert r2.choices[0].message.content == want
    assert r2.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens - 1


def test_stream_concatenates_to_the_answer(client):
    full = client.chat.completions.create(model="smollm2", messages=MSGS, temperature=0, max_tokens=20)
    pieces, usage, finish = [], None, None
    for c in client.chat.completions.create(model="smollm2", messages=MSGS, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_sends_its_role_with_the_first_token(server, ref):
    """A chat stream's first write is the role's chunk and the first token's together (app.py called as an
    ASGI app, every message it sends seen): a relay that sends a stream's pieces at intervals (optiml
    serve --ray) must not hold the first token back one interval behind a role-only piece."""
    import asyncio

    from optiml.server.app import create_app

    body = json.dumps({"messages": MSGS, "max_tokens": 6, "temperature": 0, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "",
             "query_string": b"", "headers": [(b"authorization", f"Bearer {KEY}".encode()),
                                              (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

    async def call():
        sent, done = [], asyncio.Event()
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)

        await create_app(server)(scope, receive, send)
        done.set()
        return sent

    sent = asyncio.run(call())
    writes = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
    events = [[json.loads(line[6:]) for line in w.decode().splitlines() if line.startswith("data: {")]
              for w in writes]
    first = events[0]
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(first) >= 2 and first[1]["choices"][0]["delta"].get("content")
    text = "".join(c["delta"].get("content") or "" for w in events for e in w for c in e["choices"])
    assert text == ref.chat(MSGS, temperature=0, max_tokens=6)


def test_completions_and_logprobs(client, ref):
    prompt = "The capital of France is"
    want = ref.generate(prompt, max_tokens=12, temperature=0)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    c = r.choices[0]
    assert c.text == want
    lp = c.logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs)
    assert "".join(lp.tokens) == want
    # The first token's logprob and its top 3 against numpy float64 log-softmax of the model's own logits.
    ref.reset()
    logits = ref.eval(ref.tokenize(prompt, add_bos=True, special=True)).astype(np.float64)
    ls = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    first = int(np.argmax(ls))
    assert lp.token_logprobs[0] == pytest.approx(ls[first], abs=1e-4)
    top = sorted(lp.top_logprobs[0].values(), reverse=True)
    np.testing.assert_allclose(top, np.sort(ls)[::-1][:3], atol=1e-4)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="smollm2", messages=MSGS, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert e.logprob <= 0


def test_concurrent_requests_match_alone(client, ref):
    questions = ["What is 2+2?", "Say hello in French.", "Name a fruit.", "What color is the sky?", "Count to five."]
    convs = [[{"role": "user", "content": q}] for q in questions]
    want = [ref.chat(c, temperature=0, max_tokens=16) for c in convs]

    def ask(c):
        r = client.chat.completions.create(model="smollm2", messages=c, temperature=0, max_tokens=16)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(len(convs)) as ex:  # more requests than slots: some queue
        got = list(ex.map(ask, convs))
    assert got == want


def test_n_choices_with_seed(client):
    kw = dict(model="smollm2", messages=MSGS, temperature=1.0, max_tokens=8, n=2, seed=7)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_stopping_the_server_drains_streams(smollm2_path):
    """SIGTERM (optiml serve under a process manager): a stream that ends within the drain time ends as
    usual, one still running then gets an error event and a proper end (it was cut mid-chunk, which clients
    read as "incomplete chunked read"), and the server exits."""
    import signal
    import subprocess
    import sys

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "optiml", "serve", "-m", str(smollm2_path), "--port", str(port),
                             "-t", "1", "--parallel", "2", "--ctx", "4096"], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(240):
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        got, readers = stream_long_and_short(url)
        proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(120)
        assert got["short"][-1] == "[DONE]"
        err = json.loads(got["long"][-1])["error"]
        assert err["code"] == "server_shutting_down" and len(got["long"]) < 3000
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_announces_its_address_once_it_listens(smollm2_path):
    """optiml serve prints its address (and the chat page's) once it listens there: on a port in use it says
    nothing of the kind and exits with uvicorn's status 3; on a free one the address answers when printed.
    (The model's line comes before, whatever happens: tests/test_visible_sparsity.py.)"""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "optiml", "serve", "-m", str(smollm2_path), "-t", "1", "--ctx", "256", "--port"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(cmd + [str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "http://" not in r.stdout and "address already in use" in r.stderr
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen(cmd + [str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        line = proc.stdout.readline()
        assert line.startswith("optiml serve: SmolLM2-135M-Instruct.Q4_1: ") and "FFN: " in line, line
        line = proc.stdout.readline()
        assert line == f"optiml serve: SmolLM2-135M-Instruct.Q4_1 on {url}/v1; chat page at {url}/\n", line
        assert httpx.get(url + "/", timeout=30).status_code == 200  # listening when announced
    finally:
        proc.terminate()
        proc.wait(60)


def test_every_seed_a_client_sends_is_reproducible(server):
    """4294967295 is the engine's "draw a random seed" (llama.cpp's); a client's seed is never taken for it,
    nor is seed + k for the k-th of n choices; top_p 0 (OpenAI's and llama.cpp's) keeps the likeliest token."""
    for seed, n in ((4294967295, 1), (4294967294, 2)):
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.5, "seed": seed, "n": n}
        a, b = (http(server, "POST", "/v1/completions", json=body).json() for _ in range(2))
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]], seed
    greedy = http(server, "POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                            "temperature": 0}).json()["choices"][0]["text"]
    r = http(server, "POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                       "temperature": 1.5, "top_p": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy


def test_json_schema_response_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 150}}}
    r = client.chat.completions.create(
        model="smollm2", max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Give me a person as JSON with a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # top logprobs under a grammar: only tokens it allows (fewer than asked where it allows fewer), never a
    # token without a probability
    r = client.chat.completions.create(
        model="smollm2", max_tokens=12, temperature=0, logprobs=True, top_logprobs=5,
        messages=[{"role": "user", "content": "Give me a person as JSON with a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    tops = [e.top_logprobs for e in r.choices[0].logprobs.content]
    assert all(t.logprob is not None and t.logprob > -math.inf for ts in tops for t in ts)
    assert min(len(ts) for ts in tops) < 5  # (the first token, "{", is the only one allowed)
    r = client.chat.completions.create(model="smollm2", max_tokens=60, temperature=0, messages=MSGS,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_n_greedy_choices_share_the_prompt(server, ref):
    prompt = "Zebras and giraffes live on the savanna, where"
    want = ref.generate(prompt, max_tokens=6, temperature=0)
    n_prompt = len(ref.tokenize(prompt, add_bos=True, special=True))
    before = _metric(http(server, "GET", "/metrics").text, "optiml_prompt_tokens_evaluated_total")
    r = http(server, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2})
    assert [c["text"] for c in r.json()["choices"]] == [want, want]
    evaluated = _metric(http(server, "GET", "/metrics").text, "optiml_prompt_tokens_evaluated_total") - before
    assert evaluated <= n_prompt + 1  # the second choice copied the first one's KV and ran only the last token


def _alive(server, ref_text=None):
    assert http(server, "GET", "/health").json()["status"] == "ok"
    r = http(server, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"messages": MSGS, "temperature": "hot"}, 400, "temperature"),
    ({"messages": MSGS, "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": MSGS, "n": 1.5}, 400, "n"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": MSGS, "frobnicate": True}, 400, "frobnicate"),
    ({"messages": MSGS, "tools": []}, 400, "tools"),
    ({"messages": MSGS, "response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ({"model": "gpt-9", "messages": MSGS}, 404, "model"),
    ({"messages": MSGS, "stream_options": {"include_usage": True}}, 400, "stream_options"),  # without stream
    ({"messages": MSGS, "stream": True, "stream_options": {"include_usage": "no"}}, 400,
     "stream_options.include_usage"),
    ({"messages": MSGS, "stream": True, "stream_options": {"usage": True}}, 400, "stream_options"),
    ({"messages": MSGS, "n": PARALLEL + QUEUE + 1}, 400, "n"),  # could never be admitted: not a 429
    (b"[" * 100000 + b"]" * 100000, 400, None),  # nested past Python's recursion limit
    ({"messages": MSGS, "\ud800": 1}, 400, "\ud800"),  # a lone surrogate, echoed in the message as a JSON escape
    ({"model": "\ud800", "messages": MSGS}, 404, "model"),
    ({"messages": MSGS, "repeat_penalty": 0}, 400, "repeat_penalty"),
    ({"messages": [{"role": "user", "content": "word " * 40000}]}, 400, "messages"),  # prepared off the event loop
])
def test_bad_requests(server, body, status, param):
    kw = {"content": body if isinstance(body, bytes) else json.dumps(body).encode()}  # (ASCII: surrogates escaped)
    r = http(server, "POST", "/v1/chat/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert err["param"] == param
    _alive(server)


def test_completions_requests_name_their_own_fields(server):
    r = http(server, "POST", "/v1/completions", json={"prompt": ["Hi", "word " * 600], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and "prompt 1 " in r.json()["error"]["message"]
    r = http(server, "POST", "/v1/completions", json={"prompt": [[True, 5]], "max_tokens": 2})  # not token ids
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = http(server, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"] == "'max_tokens' must be >= 1, got 0"


def test_what_clients_send_for_the_defaults_is_accepted(server, ref):
    """Unsupported fields sent as null (clients that send every field), the model by its file's or its known
    names in any case, the Bearer scheme in any case."""
    want = ref.chat(MSGS, temperature=0, max_tokens=4)
    for model in ("smollm2", "SmolLM2-135M-Instruct.Q4_1", "smollm2-135m-instruct.q4_1.gguf", "SmolLM2-135M-Instruct",
                  ""):
        r = http(server, "POST", "/v1/chat/completions", headers={"Authorization": f"bearer {KEY}"}, key=None,
                 json={"model": model, "messages": MSGS, "temperature": 0, "max_tokens": 4, "tools": None,
                       "tool_choice": None})
        assert r.status_code == 200, (model, r.text)
        assert r.json()["choices"][0]["message"]["content"] == want
        assert r.json()["model"] == "smollm2"
    # OpenAI's stream_options.include_obfuscation (some clients turn it off): taken, nothing to obfuscate here
    r = http(server, "POST", "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "stream": True,
             "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert r.status_code == 200 and '"usage":{' in r.text


def test_text_offsets_count_characters(server):
    """Completions' text_offset: where each token starts in the answer's text, in characters, also when a
    character's bytes span tokens (each piece decoded alone would count one U+FFFD per fragment)."""
    text = "Tokyo 東京, Zürich and 😀 ok"
    ids = server.tokenizer.encode(text, add_special=False)
    pieces = [server.piece(t) for t in ids]
    assert b"".join(pieces).decode() == text
    assert any(p and p.decode("utf-8", "replace") != p.decode("utf-8", "ignore") for p in pieces)  # split characters
    got = server.completion_logprobs([(t, -1.0, []) for t in ids], 5)["text_offset"]
    want = [5 + len(b"".join(pieces[:i]).decode("utf-8", "ignore")) for i in range(len(ids))]
    assert got == want


def test_cors_preflight(server):
    """Browsers' preflight: a page served from this machine may call the API; another site may not."""
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = http(server, "OPTIONS", "/v1/chat/completions", key=None, headers={"Origin": "http://localhost:3000", **ask})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = http(server, "OPTIONS", "/v1/chat/completions", key=None, headers={"Origin": "https://example.com", **ask})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = http(server, "GET", "/v1/models", headers={"Origin": "http://127.0.0.1:5173"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://127.0.0.1:5173"


def test_a_bug_is_a_500_a_page_can_read(server, monkeypatch):
    """An exception no route expects: a 500 in OpenAI's shape, with the CORS headers a page needs to read it,
    counted in /metrics; the server goes on."""
    def broken(body):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "check_model", broken)
    r = http(server, "POST", "/v1/chat/completions", json={"messages": MSGS}, headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError: a bug"
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert _metric(http(server, "GET", "/metrics").text, "optiml_requests_total", 'endpoint="chat",status="500"') >= 1
    monkeypatch.undo()
    _alive(server)


def test_auth_and_routes(server):
    r = http(server, "POST", "/v1/chat/completions", key=None, json={"messages": MSGS})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert http(server, "GET", "/v1/models", key="wrong").status_code == 401
    models = http(server, "GET", "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    assert http(server, "GET", "/v1/models/other").status_code == 404
    r = http(server, "GET", "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert http(server, "GET", "/health", key=None).status_code == 200
    _alive(server)


def _metric(text, name, labels=""):
    for line in text.splitlines():
        if line.startswith(name + (("{" + labels + "}") if labels else "") + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_move(server):
    before = http(server, "GET", "/metrics").text
    r = http(server, "POST", "/v1/completions", json={"prompt": "One, two,", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    after = http(server, "GET", "/metrics").text
    for name, labels in [("optiml_requests_total", 'endpoint="completions",status="200"'),
                         ("optiml_generated_tokens_total", ""), ("optiml_prompt_tokens_total", ""),
                         ("optiml_time_to_first_token_seconds_count", ""), ("optiml_batch_tokens_count", "")]:
        assert _metric(after, name, labels) > _metric(before, name, labels), name
    assert _metric(after, "optiml_inter_token_latency_seconds_count") >= 3
    assert "optiml_queue_depth" in after


LONG = {"prompt": "Once upon a time", "max_tokens": N_CTX, "temperature": 0, "stream": True,
        "logit_bias": {"0": -100, "2": -100}}  # no end of text: the stream runs until closed


def test_queue_full_and_disconnect_frees_slots(server):
    wait_for(server, lambda h: h["slots_idle"] == PARALLEL and h["queue"] == 0, "an idle server")
    streams, ctxs = [], []
    for _ in range(PARALLEL):  # occupy every slot with a stream that does not end by itself
        cm = httpx.stream("POST", server.url + "/v1/completions", json=LONG, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"})
        r = cm.__enter__()
        assert r.status_code == 200
        it = r.iter_lines()
        while not next(it).startswith("data: "):  # the first token arrived: the slot is taken
            pass
        streams.append(it)
        ctxs.append(cm)
    # Fill the queue with a request of QUEUE choices, in the background.
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
        http, server, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": QUEUE})
    wait_for(server, lambda h: h["queue"] == QUEUE, "a full queue")
    r = http(server, "POST", "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    # Closing the streams frees both slots; the queued request then runs to completion.
    cancelled = 'endpoint="completions",status="499"'
    before = _metric(http(server, "GET", "/metrics").text, "optiml_requests_total", cancelled)
    for cm in ctxs:
        cm.__exit__(None, None, None)
    assert waiting.result(timeout=60).status_code == 200
    wait_for(server, lambda h: h["slots_idle"] == PARALLEL and h["queue"] == 0, "freed slots")
    # /metrics counts the two streams as cancelled by their clients, not as answered
    assert _metric(http(server, "GET", "/metrics").text, "optiml_requests_total", cancelled) == before + PARALLEL
    _alive(server)


def test_disconnect_without_stream_frees_slot(server):
    wait_for(server, lambda h: h["slots_idle"] == PARALLEL and h["queue"] == 0, "an idle server")
    before = _metric(http(server, "GET", "/metrics").text, "optiml_generated_tokens_total")
    body = json.dumps(dict(LONG, stream=False)).encode()
    host, port = server.url[len("http://"):].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(server, lambda h: h["slots_processing"] == 1, "the request to take a slot")
    wait_for(server, lambda h: h["slots_idle"] == PARALLEL, "the slot to be freed")
    generated = _metric(http(server, "GET", "/metrics").text, "optiml_generated_tokens_total") - before
    assert generated < N_CTX - 8  # stopped long before the context was full: the slot was freed by the close
    _alive(server)
