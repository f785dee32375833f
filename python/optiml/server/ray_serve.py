"""optiml serve on Ray Serve: several replicas of the same server behind one OpenAI-compatible endpoint
(pip install "optiml[ray]").

When one machine (or one process) is not enough, Ray Serve runs the replicas, places them on nodes with
the CPUs and GPUs they ask for, health-checks them and replaces the ones that die. Each replica is the
single-node server unchanged: an optiml.Model, its Scheduler thread (continuous batching, prefix cache)
and the Starlette routes of app.py, called in-process. Two deployments make one Ray Serve application:

    HTTP client -> Ray Serve's proxy -> OptimlIngress -> (PrefixAffinityRouter) -> OptimlReplica x N

  OptimlIngress  reads the request body, takes the prompt's text from it (messages or prompt) and
                 forwards the whole request to a replica through a deployment handle; it relays the
                 replica's response (JSON or server-sent events) and turns a replica's failure into an
                 error the client sees (503 before the answer starts, an SSE error event after). Told to
                 stop (Ingress.drain), it drains the answers as the single-node server does.
  OptimlReplica  runs app.py's routes on the forwarded request and yields the response as it comes.
  PrefixAffinityRouter (Ray Serve's custom request router API) sends a request to the replica that
                 served the longest prefix of its text recently (so its prefix cache pays), unless that
                 replica is busier than the least busy one by more than `imbalance` requests.

The routing needs the ingress hop: Ray Serve's proxy hands a replica the HTTP request before its body
is read, so a router behind the proxy sees no prompt. The ingress is an async relay with no CPU
reserved (num_cpus=0).

Entry points:
    serve_ray(model, replicas=2, ...)   what `optiml serve --ray` runs: starts a local Ray cluster (or
                                         joins one at `address`), deploys, serves until stopped, and
                                         stops the cluster it started
    build(model, ...)                    the Ray Serve application, for serve.run
    build_app(args)                      the same for `serve run` / `serve deploy` and a YAML config
                                         (ray_serve.example.yaml beside this file)
    main(argv)                           `python -m optiml.server.ray_serve -m MODEL --replicas 2`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import time

RAY_MISSING = 'optiml serve --ray needs Ray Serve: pip install "optiml[ray]"'

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as e:  # the single-node server never imports this module
    raise ImportError(f"{RAY_MISSING} ({e})") from e

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .app import MAX_BODY_BYTES, SHUTDOWN_DRAIN_S, cors_allows, cors_origin_list, read_body
from .schemas import APIError

logger = logging.getLogger("optiml.ray_serve")

APP_NAME = "optiml"
INGRESS = "OptimlIngress"
REPLICA = "OptimlReplica"
REPLICA_HEADER = "x-optiml-replica"  # which replica answered: "<replica id>@<pid>" (tests, debugging)


# ---- what travels from the ingress to a replica -------------------------------------------------------
@dataclasses.dataclass
class Forwarded:
    """One HTTP request as the ingress read it. `prompt` is the text the router matches prefixes on
    (Ray Serve's routers look for an argument with a `prompt` attribute)."""

    method: str
    path: str
    query_string: bytes
    headers: list
    body: bytes
    client: tuple | None
    prompt: str = ""


@dataclasses.dataclass
class Head:
    """The first item a replica yields: the response's status and headers, the body that was ready with
    them (a whole JSON answer, usually) and whether that was all of it."""

    status: int
    headers: list
    replica: str
    body: bytes
    done: bool


def _text(content) -> str:
    """A message's content as text (a string, or the text parts of a list)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_text(path: str, body: bytes) -> str:
    """The text whose prefix decides the replica: the messages in order (role and content, as the chat
    template renders them in order) or the completion's prompt. "" when there is none (the replica answers
    the bad request)."""
    if not path.endswith("/completions"):
        return ""
    try:
        d = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(d, dict):
        return ""
    msgs = d.get("messages")
    if isinstance(msgs, list):
        return "".join(f"\x00{m.get('role')}\x00{_text(m.get('content'))}" for m in msgs if isinstance(m, dict))
    p = d.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of prompts: the first one's prefix decides
    if isinstance(p, str):
        return p
    if isinstance(p, list):  # token ids
        return ",".join(str(t) for t in p) + ","
    return ""


# ---- the router ---------------------------------------------------------------------------------------
def block_hashes(text: str, block: int) -> list:
    """Hashes of the text's whole `block`-character prefixes: hashes[i] stands for text[:(i + 1) * block],
    so two texts share their first k blocks when they share their first k hashes (collisions aside)."""
    out, h = [], 0
    for i in range(0, len(text) - block + 1, block):
        h = hash((h, text[i:i + block]))
        out.append(h)
    return out


class PrefixAffinityRouter(RequestRouter):
    """Sends a request to the replica that served the longest prefix of its prompt, so that replica's
    prefix cache (the Scheduler's slots) saves the prompt's shared part; others by least load.

    The router keeps, per replica, the hashes of the prompt blocks it sent there (block_hashes, at most
    `capacity` per replica, least recently used out). For a new request it counts, per replica, how many
    leading blocks of the prompt are among them. The replicas with the longest match of at least
    `min_match` characters are tried first unless one is busier than the least busy replica by more than
    `imbalance` requests (then a shared system prompt would pile every request on one replica); then all
    replicas, the least busy first (Ray Serve's queue-length cache and probes; a replica at
    max_ongoing_requests refuses and the next is tried).

    When every replica is at max_ongoing_requests (all slots busy), Ray Serve's router sleeps between
    rounds (25 ms, doubling up to max_backoff_s) and asks again, so a slot that frees meanwhile stays idle
    until the sleep ends. Here a finished request wakes the longest-waiting round at once; the sleep stays
    the bound (a slot freed by another ingress's request wakes no one here).

    Its state is per router: each ingress replica routes by what it sent itself (one ingress, the
    default, sees everything)."""

    def initialize_state(self, block: int = 64, min_match: int = 64, imbalance: int = 2, capacity: int = 4096):
        self._block = max(1, int(block))
        self._min_blocks = max(1, -(-int(min_match) // self._block))
        self._imbalance = imbalance
        self._capacity = capacity
        self._seen: dict = {}  # ReplicaID -> OrderedDict of block hashes (most recent last)
        self._asleep: collections.deque = collections.deque()  # futures of rounds waiting for a free slot
        self._loop = None  # the routing loop (they sleep in it)

    def _load(self, r: RunningReplica) -> float:
        n = self._replica_queue_len_cache.get(r.replica_id)
        return 0 if n is None else n

    def _match(self, replica_id, hashes: list) -> int:
        seen = self._seen.get(replica_id)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: list, pending_request: PendingRequest | None = None):
        if not candidate_replicas:
            return []
        ranks = []
        text = _prompt_of(pending_request)
        if text:
            hashes = block_hashes(text, self._block)
            match = {r.replica_id: self._match(r.replica_id, hashes) for r in candidate_replicas}
            best = max(match.values())
            if best >= self._min_blocks:
                least = min(self._load(r) for r in candidate_replicas)
                affine = [r for r in candidate_replicas
                          if match[r.replica_id] == best and self._load(r) <= least + self._imbalance]
                if affine:
                    random.shuffle(affine)
                    ranks.append(affine)
        # Ray Serve takes the least busy replica of a rank, the first one of equals: shuffled, idle replicas
        # share the requests (and the prefixes) instead of the first one taking them all.
        everyone = list(candidate_replicas)
        random.shuffle(everyone)
        ranks.append(everyone)
        if pending_request is not None:  # all replicas were offered: back off before asking again
            pending_request.routing_context.should_backoff = True
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        text = _prompt_of(pending_request)
        if not text:
            return
        seen = self._seen.setdefault(replica_id, collections.OrderedDict())
        for h in block_hashes(text, self._block):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self._capacity:
            seen.popitem(last=False)

    # _backoff and _compute_backoff_s are RequestRouter's own (Ray Serve 2.50-2.60): where a version lacks
    # them this override is never called and Ray Serve's plain sleep applies.
    async def _backoff(self, attempt: int) -> None:
        self._loop = asyncio.get_running_loop()
        waiter = self._loop.create_future()
        self._asleep.append(waiter)
        try:
            await asyncio.wait_for(waiter, self._compute_backoff_s(attempt))
        except asyncio.TimeoutError:
            pass
        while self._asleep and self._asleep[0].done():  # rounds whose sleep ran out
            self._asleep.popleft()

    def _wake_one(self) -> None:
        while self._asleep:
            waiter = self._asleep.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        # Queued after Ray Serve's own callbacks of this completion: its queue-length cache counts the free slot.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_one)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._seen.pop(replica_id, None)

    def update_replicas(self, replicas: list):
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for rid in [rid for rid in self._seen if rid not in live]:
            del self._seen[rid]


def _prompt_of(pending_request) -> str:
    if pending_request is None:
        return ""
    for a in pending_request.args or ():
        p = getattr(a, "prompt", None)
        if isinstance(p, str):
            return p
    return ""


# ---- the replica: one engine and its pipeline ---------------------------------------------------------
class Replica:
    """One optiml server (Model, Scheduler thread, app.py's routes) inside a Ray Serve replica.

    model: a path, a known model name or a Hugging Face reference, resolved on the replica's node
    (optiml.models.resolve: a name not cached there yet is pulled). model_kwargs: optiml.Model's;
    n_threads None means the CPUs Ray gave the replica. server_kwargs: optiml.server.Server's.
    stream_interval_ms: a stream's pieces are sent at most this often, what came meanwhile together
    (0: each as it comes); neither the first piece nor the answer's end is held back. Each item costs
    Ray Serve's proxy and the ingress a message each: 2 to 4 ms of CPU per item together on this
    project's 2-core machine (tools/bench/ray_serve.py), a third of a token's compute for a 135M model
    when every token is an item. Ray Serve LLM batches the same way (stream_batching_interval_ms, 50 ms); at 100 ms a replica
    sends at most 10 items a second per stream whatever its speed."""

    # A replica whose scheduler has work but has not taken a step for this long is reported unhealthy
    # (Ray Serve then replaces it): a hung native call must not hold its requests forever.
    STALL_S = 120.0

    def __init__(self, model: str, model_kwargs: dict, server_kwargs: dict, stream_interval_ms: float = 100):
        from ..engine.model import Model
        from ..hub.registry import resolve
        from .app import Server, create_app

        path = resolve(model, quiet=True)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"no model file {model!r} on node {ray.util.get_node_ip_address()}: put the GGUF file at the same "
                "path on every node (or a shared file system), or give a known model name or a Hugging Face "
                "reference, which each node pulls into its own cache")
        kw = dict(model_kwargs)
        if not kw.get("n_threads"):
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
            kw["n_threads"] = max(1, int(cpus))
        if str(kw.get("device", "auto")).startswith("cuda"):
            kw["device"] = "cuda:0"  # Ray gave this replica one GPU (CUDA_VISIBLE_DEVICES): it is device 0 here
        n_parallel = server_kwargs.get("n_parallel", 1)
        self.model = Model(path, n_seq=n_parallel, **kw)
        self.server = Server(self.model, **server_kwargs)
        self.app = create_app(self.server)
        # create_app's lifespan starts the pipeline under uvicorn; here no lifespan event comes.
        self.server.pipeline.start()
        ctx = serve.get_replica_context()
        self.name = f"{ctx.replica_id.unique_id}@{os.getpid()}"
        self._steps, self._since = -1, time.monotonic()
        self.interval = stream_interval_ms / 1000.0

    async def forward(self, req: Forwarded):
        """Runs app.py's routes on `req`; yields a Head, then the rest of the body as it comes (what is
        waiting is sent as one item: a client that falls behind gets fewer, larger items)."""
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_read = False

        async def receive():
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()  # the app's disconnect watchers wait here until the caller goes away
            return {"type": "http.disconnect"}

        async def send(msg):
            out.put_nowait(msg)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
                 "scheme": "http", "path": req.path, "raw_path": req.path.encode(), "root_path": "",
                 "query_string": req.query_string, "headers": req.headers, "client": req.client,
                 "server": ("127.0.0.1", 80)}

        def ended(t):
            if not t.cancelled():
                t.exception()  # retrieved: Starlette re-raises what its error handler already answered
            out.put_nowait(None)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(ended)
        loop = asyncio.get_running_loop()
        start, parts, more = None, [], True

        def take(m) -> None:
            nonlocal start, more
            if m is None:  # the app returned (without finishing the body, if `more` is still set)
                more = False
                if start is None:
                    exc = task.exception() if not task.cancelled() else None
                    raise RuntimeError(f"the replica's app answered nothing: {exc!r}")
            elif m["type"] == "http.response.start":
                start = m
            elif m["type"] == "http.response.body" and more:
                parts.append(m.get("body", b""))
                more = m.get("more_body", False)

        first, due = True, 0.0  # due: when the next piece may go (the first at once)
        try:
            while more:
                take(await out.get())
                # Each piece costs the proxy and the ingress a message: what arrives before the next piece is
                # due goes with it. The end of the body goes at once: waiting out the interval there held
                # every answer's end back (a 1-token stream through Ray took 119 ms, now 20).
                while more and (not out.empty() or loop.time() < due):
                    if not out.empty():
                        take(out.get_nowait())
                        continue
                    try:
                        take(await asyncio.wait_for(out.get(), due - loop.time()))
                    except asyncio.TimeoutError:
                        break
                if start is None or (more and not parts):
                    continue  # nothing to send yet: the head goes with the first body
                body = b"".join(parts)
                parts.clear()
                if first:
                    first = False
                    yield Head(start["status"], list(start.get("headers", [])), self.name, body, not more)
                else:
                    yield body
                due = loop.time() + self.interval
        finally:
            gone.set()  # the caller went away or all is sent: the app's watchers end, its jobs are cancelled

    def check_health(self) -> None:
        """Ray Serve calls this every health_check_period_s; an exception gets the replica replaced."""
        pipeline = self.server.pipeline
        if not pipeline.thread.is_alive():
            raise RuntimeError("the scheduler thread is not running")
        now = time.monotonic()
        if not pipeline.scheduler.busy() or pipeline.steps != self._steps:
            self._steps, self._since = pipeline.steps, now
        elif now - self._since > self.STALL_S:
            raise RuntimeError(f"the scheduler has taken no step for {now - self._since:.0f} s with work waiting")

    def __del__(self):
        # Ray Serve calls this when it stops the replica: running requests get an error event, not silence.
        server = getattr(self, "server", None)
        if server is not None:
            server.pipeline.stop()


def _unprefixed(scope: dict) -> dict:
    """The scope with the application's route prefix (Ray Serve's root_path) taken off its path: app.py's
    routes are /v1/..."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return dict(scope, path=path, raw_path=path.encode(), root_path="")


# ---- the ingress: HTTP in, one replica's answer out ---------------------------------------------------
def _error(status: int, message: str, type: str = "server_error", code: str | None = None,
           headers: dict | None = None) -> Response:
    e = APIError(status, message, type=type, code=code, headers=headers)
    return JSONResponse(e.body(), status_code=status, headers=e.headers)


def _sse_error(message: str, code: str) -> bytes:
    """The error event app.py sends when a stream fails (the openai client raises APIError on it)."""
    d = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(d).encode() + b"\r\n\r\n"


# Replica failures: the message a client reads.
FAILED = "the replica serving this request failed ({}); retry the request"
# A shutdown's: app.py's words and code, so a client reads the same from either server.
SHUTTING_DOWN = "the server is shutting down; retry the request"
_CUT = object()  # what Ingress._next returns once the shutdown's drain time has run out


def _drop(task: asyncio.Future) -> None:
    """Cancels a wait for a replica's next item that nobody reads any more. Ray ends it with an error
    (RequestCancelledError) rather than as cancelled: retrieved here, not logged as "never retrieved"."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


class Ingress:
    """Reads each HTTP request, forwards it to a replica and relays the answer (see the module doc).

    Told to stop (drain(), which serve_ray calls on every ingress replica before Ray Serve stops), it does
    what the single-node server does: new requests get a 503, running answers get SHUTDOWN_DRAIN_S to
    finish, then a stream still running ends with an error event and an answer not begun gets the 503
    (code server_shutting_down both)."""

    def __init__(self, replicas, max_body: int = MAX_BODY_BYTES, cors_origins=None):
        self.replicas = replicas.options(stream=True, method_name="forward")
        self.max_body = max_body
        self.cors_origins = cors_origin_list(cors_origins)
        self.stopping = False
        self.ongoing = 0  # requests between their arrival and the end of their answer
        self._cut_at = None  # the future drain() resolves when the drain time is over (made in the serving loop)

    def _cut(self) -> asyncio.Future:
        if self._cut_at is None:
            self._cut_at = asyncio.get_running_loop().create_future()
        return self._cut_at

    async def _next(self, it):
        """The next item of a replica's answer (StopAsyncIteration at its end), or _CUT once the shutdown's
        drain time is over. (A task per item: some 10 us, against the 1-2 ms each item costs the ingress.)"""
        item = asyncio.ensure_future(it.__anext__())
        try:
            await asyncio.wait((item, self._cut()), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away
            _drop(item)
            raise
        if not item.done():
            _drop(item)
            return _CUT
        return item.result()

    async def drain(self) -> int:
        """The shutdown (see the class doc). Returns once every answer has ended: the number still running
        5 s after the drain time (none, unless a relay hangs)."""
        loop = asyncio.get_running_loop()
        self.stopping = True
        end = loop.time() + SHUTDOWN_DRAIN_S
        while self.ongoing and loop.time() < end:
            await asyncio.sleep(0.05)
        if not self._cut().done():
            self._cut().set_result(None)  # what still runs is ended now
        end = loop.time() + 5.0
        while self.ongoing and loop.time() < end:  # the relays send the ends
            await asyncio.sleep(0.05)
        return self.ongoing

    async def __call__(self, request: Request) -> Response:
        # The answers made here, not by a replica, carry the replicas' CORS headers too: a page would read
        # an opaque network error instead of the 413, 429 or 503.
        origin = request.headers.get("origin")
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if cors_allows(origin, self.cors_origins) else {}
        if self.stopping:
            return _error(503, SHUTTING_DOWN, code="server_shutting_down", headers={"Retry-After": "1", **cors})
        self.ongoing += 1
        relayed = False  # the count is rest()'s to take down once it relays the answer
        try:
            try:
                body = await read_body(request, self.max_body)
            except APIError as e:  # 413, as app.py answers it
                return JSONResponse(e.body(), status_code=e.status, headers={**e.headers, **cors})
            path = _unprefixed(request.scope)["path"]
            req = Forwarded(request.method, path, request.scope.get("query_string", b""),
                            list(request.scope.get("headers", [])), body,
                            tuple(request.client) if request.client else None, prompt_text(path, body))
            gen = self.replicas.remote(req)
            it = gen.__aiter__()
            try:
                head = await self._next(it)
            except asyncio.CancelledError:
                gen.cancel()  # the client went away while its answer was computed
                raise
            except Exception as e:
                return self._failed(e, cors)
            if head is _CUT:
                gen.cancel()
                return _error(503, SHUTTING_DOWN, code="server_shutting_down", headers={"Retry-After": "1", **cors})
            headers = [(k, v) for k, v in head.headers if k.lower() not in (b"connection", b"transfer-encoding")]
            headers.append((REPLICA_HEADER.encode(), head.replica.encode()))
            if head.done:
                resp = Response(head.body, status_code=head.status)
                resp.raw_headers = headers
                return resp
            sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)

            async def rest():
                finished = False
                try:
                    if head.body:
                        yield head.body
                    while True:
                        try:
                            part = await self._next(it)
                        except StopAsyncIteration:
                            break
                        if part is _CUT:  # the drain time is over: say so and end the stream properly
                            if sse:
                                yield _sse_error(SHUTTING_DOWN, "server_shutting_down")
                            return
                        yield part
                    finished = True
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the replica died mid-answer: say so in the stream and end it
                    logger.warning("replica %s failed mid-stream: %s", head.replica, e)
                    if sse:
                        yield _sse_error(FAILED.format(_why(e)), "replica_failed")
                finally:
                    self.ongoing -= 1
                    if not finished:
                        gen.cancel()

            resp = StreamingResponse(rest(), status_code=head.status)
            resp.raw_headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            relayed = True
            return resp
        finally:
            if not relayed:
                self.ongoing -= 1

    @staticmethod
    def _failed(e: Exception, cors: dict) -> Response:
        from ray.serve.exceptions import BackPressureError

        if isinstance(e, BackPressureError):  # every replica busy and the router's queue full: as app.py's 429
            return _error(429, f"the server is busy: {str(e).rstrip('.')}; retry later", type="server_busy",
                          code="queue_full", headers={"Retry-After": "1", **cors})
        logger.warning("request failed before its answer started: %r", e)
        return _error(503, FAILED.format(_why(e)), code="replica_failed", headers={"Retry-After": "1", **cors})


def _why(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:200]}" if s else type(e).__name__


# ---- the application ----------------------------------------------------------------------------------
def build(model: str, *, replicas: int = 1, min_replicas: int | None = None, max_replicas: int | None = None,
          cpus: float = 1, gpus: float = 0, n_parallel: int = 4, max_queue: int = 64, max_ongoing: int | None = None,
          model_kwargs: dict | None = None, server_kwargs: dict | None = None, router: dict | None = None,
          stream_interval_ms: float = 100, access_log: bool = False):
    """The Ray Serve application: OptimlIngress over `replicas` OptimlReplica (or autoscaling between
    min_replicas and max_replicas, aiming at n_parallel requests per replica).

    cpus, gpus: each replica's Ray resources (its threads default to cpus). max_ongoing: requests a
    replica takes at once (default n_parallel, its slots). More would wait in one replica's queue while
    another has a free slot: with 2 x n_parallel, 8 clients on 2 replicas of 4 slots were split 6 to 2 at
    times and waited seconds for their first token (tools/bench_ray_serve.py, p99). The rest wait in the
    router, free to go to whichever replica frees a slot first; max_queue of them before 429, as optiml
    serve's --queue. router: PrefixAffinityRouter's settings (block, min_match, imbalance, capacity).
    stream_interval_ms: see Replica."""
    max_ongoing = max_ongoing or n_parallel
    server_kwargs = dict(server_kwargs or {})
    server_kwargs["n_parallel"] = n_parallel
    # The router holds the waiting requests (max_queue of them); a replica never has more than
    # max_ongoing requests, whose choices (n) must all fit its own queue.
    server_kwargs.setdefault("max_queue", max(max_queue, max_ongoing * 8))
    scaling = {"num_replicas": replicas}
    if min_replicas is not None or max_replicas is not None:
        lo = min_replicas if min_replicas is not None else 1
        hi = max_replicas if max_replicas is not None else max(lo, replicas)
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                          "target_ongoing_requests": n_parallel}}
    actor = {"num_cpus": cpus}
    if gpus:
        actor["num_gpus"] = gpus
    logging_config = {"enable_access_log": access_log}
    # A stopping replica checks for running requests every graceful_shutdown_wait_loop_s (2 s by default),
    # the first time after one wait: at 0.2 s, removing the application after Ingress.drain takes a moment.
    replica = serve.deployment(
        Replica, name=REPLICA, ray_actor_options=actor, max_ongoing_requests=max_ongoing,
        max_queued_requests=max_queue, health_check_period_s=10, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=10, graceful_shutdown_wait_loop_s=0.2, logging_config=logging_config,
        request_router_config=_router_config(router),
        **scaling)
    ingress = serve.deployment(Ingress, name=INGRESS, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096,
                               graceful_shutdown_wait_loop_s=0.2, logging_config=logging_config)
    return ingress.bind(replica.bind(model, dict(model_kwargs or {}), server_kwargs, stream_interval_ms),
                        MAX_BODY_BYTES, server_kwargs.get("cors_origins"))


def _router_config(router: dict | None):
    config = RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs=dict(router or {}))
    # A request waiting for a free slot asks again after a backoff that grows to max_backoff_s (0.5 s by
    # default): a freed slot would idle that long. (Older Ray Serve versions have no such setting.)
    if hasattr(config, "max_backoff_s"):
        config.max_backoff_s = 0.1
    return config


# The settings build_app takes (a YAML config's `args`), with optiml serve's flag names.
BUILD_ARGS = {
    "model": None, "replicas": 1, "min_replicas": None, "max_replicas": None, "cpus": 1, "gpus": 0,
    "parallel": 4, "ctx": None, "threads": None, "queue": 64, "chunk": 256, "alias": None, "api_key": None,
    "predictors": "auto", "device": "auto", "vram": None, "n_gpu_layers": None, "gpu_neurons": None,
    "kv_vram": None, "n_cpu_moe": None, "max_itl_ms": None, "mmap": "auto", "max_ongoing": None, "router": None,
    "stream_interval_ms": 100, "access_log": False, "cors_origins": None, "chat_template_kwargs": None,
    "pooling": None,
}


def build_app(args: dict):
    """The application from a dict of BUILD_ARGS (what `serve run optiml.server.ray_serve:build_app
    model=...` and a YAML config's `args` give)."""
    unknown = sorted(set(args) - set(BUILD_ARGS))
    if unknown:
        raise ValueError(f"unknown optiml Ray Serve settings: {', '.join(unknown)}; known: {', '.join(BUILD_ARGS)}")
    a = dict(BUILD_ARGS, **args)
    if not a["model"]:
        raise ValueError("the setting 'model' is required: a GGUF path, a known model name or a Hugging Face reference")

    def num(v, kind=int):  # `serve run ... key=value` gives strings
        return None if v is None or v == "" else kind(v)

    model_kwargs = {"n_ctx": num(a["ctx"]), "n_threads": num(a["threads"]), "predictors": a["predictors"],
                    "device": a["device"], "vram": a["vram"], "n_gpu_layers": num(a["n_gpu_layers"]),
                    "gpu_neurons": num(a["gpu_neurons"]), "kv_vram": a["kv_vram"], "use_mmap": a["mmap"],
                    "n_cpu_moe": True if str(a["n_cpu_moe"]).lower() == "true" else num(a["n_cpu_moe"])}
    if model_kwargs["predictors"] in ("none", None):
        model_kwargs["predictors"] = None
    server_kwargs = {"api_key": a["api_key"], "model_id": a["alias"], "chunk": num(a["chunk"]) or 256,
                     "max_itl_ms": num(a["max_itl_ms"], float), "cors_origins": cors_origin_list(a["cors_origins"]),
                     "chat_template_kwargs": _json_object(a["chat_template_kwargs"]), "pooling": a["pooling"] or None}
    return build(str(a["model"]), replicas=num(a["replicas"]), min_replicas=num(a["min_replicas"]),
                 max_replicas=num(a["max_replicas"]), cpus=num(a["cpus"], float), gpus=num(a["gpus"], float),
                 n_parallel=num(a["parallel"]), max_queue=num(a["queue"]), max_ongoing=num(a["max_ongoing"]),
                 model_kwargs=model_kwargs, server_kwargs=server_kwargs, router=a["router"],
                 stream_interval_ms=num(a["stream_interval_ms"], float),
                 access_log=str(a["access_log"]).lower() in ("1", "true", "yes"))


def _json_object(v):
    """A setting that is a JSON object: a dict (a YAML config's), its JSON text (`serve run ... key=value`), or
    None."""
    if v is None or isinstance(v, dict):
        return v
    value = json.loads(v)
    if not isinstance(value, dict):
        raise ValueError(f"chat_template_kwargs must be a JSON object, not {v}")
    return value


# ---- a local cluster, or a cluster at an address -------------------------------------------------------
def start_local_cluster(num_cpus: int, num_gpus: int | None = None, temp_dir: str | None = None) -> None:
    """A Ray cluster of this machine alone, on loopback, without the dashboard, owned by this process:
    stop_cluster() (or this process's exit) stops it."""
    # The replicas import the optiml this process runs (a source checkout too): Ray's workers inherit the
    # environment of the cluster this process starts.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here] + paths)
    # Every socket of the cluster on loopback, none reachable from other machines: Ray's switch for
    # single-machine clusters (named for Windows and macOS, where it is the default); without it Ray's
    # processes listen on all interfaces even when given 127.0.0.1. Ray reads it when it is imported: the
    # environment for the processes this one starts, the constant for this one, which imported Ray already
    # (Ray 2.60 has no ray.init option for it).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray Serve's controller checks its deployments 10 times a second: 4% of a core on an idle 2-core
    # machine, with the GCS it asks. Twice a second is quick enough to replace a dead replica.
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    # Ray Serve gives its HTTP proxy 5 s to report ready and 10 s to answer a health check, then kills it:
    # on a machine whose cores are busy (a build, another server) the proxy's start alone takes longer, and
    # `optiml serve --ray` died with "ProxyActor ... was killed by ray.kill". A minute each, as the replicas'.
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, "60")
    # A small object store: requests and answers are small and travel inline, and the default (30% of the
    # memory) would be reserved from the replicas' models.
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=temp_dir, namespace="optiml", configure_logging=False, log_to_driver=True,
             object_store_memory=256 << 20)


