"""optiml serve on Ray Serve (optiml.server.ray_serve): a real local Ray cluster, two replicas of SmolLM2.

The cluster is the one `optiml serve --ray` starts itself (python -m optiml.server.ray_serve, on loopback,
2 CPUs, no dashboard), in a subprocess with its own Ray temp folder; the last test stops it with SIGTERM
and checks that no process of that cluster is left. The oracles: optiml.Model alone for greedy text, a
single-node optiml serve (tests/conftest.py's live_server) for the status and body of bad requests.
"""

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

if os.environ.get("CI"):  # CI installs optiml[ray]: the tests must run there, not skip
    import ray  # noqa: F401
else:
    pytest.importorskip("ray", reason='Ray Serve is not installed: pip install "optiml[ray]"')
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import optiml  # noqa: E402
from conftest import live_server  # noqa: E402

KEY = "sk-ray-key"
N_CTX = 512
PARALLEL = 2
MSGS = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colors of the rainbow."}]
REPLICA = "x-optiml-replica"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_pids(tmp: str) -> list:
    """Processes of the Ray cluster whose temp folder is `tmp` (it is on each one's command line)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if tmp.encode() in cmd:
                pids.append(int(d))
    return pids


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    """`optiml serve --ray --replicas 2` (python -m optiml.server.ray_serve), one thread per replica."""
    tmp = tempfile.mkdtemp(prefix="oray-", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    # The optiml these tests import (a checkout's python/ or the installed wheel), for the subprocess.
    where = os.path.dirname(os.path.dirname(os.path.abspath(optiml.__file__)))
    env = dict(os.environ, RAY_TMPDIR=tmp, PYTHONPATH=os.pathsep.join(
        [where] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("RAY_ADDRESS", None)
    log = open(os.path.join(tmp, "serve.log"), "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "optiml.server.ray_serve", "-m", str(smollm2_path), "--replicas", "2", "--threads", "1",
         "--parallel", str(PARALLEL), "--ctx", str(N_CTX), "--alias", "smollm2", "--api-key", KEY, "--port", str(port),
         "--queue", "8"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    state = {"proc": proc, "tmp": tmp, "url": url, "log": log}
    try:
        deadline = time.monotonic() + 600  # a busy machine (CI beside other jobs) starts Ray slowly
        while "optiml serve --ray:" not in _read(log):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"optiml serve --ray did not start:\n{_read(log)[-4000:]}")
            time.sleep(0.5)
        yield state
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid in _cluster_pids(tmp):  # what a failed test left behind: never leave a cluster running
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=N_CTX) as m:
        yield m


@pytest.fixture(scope="module")
def single(smollm2_path):
    """The single-node server with the same settings: the oracle for errors."""
    from optiml.server import Server

    srv = Server(optiml.Model(smollm2_path, n_ctx=N_CTX, n_seq=1, n_threads=1), n_parallel=1, api_key=KEY,
                 model_id="smollm2", max_queue=8)
    with live_server(srv):
        yield srv


def http(url, method, path, key=KEY, **kw):
    headers = kw.pop("headers", {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    kw.setdefault("timeout", 120)
    return httpx.request(method, url + path, headers=headers, **kw)


def test_prompt_text_and_block_hashes():
    """What the router matches: the messages' roles and contents in order, or the prompt; prefixes of
    whole blocks hash alike."""
    from optiml.server.ray_serve import block_hashes, prompt_text

    chat = json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}).encode()
    assert prompt_text("/v1/chat/completions", chat) == "\x00system\x00Be brief.\x00user\x00Hi"
    assert prompt_text("/v1/completions", b'{"prompt": ["first", "second"]}') == "first"
    assert prompt_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == "1,2,3,"
    assert prompt_text("/v1/completions", b"{not json") == ""
    assert prompt_text("/v1/models", b"") == ""
    a, b = block_hashes("x" * 64 + "y" * 64 + "z" * 10, 64), block_hashes("x" * 64 + "w" * 64, 64)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]


def test_router_wakes_a_waiting_round_when_a_request_completes():
    """With every slot busy, Ray Serve's router sleeps between rounds; a finished request wakes the
    longest-waiting round at once instead (no cluster: the router alone, its sleep set to an hour, so a
    round that is not woken fails by the timeout). Without a completion the sleep still ends."""
    import asyncio

    from optiml.server.ray_serve import PrefixAffinityRouter

    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # what _backoff needs of one, without Ray
    r.initial_backoff_s, r.backoff_multiplier, r.max_backoff_s = 3600.0, 2, 3600.0
    r.initialize_state()

    async def woken():
        first, second = asyncio.ensure_future(r._backoff(0)), asyncio.ensure_future(r._backoff(0))
        await asyncio.sleep(0.01)
        r.on_request_completed("replica-a", "request-1")
        await asyncio.wait_for(first, 30)  # the longest-waiting round first
        assert not second.done()
        r.on_request_completed("replica-b", "request-2")
        await asyncio.wait_for(second, 30)

    asyncio.run(woken())
    r.initial_backoff_s = r.max_backoff_s = 0.001
    asyncio.run(asyncio.wait_for(r._backoff(3), 30))
    assert not r._asleep  # a sleep that ran out leaves nothing behind


def test_stream_pieces_merge_and_the_end_goes_at_once():
    """Replica.forward over a stand-in ASGI app (no cluster): the head goes with the first body at once, what
    comes before the next piece is due goes together, and the end of the body goes as soon as it comes,
    with an interval of an hour that would otherwise hold it (a hang here fails by the timeout)."""
    import asyncio

    from optiml.server.ray_serve import Forwarded, Head, Replica

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await asyncio.sleep(0.05)  # after the head has gone: b and c come before the next piece is due
        await send({"type": "http.response.body", "body": b"b", "more_body": True})
        await send({"type": "http.response.body", "body": b"c", "more_body": False})

    replica = Replica.__new__(Replica)  # what forward needs of one, without Ray
    replica.app, replica.name, replica.interval = app, "test@0", 3600.0

    async def collect():
        req = Forwarded("POST", "/v1/completions", b"", [], b"{}", None)
        return [item async for item in replica.forward(req)]

    head, *rest = asyncio.run(asyncio.wait_for(collect(), 30))
    assert isinstance(head, Head) and (head.status, head.body, head.done) == (200, b"a", False)
    assert rest == [b"bc"]


def test_chat_greedy_equals_model_chat(client, ref):
    want = ref.chat(MSGS, temperature=0, max_tokens=24)
    r = client.chat.completions.create(model="smollm2", messages=MSGS, temperature=0, max_tokens=24)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ref.chat_prompt(MSGS))
    prompt = "The capital of France is"
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.generate(prompt, max_tokens=12, temperature=0)


def test_stream_concatenates_to_the_answer(client, ref):
    want = ref.chat(MSGS, temperature=0, max_tokens=20)
    pieces, usage, finish = [], None, None
    for c in client.chat.completions.create(model="smollm2", messages=MSGS, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == want
    assert finish in ("stop", "length") and usage is not None and usage.completion_tokens > 0


def test_json_schema_and_models(client, cluster):
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
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert http(cluster["url"], "GET", "/health", key=None).json()["status"] == "ok"


BAD = [
    ("POST", "/v1/chat/completions", KEY, b"{not json"),
    ("POST", "/v1/chat/completions", KEY, b"[1, 2]"),
    ("POST", "/v1/chat/completions", KEY, {"messages": MSGS, "temperature": "hot"}),
    ("POST", "/v1/chat/completions", KEY, {"messages": MSGS, "max_tokens": -1}),
    ("POST", "/v1/chat/completions", KEY, {"messages": [{"role": "wizard", "content": "x"}]}),
    ("POST", "/v1/chat/completions", KEY, {"messages": MSGS, "frobnicate": True}),
    ("POST", "/v1/chat/completions", KEY, {"messages": MSGS, "tools": []}),
    ("POST", "/v1/chat/completions", KEY, {"messages": [{"role": "user", "content": "word " * 600}]}),
    ("POST", "/v1/chat/completions", KEY, {"model": "gpt-9", "messages": MSGS}),
    ("POST", "/v1/completions", KEY, {"prompt": "", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", None, {"messages": MSGS}),
    ("GET", "/v1/models", "wrong", None),
    ("GET", "/v1/models/other", KEY, None),
    ("GET", "/v1/nothing", KEY, None),
]


def test_bad_requests_answered_as_the_single_node_server(cluster, single):
    for method, path, key, body in BAD:
        kw = {} if body is None else {"content": body} if isinstance(body, bytes) else {"json": body}
        want = http(single.url, method, path, key=key, **kw)
        got = http(cluster["url"], method, path, key=key, **kw)
        assert want.status_code >= 400, (path, body)
        assert (got.status_code, got.json()) == (want.status_code, want.json()), (method, path, body)
    too_big = b"x" * (16 << 20 | 1)  # app.py's body limit, refused by the ingress before any replica
    page = {"Origin": "http://localhost:3000"}  # a local page reads the ingress's own answers as a replica's
    got = http(cluster["url"], "POST", "/v1/completions", content=too_big, headers=page)
    want = http(single.url, "POST", "/v1/completions", content=too_big, headers=page)
    assert (got.status_code, got.json()) == (want.status_code, want.json()) and got.status_code == 413
    assert got.headers["access-control-allow-origin"] == want.headers["access-control-allow-origin"] == page["Origin"]


def test_prefix_affinity(cluster):
    """Each conversation's second turn goes to the replica that served its first and reads the shared
    prefix from that replica's cache."""
    url = cluster["url"]
    seen = set()
    for k in range(12):  # until both replicas served one (new prefixes go to a random one of idle equals)
        if k >= 4 and len(seen) == 2:
            break
        conv = [{"role": "system", "content": f"Conversation {k}. You are a terse assistant who answers with one "
                                              f"word, and conversation {k} is about animal number {k * 7}."},
                {"role": "user", "content": "Name an animal."}]
        r1 = http(url, "POST", "/v1/chat/completions", json={"messages": conv, "max_tokens": 4, "temperature": 0})
        assert r1.status_code == 200, r1.text
        conv = conv + [{"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "Another one?"}]
        r2 = http(url, "POST", "/v1/chat/completions", json={"messages": conv, "max_tokens": 4, "temperature": 0})
        assert r2.status_code == 200, r2.text
        assert r2.headers[REPLICA] == r1.headers[REPLICA]
        usage = r2.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= r1.json()["usage"]["prompt_tokens"] - 1
        seen.add(r1.headers[REPLICA])
    assert len(seen) == 2  # spread over both replicas (all 12 on one by chance: 1 in 2048)


LONG = dict(model="smollm2", max_tokens=160, temperature=0, logit_bias={"0": -100, "2": -100})  # no end of text


def test_replica_killed_mid_stream(cluster, client):
    """Four requests (two streams, two plain) over both replicas; one replica is killed while they run.
    Every request completes or gets an error, none hangs, the survivor keeps serving and Ray Serve
    starts a replacement."""
    started = []  # (replica, stream) in order
    outcomes = {}
    ready = threading.Event()

    def stream(i):
        try:
            s = client.chat.completions.create(messages=[{"role": "user", "content": f"Tell story number {i}."}],
                                               stream=True, **LONG)
            it = iter(s)
            next(it)
            started.append((s.response.headers[REPLICA], i))
            ready.set()
            finish = None
            for c in it:
                for ch in c.choices:
                    finish = ch.finish_reason or finish
            outcomes[i] = ("complete", finish) if finish else ("lost", None)
        except openai.APIError as e:
            outcomes[i] = ("error", str(e))

    def plain(i):
        try:
            r = client.completions.create(prompt=f"Story number {i}:", **LONG)
            outcomes[i] = ("complete", r.choices[0].finish_reason)
        except openai.APIError as e:
            outcomes[i] = ("error", str(e))

    pool = concurrent.futures.ThreadPoolExecutor(4)
    futures = []
    for i in range(2):  # one at a time: each next stream finds the other replica less busy
        ready.clear()
        futures.append(pool.submit(stream, i))
        assert ready.wait(60), "a stream did not start"
    assert len({r for r, _ in started}) == 2, started  # the second stream went to the idle replica
    futures += [pool.submit(plain, i) for i in (2, 3)]
    time.sleep(0.5)
    victim = started[0][0]
    os.kill(int(victim.split("@")[1]), signal.SIGKILL)
    t_kill = time.monotonic()
    done, hung = concurrent.futures.wait(futures, timeout=300)  # 160 tokens each, on a survivor that may be starved
    pool.shutdown(wait=False)
    assert not hung, f"{len(hung)} requests hung {time.monotonic() - t_kill:.0f} s after the kill: {outcomes}"
    print(f"after the kill: every request ended within {time.monotonic() - t_kill:.0f} s: {outcomes}")
    assert all(f.exception() is None for f in futures)
    assert sorted(outcomes) == [0, 1, 2, 3]
    assert not [i for i, (kind, _) in outcomes.items() if kind == "lost"], outcomes
    for replica, i in started:  # the streams on the killed replica saw an error, the others their end
        assert outcomes[i][0] == ("error" if replica == victim else "complete"), (replica, victim, outcomes)
    # The survivor answers now; the replacement answers once Ray Serve has started it.
    replicas = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (replicas - {victim} - {r for r, _ in started}):
        r = http(cluster["url"], "POST", "/v1/completions", json={"prompt": f"Hi {len(replicas)}", "max_tokens": 2})
        if r.status_code == 200:
            replicas.add(r.headers[REPLICA])
        else:  # the router may still pick the dead replica once: an error, never a hang
            assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed", r.text
        time.sleep(0.2)
    assert victim not in replicas
    assert replicas - {r for r, _ in started}, f"no replacement replica answered: {replicas}"


def test_stop_stops_the_local_cluster(cluster):
    """SIGTERM (as Ctrl-C) ends optiml serve --ray and the Ray cluster it started: no process is left."""
    proc, tmp = cluster["proc"], cluster["tmp"]
    assert _cluster_pids(tmp), "the Ray cluster's processes were not found"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, _read(cluster["log"])[-3000:]
    deadline = time.monotonic() + 30
    while _cluster_pids(tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _cluster_pids(tmp), f"left running: {_cluster_pids(tmp)}"
