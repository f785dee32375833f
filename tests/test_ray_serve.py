"""optiml serve on Ray Serve (optiml.server.ray_serve): a real local Ray cluster, two replicas of SmolLM2.

The cluster is the one `optiml serve --ray` starts itself (python -m optiml.server.ray_serve, on loopback,
2 CPUs, no dashboard), in a subprocess with its own Ray temp folder; the last test on it stops it with SIGTERM
and checks that no process of that cluster is left. The tests after it start their own, one replica each:
the shutdown's drain, a port in use, a replica that cannot start, Ctrl-C while Ray starts. The oracles:
optiml.Model alone for greedy text, a single-node optiml serve (tests/conftest.py's live_server) for the
status and body of bad requests, and for the shutdown (tests/test_server.py's drain test).
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
from conftest import live_server, stream_long_and_short  # noqa: E402

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
    """Processes of the Ray cluster whose temp folder is `tmp`, which is also the server's working folder:
    on the command line of Ray's own processes, the working folder of all (Ray's agents and workers rename
    their command line, over their environment)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
                cwd = os.readlink(f"/proc/{d}/cwd")
                if Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # exited, not yet reaped
            except OSError:
                continue
            if tmp.encode() in cmd or cwd == tmp or cwd.startswith((tmp + "/", tmp + " ")):  # " (deleted)"
                pids.append(int(d))
    return pids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _no_cluster_left(tmp: str) -> list:
    """The processes of the cluster at `tmp` still running once they had 30 s to exit."""
    deadline = time.monotonic() + 30
    while _cluster_pids(tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [(pid, _cmdline(pid).split(b"\0")[0][:80]) for pid in _cluster_pids(tmp)]


def _ctrl_c_as_a_terminal_gives_it():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # not ignored, as a test runner started in the background has it


def _new_tmp():
    """A Ray temp folder (and the server's working folder) and the server's log in it."""
    tmp = tempfile.mkdtemp(prefix="oray-", dir="/tmp")  # short: Ray's socket paths live under it
    return tmp, open(os.path.join(tmp, "serve.log"), "w+")


def _launch(tmp: str, args: list, log, ctrl_c: bool = False) -> subprocess.Popen:
    """python -m optiml.server.ray_serve ARGS (optiml serve --ray) with its own Ray temp folder `tmp`; ctrl_c:
    SIGINT acts in it (Python turns it into KeyboardInterrupt) even if it is ignored here."""
    # The optiml these tests import (a checkout's python/ or the installed wheel), for the subprocess.
    where = os.path.dirname(os.path.dirname(os.path.abspath(optiml.__file__)))
    env = dict(os.environ, RAY_TMPDIR=tmp, PYTHONPATH=os.pathsep.join(
        [where] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "optiml.server.ray_serve"] + [str(a) for a in args],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp,
                            preexec_fn=_ctrl_c_as_a_terminal_gives_it if ctrl_c else None)


def _wait_started(proc, log) -> None:
    deadline = time.monotonic() + 600  # a busy machine (CI beside other jobs) starts Ray slowly
    while "optiml serve --ray:" not in _read(log):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"optiml serve --ray did not start:\n{_read(log)[-4000:]}")
        time.sleep(0.5)


def _stop(proc, tmp: str, log) -> None:
    """Ends what a test started, whatever happened: the server, then any process of its cluster."""
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


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    """`optiml serve --ray --replicas 2` (python -m optiml.server.ray_serve), one thread per replica."""
    tmp, log = _new_tmp()
    port = _free_port()
    proc = _launch(tmp, ["-m", smollm2_path, "--replicas", "2", "--threads", "1", "--parallel", PARALLEL,
                         "--ctx", N_CTX, "--alias", "smollm2", "--api-key", KEY, "--port", port, "--queue", "8"], log)
    try:
        _wait_started(proc, log)
        yield {"proc": proc, "tmp": tmp, "url": f"http://127.0.0.1:{port}", "port": port, "log": log}
    finally:
        _stop(proc, tmp, log)


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


class _Answer:
    """A replica's answer as the ingress sees it (a DeploymentResponseGenerator): `items` in order; after
    them it ends, or waits until cancelled when `forever`."""

    def __init__(self, items, forever=False, until=None):
        self.items, self.forever, self.until, self.cancelled = list(items), forever, until, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        import asyncio

        if self.items:
            await asyncio.sleep(0)
            return self.items.pop(0)
        if self.until is not None:  # the end comes when the test says so
            await self.until.wait()
            self.until = None
            return b"data: [DONE]\r\n\r\n"
        if self.forever:
            await asyncio.Event().wait()  # until cancelled
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class _Replicas:
    """The ingress's deployment handle: request k gets answers[k]."""

    def __init__(self, answers):
        self.answers = answers

    def options(self, **kw):
        return self

    def remote(self, req):
        return self.answers[json.loads(req.body)["k"]]