def stop_cluster() -> None:
    """Disconnects from Ray; a cluster this process started itself stops with it."""
    if ray.is_initialized():
        ray.shutdown()


def _default_cpus(replicas: int, local: bool) -> int:
    """CPUs per replica when --threads is not given: the machine's (or the cluster's) CPUs shared out,
    at most one node's worth."""
    if local:
        return max(1, (os.cpu_count() or 1) // replicas)
    total = ray.cluster_resources().get("CPU", 1)
    largest = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")), default=total)
    return max(1, min(int(total // replicas), int(largest)))


def serve_ray(model: str, host: str = "127.0.0.1", port: int = 8080, replicas: int = 1, address: str | None = None,
              n_parallel: int = 4, n_ctx: int | None = None, api_key: str | None = None, n_threads: int | None = None,
              max_queue: int = 64, chunk: int = 256, model_id: str | None = None, log_level: str = "info",
              predictors="auto", device: str = "auto", vram=None, n_gpu_layers: int | None = None,
              gpu_neurons=None, kv_vram=None, max_itl_ms: float | None = None, use_mmap="auto",
              kv_type_k=None, kv_type_v=None, n_cpu_moe=None, cors_origins=None, min_replicas: int | None = None, max_replicas: int | None = None, name: str = APP_NAME,
              chat_template_kwargs=None, pooling=None,
              stream_interval_ms: float = 100, route_prefix: str = "/", temp_dir: str | None = None, ready=None,
              stop: threading.Event | None = None):
    """optiml serve --ray: the same server as optiml.server.serve (same arguments), as `replicas`
    replicas on Ray Serve behind one endpoint at http://host:port (Ray Serve's proxy).

    address None: starts a local Ray cluster (this machine, loopback) sized for the replicas, and stops it
    on exit. address given ("ray://head:10001", "head:6379", "auto"): deploys on that cluster and removes
    the application (not the cluster) on exit; there host and port apply only if Ray Serve is not running
    there yet. min_replicas / max_replicas: autoscaling instead of a fixed count. n_threads: each replica's
    threads and CPUs (default: the CPUs shared out among the replicas). device cuda[:N]: one GPU per
    replica, vram its budget. model: a path, a known name or a Hugging Face reference, resolved on each
    replica's node. stream_interval_ms: how often a stream's pieces are sent (Replica). Serves until
    Ctrl-C or SIGTERM (or until `stop` is set); ready(url) is called once it answers."""
    local = address is None
    if local:
        model = _resolve_here(model)
        _check_port(host, port)
    count = max_replicas if max_replicas is not None else max(replicas, min_replicas or 0)
    gpu = str(device).startswith("cuda")
    stopping = stop or threading.Event()
    signals = _Signals(stopping)
    signals.install()  # before anything starts: a Ctrl-C in Ray's first seconds must stop what it started
    started = deployed = False  # Ray Serve, the application
    try:
        if local:
            cpus = n_threads or _default_cpus(count, True)
            start_local_cluster(num_cpus=cpus * count, num_gpus=None, temp_dir=temp_dir)
        else:
            _check_reachable(address)
            try:
                ray.init(address=address, namespace="optiml", configure_logging=False)
            except Exception as e:  # ConnectionError, an authentication error, a bad address
                raise SystemExit(f"optiml serve --ray: could not join the Ray cluster at {address}: {_why(e)}\n(is "
                                 "it running (ray start --head), and this machine one of its nodes for a HEAD:6379 "
                                 "address, or its client port open for ray://HEAD:10001? A cluster with token "
                                 "authentication, Ray's default, needs RAY_AUTH_MODE=token here and its token in "
                                 "~/.ray/auth_token or RAY_AUTH_TOKEN: see docs/serve.md)") from None
            cpus = n_threads or _default_cpus(count, False)
        signals.install()  # again: ray.init put its own SIGTERM handler in place
        if stopping.is_set():
            return
        signals.interrupt = True  # starting Ray Serve and loading the models can take minutes: Ctrl-C ends the wait
        try:
            serve.start(http_options={"host": host, "port": port},
                        logging_config={"log_level": log_level.upper(), "enable_access_log": log_level == "debug"})
        except Exception as e:
            if "bind" in str(e).lower():  # taken since _check_port looked (or on the cluster's nodes)
                print(f"optiml serve --ray: cannot listen on {host}:{port}: {_why(e)}", file=sys.stderr)
                raise SystemExit(3) from None
            raise SystemExit(f"optiml serve --ray: Ray Serve did not start: {_why(e)}") from None
        started = True
        app = build(model, replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas, cpus=cpus,
                    gpus=1 if gpu else 0, n_parallel=n_parallel, max_queue=max_queue,
                    model_kwargs={"n_ctx": n_ctx, "n_threads": n_threads or cpus, "predictors": predictors,
                                  "device": device, "vram": vram, "n_gpu_layers": n_gpu_layers,
                                  "gpu_neurons": gpu_neurons, "kv_vram": kv_vram, "use_mmap": use_mmap,
                                  "kv_type_k": kv_type_k, "kv_type_v": kv_type_v, "n_cpu_moe": n_cpu_moe},
                    server_kwargs={"api_key": api_key, "model_id": model_id, "chunk": chunk,
                                   "max_itl_ms": max_itl_ms, "cors_origins": cors_origins,
                                   "chat_template_kwargs": chat_template_kwargs, "pooling": pooling},
                    stream_interval_ms=stream_interval_ms, access_log=log_level == "debug")
        try:
            serve.run(app, name=name, route_prefix=route_prefix)
        except Exception as e:
            why = _deploy_error(name) or _why(e)
            raise SystemExit(f"optiml serve --ray: the replicas did not start: {why}") from None
        deployed = True
        signals.interrupt = False
        if stopping.is_set():
            return
        url = _url(host, port, route_prefix)
        scale = (f"{min_replicas or 1}..{max_replicas} replicas (autoscaling)" if max_replicas
                 else f"{replicas} replica{'s' * (replicas != 1)}")
        where = ("a local Ray cluster" if local else
                 f"the Ray cluster at {address}; if Ray Serve ran there already, at its own HTTP address")
        print(f"optiml serve --ray: {model_id or os.path.splitext(os.path.basename(model))[0]} on {url}/v1 "
              f"({scale} of {n_parallel} slots, {cpus} CPU{'s' * (cpus != 1)}{' and 1 GPU' if gpu else ''} each, "
              f"on {where}); chat page at {url}/", flush=True)
        if ready is not None:
            ready(url)
        while not stopping.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signals.interrupt = False
        try:
            if deployed:
                _drain(name, signals.hurry)
            # Removing the application lets the replicas stop as Ray Serve stops them (the models freed, the
            # ends of the answers relayed). Not serve.shutdown(): it kills the proxy at once (what cut the
            # streams) and ends with Ray's "Task ServeController.graceful_shutdown failed" as the controller
            # kills itself. A cluster of others' keeps running: the application goes whatever happened.
            if started and (not local or (deployed and not signals.hurry.is_set())):
                serve.delete(name)
        except Exception as e:  # stopping anyway: the cluster goes below
            print(f"optiml serve --ray: while stopping Ray Serve: {_why(e)}", file=sys.stderr)
        stop_cluster()
        signals.restore()


class _Signals:
    """What Ctrl-C and SIGTERM do while serve_ray runs, installed before the cluster starts:

    - while ray.init starts Ray's processes, nothing at once: `stopping` is set and serve_ray stops the
      cluster once ray.init returns (interrupted inside it, it left Ray's agents running). ray.init puts its
      own SIGTERM handler in place meanwhile, which stops those processes itself;
    - while Ray Serve starts and the replicas load (`interrupt`): KeyboardInterrupt, which ends the wait;
    - while serving: `stopping`, then the drain (_drain);
    - a second one: `hurry`, stop without waiting for the answers (as the single-node server does).

    Outside the main thread (a test, a caller's thread) nothing is installed: `stop` ends serve_ray."""

    def __init__(self, stopping: threading.Event):
        self.stopping, self.hurry = stopping, threading.Event()
        self.interrupt = False
        self.old: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            old = self.old.setdefault(sig, signal.getsignal(sig))
            if old is not signal.SIG_IGN:  # (a shell starts a background job with Ctrl-C ignored: keep it so)
                signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame) -> None:
        if self.stopping.is_set():
            self.hurry.set()
            return
        self.stopping.set()
        if self.interrupt:
            raise KeyboardInterrupt


def _drain(name: str, hurry: threading.Event) -> None:
    """The single-node server's shutdown, before Ray Serve stops (Ingress.drain on every ingress replica):
    new requests get a 503, running answers SHUTDOWN_DRAIN_S to finish, then an error event
    (server_shutting_down). Waits for that, unless `hurry` is set meanwhile (a second Ctrl-C)."""
    done, failed = threading.Event(), []

    def run():
        try:
            serve.get_deployment_handle(INGRESS, name).broadcast("drain").results(timeout_s=SHUTDOWN_DRAIN_S + 30)
        except Exception as e:
            failed.append(e)
        finally:
            done.set()

    # In a thread: the main thread keeps taking signals (a second Ctrl-C) while it waits.
    threading.Thread(target=run, name="optiml-drain", daemon=True).start()
    while not done.wait(0.2) and not hurry.is_set():
        pass
    if failed:
        print(f"optiml serve --ray: running answers were not drained: {_why(failed[0])}", file=sys.stderr)


def _deploy_error(name: str) -> str | None:
    """Why the application's deployments failed, in their own words: the last line of the replica's
    traceback that Ray Serve keeps in its status (the log has it whole, 50 lines per attempt)."""
    try:
        app = serve.status().applications.get(name)
    except Exception:
        return None
    for d in (app.deployments.values() if app else ()):
        if str(d.status).endswith(("DEPLOY_FAILED", "UNHEALTHY")) and d.message:
            lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", d.message).splitlines() if ln.strip()]
            # "optiml._core.GGUFError: bad.gguf: ..." -> "GGUFError: bad.gguf: ..."
            return re.sub(r"^(?:\w+\.)+(?=\w+: )", "", lines[-1]) if lines else None
    return None


def _check_port(host: str, port: int) -> None:
    """Fails at once, before Ray starts, when the HTTP port is taken: Ray Serve's proxy would fail after some
    9 s with 70 lines of traceback. One line and exit status 3, as the single-node server (uvicorn)."""
    import socket

    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as e:
        why = os.strerror(e.errno).lower() if e.errno and e.errno > 0 else str(e)
        print(f"optiml serve --ray: cannot listen on {host}:{port}: {why}", file=sys.stderr)
        raise SystemExit(3) from None


def _check_reachable(address: str) -> None:
    """Fails fast on a HOST:PORT (or ray://HOST:PORT) nobody listens on: Ray itself retries for minutes."""
    import socket

    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and the like: Ray finds the cluster itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise SystemExit(f"optiml serve --ray: nothing answers at {address} ({e}): start the cluster first "
                         "(ray start --head) or give its address") from None


def _resolve_here(model: str) -> str:
    from ..hub.registry import resolve

    path = resolve(model)
    if not os.path.exists(path):
        raise SystemExit(f"optiml serve --ray: no such model file: {model} (give a GGUF file, a known model name: "
                         "optiml pull --list, or a Hugging Face reference: org/repo:QUANT or org/repo/FILE.gguf)")
    return path


def _url(host: str, port: int, route_prefix: str) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://{shown}:{port}{route_prefix.rstrip('/')}"


# ---- python -m optiml.server.ray_serve ----------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """optiml serve's flags that serve_ray takes, and the Ray ones (--replicas, --address, ...)."""
    p = argparse.ArgumentParser(prog="python -m optiml.server.ray_serve",
                                description="optiml serve as replicas on Ray Serve (optiml serve --ray)")
    p.add_argument("-m", "--model", required=True, help="GGUF file, known model name or Hugging Face reference")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--replicas", type=int, default=1, help="replicas of the server (default 1)")
    p.add_argument("--min-replicas", type=int, default=None, help="autoscaling: at least this many replicas")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscaling: at most this many replicas")
    p.add_argument("--address", default=None,
                   help="a Ray cluster to deploy on (ray://HEAD:10001, HEAD:6379 or auto); default: start a local "
                        "one and stop it on exit")
    p.add_argument("--parallel", "-np", type=int, default=4, help="sequences each replica generates at once")
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads (and Ray CPUs) per replica (default: the CPUs shared out among the replicas)")
    p.add_argument("--queue", type=int, default=64, help="requests that may wait for a replica before 429")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--alias", default=None)
    p.add_argument("--predictors", default="auto")
    p.add_argument("--device", default="auto", help="cuda[:N]: one GPU per replica")
    p.add_argument("--vram", default=None, help="each replica's device memory budget")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None)
    p.add_argument("--gpu-neurons", type=int, default=None)
    p.add_argument("--kv-vram", default=None)
    p.add_argument("--max-itl-ms", type=float, default=None)
    p.add_argument("--stream-interval-ms", type=float, default=100,
                   help="send a stream's pieces at most this often, what came meanwhile together (default 100; 0: "
                        "each piece as it comes, at more CPU per token in Ray Serve's proxy)")
    p.add_argument("--cors-origin", action="append", default=None)
    p.add_argument("--chat-template-kwargs", type=json.loads, default=None, metavar="JSON",
                   help="extra variables for the chat template (Qwen3: '{\"enable_thinking\": false}')")
    p.add_argument("--log-level", default="warning")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    serve_ray(a.model, host=a.host, port=a.port, replicas=a.replicas, address=a.address, n_parallel=a.parallel,
              n_ctx=a.ctx, api_key=a.api_key, n_threads=a.threads, max_queue=a.queue, chunk=a.chunk,
              model_id=a.alias, log_level=a.log_level, predictors=None if a.predictors == "none" else a.predictors,
              device=a.device, vram=a.vram, n_gpu_layers=a.n_gpu_layers, gpu_neurons=a.gpu_neurons,
              kv_vram=a.kv_vram, max_itl_ms=a.max_itl_ms, min_replicas=a.min_replicas, max_replicas=a.max_replicas,
              stream_interval_ms=a.stream_interval_ms, cors_origins=a.cors_origin,
              chat_template_kwargs=a.chat_template_kwargs)
    return 0


if __name__ == "__main__":
    # Ray pickles the deployments and the router by their module: they must come from
    # optiml.server.ray_serve, not from __main__ (which other processes cannot import).
    from optiml.server.ray_serve import main as _main

    sys.exit(_main())