def _request(k: str):
    from starlette.requests import Request

    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps({"k": k}).encode(), "more_body": False}
        import asyncio

        await asyncio.Event().wait()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "headers": [], "client": ("127.0.0.1", 1)}
    return Request(scope, receive)


def test_ingress_drain_as_the_single_node_server(monkeypatch):
    """Ingress.drain (no cluster; Ray Serve's handle and answers stood in for): new requests get a 503
    (server_shutting_down) at once; a running stream that ends within the drain time ends as usual and drain
    returns then (the drain time is an hour here: a drain that waited it out fails by the timeout); with a
    short drain time, a stream still running ends with the shutdown's error event instead of a cut, and a
    request whose answer has not begun gets the 503; the replicas' answers left are cancelled."""
    import asyncio

    from optiml.server import ray_serve
    from optiml.server.ray_serve import Head, Ingress

    sse = [(b"content-type", b"text/event-stream")]

    def stream(**kw):
        return _Answer([Head(200, sse, "r@1", b"data: 1\r\n\r\n", False), b"data: 2\r\n\r\n"], **kw)

    async def body(resp) -> list:
        return [part async for part in resp.body_iterator]

    def error(resp) -> dict:
        return json.loads(resp.body)["error"]

    async def finishing():
        monkeypatch.setattr(ray_serve, "SHUTDOWN_DRAIN_S", 3600.0)
        end = asyncio.Event()
        ingress = Ingress(_Replicas({"ends": stream(until=end)}))
        resp = await ingress(_request("ends"))
        reading = asyncio.ensure_future(body(resp))
        drain = asyncio.ensure_future(ingress.drain())
        await asyncio.sleep(0)
        late = await ingress(_request("ends"))
        assert (late.status_code, error(late)["code"]) == (503, "server_shutting_down")
        assert late.headers["retry-after"] == "1"
        end.set()  # the stream ends within the drain time
        assert await reading == [b"data: 1\r\n\r\n", b"data: 2\r\n\r\n", b"data: [DONE]\r\n\r\n"]
        assert await drain == 0

    async def cut():
        monkeypatch.setattr(ray_serve, "SHUTDOWN_DRAIN_S", 0.05)
        answers = {"long": stream(forever=True), "unbegun": _Answer([], forever=True)}
        ingress = Ingress(_Replicas(answers))
        resp = await ingress(_request("long"))
        reading = asyncio.ensure_future(body(resp))
        waiting = asyncio.ensure_future(ingress(_request("unbegun")))
        await asyncio.sleep(0)
        assert await ingress.drain() == 0
        parts = await reading
        assert parts[:2] == [b"data: 1\r\n\r\n", b"data: 2\r\n\r\n"] and len(parts) == 3
        assert parts[-1].startswith(b"data: ") and parts[-1].endswith(b"\r\n\r\n")
        event = json.loads(parts[-1][6:])["error"]
        assert event == {"message": "the server is shutting down; retry the request", "type": "server_error",
                         "param": None, "code": "server_shutting_down"}
        unbegun = await waiting
        assert (unbegun.status_code, error(unbegun)["code"]) == (503, "server_shutting_down")
        assert answers["long"].cancelled and answers["unbegun"].cancelled

    asyncio.run(asyncio.wait_for(finishing(), 60))
    asyncio.run(asyncio.wait_for(cut(), 60))


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


def _listeners(pids) -> list:
    """(process name, address, port, on loopback) of each TCP socket that one of `pids` listens on (Linux)."""
    owner = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owner[link[8:-1]] = name
        except OSError:
            continue
    out = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = row.split()
            if f[3] != "0A" or f[9] not in owner:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            # The address in hex, as the kernel keeps it: IPv4 (and IPv4 in IPv6) little-endian, 127 last.
            loop = (addr[-2:] == "7F" if table == "tcp" else
                    addr == "0" * 24 + "01000000" or (addr[:24] == "0" * 16 + "FFFF0000" and addr[-2:] == "7F"))
            out.append((owner[f[9]], addr, int(port, 16), loop))
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_the_local_cluster_listens_on_loopback(cluster):
    """What docs/serve.md says: the local cluster's sockets (GCS, raylet, agents, Serve's proxy and
    controller) are on loopback; the only others are Ray Serve's replicas' own gRPC servers, which Ray Serve
    2.60 binds on every interface (they refuse calls without the cluster's token)."""
    found = _listeners(_cluster_pids(cluster["tmp"]))
    names = {name for name, _, _, loop in found if loop}
    assert any(port == cluster["port"] and loop for _, _, port, loop in found), found  # the HTTP proxy
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), found
    assert all(name.startswith("ray::ServeReplica") for name, _, _, loop in found if not loop), found


def test_stop_stops_the_local_cluster(cluster):
    """SIGTERM (as Ctrl-C) ends optiml serve --ray and the Ray cluster it started: no process is left."""
    proc, tmp = cluster["proc"], cluster["tmp"]
    assert _cluster_pids(tmp), "the Ray cluster's processes were not found"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, _read(cluster["log"])[-3000:]
    assert not _no_cluster_left(tmp)


def test_stop_drains_running_answers(smollm2_path):
    """SIGTERM (or Ctrl-C) while streams run, as the single-node server: new requests get a 503
    (server_shutting_down), a stream that ends within the drain time ends as usual, one still running then
    gets the shutdown's error event and a proper end (Ray Serve's proxy was stopped at once: "incomplete
    chunked read"), and no Ray traceback or shutdown noise in the log; nothing of the cluster is left."""
    tmp, log = _new_tmp()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch(tmp, ["-m", smollm2_path, "--threads", "1", "--parallel", "2", "--ctx", "4096", "--port", port], log)
    try:
        _wait_started(proc, log)
        served = len(_read(log))
        got, readers = stream_long_and_short(url)
        proc.send_signal(signal.SIGTERM)
        refused = None
        while readers[0].is_alive() and refused is None:  # the long stream runs through the drain time
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
            if r.status_code != 200:
                refused = (r.status_code, r.json()["error"]["code"])
        for t in readers:
            t.join(120)
        assert refused == (503, "server_shutting_down")
        assert got["short"][-1] == "[DONE]"
        err = json.loads(got["long"][-1])["error"]
        assert err["code"] == "server_shutting_down" and len(got["long"]) < 3000
        assert proc.wait(120) == 0
        after = _read(log)[served:]
        assert "Traceback" not in after and "graceful_shutdown failed" not in after, after[-3000:]
        assert not _no_cluster_left(tmp)
    finally:
        _stop(proc, tmp, log)


def test_port_in_use_is_one_line(smollm2_path):
    """A taken port: one line saying so and exit status 3 (the single-node server's), at once, before any
    Ray process starts (it was a 70-line Ray traceback after some 9 s)."""
    tmp, log = _new_tmp()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _launch(tmp, ["-m", smollm2_path, "--threads", "1", "--port", port], log)
        try:
            assert proc.wait(120) == 3
            out = _read(log)
            assert out.strip().splitlines()[-1] == f"optiml serve --ray: cannot listen on 127.0.0.1:{port}: " \
                                                   "address already in use", out
            assert "Traceback" not in out
            assert not _no_cluster_left(tmp)
        finally:
            _stop(proc, tmp, log)


def test_a_replica_that_cannot_start_says_why(smollm2_path):
    """A replica whose model does not load (a truncated GGUF file): the last line names the replica's own
    error, not only Ray Serve's "failed to update the deployments"; nothing of the cluster is left."""
    tmp, log = _new_tmp()
    bad = Path(tmp) / "bad.gguf"
    with open(smollm2_path, "rb") as f:
        bad.write_bytes(f.read(1_000_000))
    proc = _launch(tmp, ["-m", bad, "--threads", "1", "--port", _free_port()], log)
    try:
        assert proc.wait(600) == 1
        last = _read(log).strip().splitlines()[-1]
        assert last.startswith("optiml serve --ray: the replicas did not start: GGUFError: " + str(bad)), last
        assert not _no_cluster_left(tmp)
    finally:
        _stop(proc, tmp, log)


def test_ctrl_c_while_ray_starts_leaves_nothing(smollm2_path):
    """Ctrl-C while Ray's processes are still starting (ray.init): optiml serve --ray stops them all (an
    interrupt there left Ray's agents running) and never announces that it serves."""
    tmp, log = _new_tmp()
    proc = _launch(tmp, ["-m", smollm2_path, "--threads", "1", "--port", _free_port()], log, ctrl_c=True)
    try:
        def raylet_up():  # ray.init is under way: the raylet is starting Ray's agents
            return any(b"raylet" in _cmdline(pid) for pid in _cluster_pids(tmp))

        deadline = time.monotonic() + 300
        while not raylet_up():
            assert proc.poll() is None and time.monotonic() < deadline, _read(log)[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
        assert "optiml serve --ray:" not in _read(log)
        assert not _no_cluster_left(tmp), _read(log)[-3000:]
    finally:
        _stop(proc, tmp, log)
