"""The HTTP side: Starlette routes of the OpenAI API over the Pipeline (pipeline.py).

Handlers check and tokenize a request, hand its jobs to the pipeline's thread, and turn the events that
come back (through an asyncio queue) into a JSON answer or server-sent events.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import functools
import hmac
import logging
import os
import re
import time
import uuid

import anyio

from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.responses import JSONResponse as _StarletteJSONResponse
from starlette.routing import Route

from .._core import OptimlError
from ..engine.chat_template import MAX_OUTPUT_CHARS, ChatTemplateError
from ..engine.chat_template import check_variables
from ..engine.embeddings import choose_pooling
from ..engine.harmony import HarmonySplitter, is_harmony, split as split_harmony
from ..engine.reasoning import ThinkSplitter, is_thinking, opened_by, split as split_think
from ..engine.sampling import RANDOM_SEED, Sampler
from ..util import jsonout
from .metrics import CONTENT_TYPE, Metrics
from .pipeline import Pipeline
from .scheduler import Job, QueueFull, TooManySequences
from .schemas import (APIError, GenRequest, bad, chat_request, completion_request, detokenize_request,
                      embedding_request, parse_json, tokenize_request)


# The chat page at / (one static file shipped in the package; it talks to the API below from the browser).
CHAT_PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static", "chat.html")

log = logging.getLogger("optiml.server")

# A request body is read whole before it is parsed: past this size it is refused (413) instead of filling
# memory. 16 MiB is far more than any prompt a context can hold (128k tokens are ~0.5 MB of text).
MAX_BODY_BYTES = 16 << 20
# When the server is told to stop, a stream still running this long after gets an error event and ends (the
# others have finished by then; the pipeline runs until the last stream is done).
SHUTDOWN_DRAIN_S = 5.0

# A body larger than this is parsed, rendered and tokenized on a worker thread (see create_app's prepared):
# below it that takes well under a millisecond, less than the hop to a thread.
PREPARE_INLINE_BYTES = 64 << 10

# Web pages that may call the API from a browser (CORS) unless --cors-origin says otherwise: pages the browser
# loaded from its own machine (a local web UI), not any site its user happens to visit. (The chat page at / is
# the server's own origin: it needs no CORS.)
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it (or its announced Content-Length) passes `limit` bytes."""
    def too_large():
        return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")

    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large()
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise too_large()
        parts.append(part)
    return b"".join(parts)


def cors_origin_list(value) -> list | None:
    """--cors-origin's value as the server keeps it: None (LOCAL_ORIGINS), or a list of origins ("*": any),
    from a list or a comma-separated string (a Ray Serve config's `cors_origins=a,b`)."""
    if isinstance(value, str):
        return [o.strip() for o in value.split(",") if o.strip()]
    return None if value is None else list(value)


def cors_allows(origin: str | None, cors_origins) -> bool:
    """Whether a page of `origin` may read the API's answers (create_app's CORS policy, for answers made
    outside the app: the Ray Serve ingress's own errors)."""
    if not origin:
        return False
    if cors_origins is None:
        return re.fullmatch(LOCAL_ORIGINS, origin) is not None
    return "*" in cors_origins or origin in cors_origins


class Server:
    """The state behind the routes: the model, its pipeline, metrics and settings."""

    def __init__(self, model, n_parallel: int = 1, api_key: str | None = None, model_id: str | None = None,
                 max_queue: int = 64, chunk: int = 256, max_body: int = MAX_BODY_BYTES,
                 max_itl_ms: float | None = None, cors_origins: list | None = None,
                 chat_template_kwargs: dict | None = None, pooling: str | None = None):
        self.model = model
        # /v1/embeddings' pooling (--pooling; else the file's pooling_type, else mean): checked now, chosen per request
        self.pooling = pooling if pooling is None else choose_pooling(pooling, model.hparams)
        # the chat template's extra variables for every request (--chat-template-kwargs); a request's own win
        self.template_variables = check_variables(chat_template_kwargs)
        self.cors_origins = cors_origin_list(cors_origins)  # None: the browser's local pages; ["*"]: any
        self.max_body = max_body
        self.tokenizer = model.tokenizer
        self.harmony = is_harmony(self.tokenizer)  # gpt-oss: chat answers split into content and reasoning
        self.thinking = not self.harmony and is_thinking(self.tokenizer)  # Qwen3, DeepSeek-R1: <think> blocks
        self.model_id = model_id or os.path.splitext(os.path.basename(model.path))[0]
        self.model_names = _model_names(self.model_id, model.path)
        self.created = int(os.path.getmtime(model.path))
        self.api_key = api_key
        self.metrics = Metrics()
        policy = None
        if model.plan.n_seq_device < n_parallel:  # --kv-vram: some sequences' attention on the CPU
            from .offload import OffloadPolicy

            policy = OffloadPolicy(None if max_itl_ms is None else max_itl_ms / 1000.0)
        elif max_itl_ms is not None:
            raise ValueError("--max-itl-ms bounds CPU attention offload, which needs --kv-vram smaller than the "
                             "KV cache of --parallel sequences")
        self.pipeline = Pipeline(model, n_parallel, max_queue, chunk, self.metrics, policy)
        self._grammars = None

    @property
    def grammars(self):
        if self._grammars is None:
            from .structured import Grammars

            self._grammars = Grammars(self.tokenizer, self.model.n_vocab)
        return self._grammars

    # ---- checks ----------------------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")

    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is None or name == "":
            return
        if not isinstance(name, str):
            raise bad("'model' must be a string", "model")
        self.check_model_name(name)

    def check_model_name(self, name: str) -> None:
        """The served model answers to its id, its file's name and the known model names of that file (what
        `optiml serve -m NAME` was given), in any case."""
        if name.lower() not in self.model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server has '{self.model_id}'",
                           param="model", code="model_not_found")

    def chat_ids(self, text: str) -> list:
        """The prompt ids of a rendered chat, as Model.chat tokenizes it."""
        ids = self.tokenizer.encode(text, add_special=False, parse_special=True)
        tk = self.tokenizer
        if tk.add_bos and tk.bos_id >= 0 and (not ids or ids[0] != tk.bos_id):
            ids.insert(0, tk.bos_id)
        return ids

    def check_prompt(self, ids: list, param: str = "messages", which: str = "the prompt") -> None:
        if not ids:
            raise bad(f"{which} is empty", param)
        if len(ids) >= self.model.n_ctx:
            raise bad(f"{which} has {len(ids)} tokens; the context holds {self.model.n_ctx} (--ctx), leaving no "
                      "room to generate", param, code="context_length_exceeded")

    # ---- running a request ------------------------------------------------------------------------------
    def jobs(self, req: GenRequest, sink) -> list:
        grammar = self.grammars.grammar(req.response_format) if req.response_format else None
        jobs = []
        for p, prompt in enumerate(req.prompts):
            for k in range(req.n):
                seed = RANDOM_SEED if req.seed is None else (req.seed + k) % 2**64
                if req.seed is not None and seed == RANDOM_SEED:  # (the engine's "draw one"; a client's seed is kept)
                    seed = 2**64 - 1  # (no client seed reaches it: seeds end at 2**63 - 1)
                sampler = Sampler(self.model.n_vocab, req.params, seed=seed)
                constraint = self.grammars.matcher(grammar) if grammar else None
                jobs.append(Job(p * req.n + k, prompt, req.max_tokens, sampler, req.stops, sink,
                                req.top_logprobs if req.logprobs else -1, req.logit_bias, constraint))
        return jobs

    async def submit(self, req: GenRequest):
        """(jobs, asyncio queue of their events); 429 when the queue is full."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(ev):
            loop.call_soon_threadsafe(q.put_nowait, ev)

        if req.response_format:  # compiling a grammar (and, the first time, the vocabulary) takes a while
            jobs = await run_in_threadpool(self.jobs, req, sink)
        else:
            jobs = self.jobs(req, sink)
        try:
            self.pipeline.submit(jobs)
        except TooManySequences as e:  # (no retry can help: not a 429, which clients retry)
            raise bad(str(e), "n" if req.n > 1 else "prompt", code="too_many_sequences") from None
        except QueueFull as e:
            self.metrics.rejected.inc()
            status = 503 if self.pipeline.stopping else 429
            raise APIError(status, f"the server is busy: {e}; retry later", type="server_busy",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        return jobs, q

    # ---- shaping answers ----------------------------------------------------------------------------------
    def piece(self, tok: int) -> bytes:
        return self.tokenizer.token_to_piece(tok, False)

    def chat_logprobs(self, entries: list) -> dict:
        def one(tok, lp):
            b = self.piece(tok)
            return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

        return {"content": [dict(one(t, lp), top_logprobs=[one(u, v) for u, v in top if _likely(v)])
                            for t, lp, top in entries]}

    def completion_logprobs(self, entries: list, offset: int) -> dict:
        """Completions' logprobs of `entries` (token, logprob, top), whose text starts at character `offset`:
        each token's text_offset is where it starts in the answer's text, counted in the characters the
        tokens' bytes decode to (a token that starts inside a multibyte character: that character's index)."""
        tokens, lps, tops, offsets = [], [], [], []
        text = codecs.getincrementaldecoder("utf-8")("replace")
        for t, lp, top in entries:
            b = self.piece(t)
            tokens.append(b.decode("utf-8", "replace"))
            lps.append(lp)
            tops.append({self.piece(u).decode("utf-8", "replace"): v for u, v in top if _likely(v)})
            offsets.append(offset)
            offset += len(text.decode(b))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _likely(logprob) -> bool:
    """Whether a top-logprobs candidate has any probability: a grammar (response_format) leaves the tokens
    it forbids at -inf, and fewer candidates than asked is what OpenAI answers then."""
    return logprob is not None and logprob > float("-inf")


def _usage(done: dict, n_prompts_counted: set) -> dict:
    """Adds up finished jobs: each prompt's tokens counted once, whatever n is."""
    prompt = cached = completion = 0
    for key, ev in done.items():
        completion += ev["completion_tokens"]
        if ev["prompt_key"] not in n_prompts_counted:
            n_prompts_counted.add(ev["prompt_key"])
            prompt += ev["prompt_tokens"]
            cached += ev["cached_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _timings(done: dict) -> dict | None:
    """llama-server's timings of finished jobs: prompt tokens run (prompt_n; cache_n came from the prefix
    cache) and generated (predicted_n, the first token included), with the time each took: from taking a slot
    to the first token, and from there to the end. For several sequences (n, a list of prompts) the counts and
    the times add up over them (each sequence's own time, not the wall clock). None where the times are
    unknown."""
    evs = list(done.values())
    if not evs or any(ev.get("t_start") is None or ev.get("t_first") is None for ev in evs):
        return None
    prompt_n = sum(ev["prompt_tokens"] - ev["cached_tokens"] for ev in evs)
    predicted_n = sum(ev["completion_tokens"] for ev in evs)
    prompt_ms = sum(ev["t_first"] - ev["t_start"] for ev in evs) * 1e3
    predicted_ms = sum(ev["t_end"] - ev["t_first"] for ev in evs) * 1e3
    return {"cache_n": sum(ev["cached_tokens"] for ev in evs),
            "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n and prompt_ms > 0 else None,
            "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms > 0 else None,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n and predicted_ms > 0 else None,
            "predicted_per_second": predicted_n * 1e3 / predicted_ms if predicted_ms > 0 else None}


async def _event_lists(q: asyncio.Queue, n_jobs: int):
    """Yields the events waiting in `q` as a list, until every job is done; raises ConnectionError when
    the client goes away. A stream writes each list in one send: a client that falls behind (or n > 1
    choices) gets several events per write instead of one write per token."""
    left = n_jobs
    while left:
        evs = [await q.get()]
        while not q.empty():
            evs.append(q.get_nowait())
        for ev in evs:
            if ev["type"] == "disconnect":
                raise ConnectionError("client disconnected")
            if ev["type"] in ("done", "error"):
                left -= 1
        yield evs


async def _events(q: asyncio.Queue, n_jobs: int):
    """Yields events one by one, as _event_lists."""
    async for evs in _event_lists(q, n_jobs):
        for ev in evs:
            yield ev


async def _watch_disconnect(request: Request, q: asyncio.Queue) -> None:
    """Puts a "disconnect" event in `q` when the client closes the connection. (The body is already read,
    so the next ASGI message is http.disconnect; it also comes once the response is sent, by which time
    nobody reads `q`.)"""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            q.put_nowait({"type": "disconnect"})
            return


# Where a reasoning splitter's piece goes in a chat message or delta (as llama.cpp's server puts reasoning).
_FIELD = {"content": "content", "reasoning": "reasoning_content"}


def _splitter(reasoning: str):
    """The streaming splitter of a GenRequest's reasoning ("harmony", "think", "think-open")."""
    return HarmonySplitter() if reasoning == "harmony" else ThinkSplitter(opened=reasoning == "think-open")


def _assistant_message(text: str, reasoning: str | None) -> dict:
    """The assistant's message for its generated text: with reasoning put apart (GenRequest.reasoning), the
    answer as the content and the reasoning (a harmony model's analysis channel, a <think> block) as
    reasoning_content."""
    if not reasoning:
        return {"role": "assistant", "content": text}
    if reasoning == "harmony":
        reasoning, content = split_harmony(text)
    else:
        reasoning, content = split_think(text, opened=reasoning == "think-open")
    msg = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def _reasoning_chunks(chunk, i: int, parts: list, logprobs=None) -> bytes:
    """A chunk per harmony piece of choice i (content or reasoning_content), the logprobs with the first (or
    on an empty delta when the token was all frame, so that every token's logprobs arrive once)."""
    if not parts and logprobs is not None:
        parts = [("content", "")]
    return b"".join(chunk([{"index": i, "delta": {_FIELD[kind]: t}, "logprobs": logprobs if k == 0 else None,
                            "finish_reason": None}]) for k, (kind, t) in enumerate(parts))


async def _answer(server: Server, request: Request, req: GenRequest, jobs: list, q, chat: bool, tag, head: dict):
    """A request's whole answer as one JSON object (no stream): head's id, object, created and model, then
    each choice's text (or message), logprobs and finish_reason, and the usage."""
    texts = {j.index: [] for j in jobs}
    lps = {j.index: [] for j in jobs}
    done = {}
    watcher = asyncio.ensure_future(_watch_disconnect(request, q))
    try:
        async for ev in _events(q, len(jobs)):
            if ev["type"] == "error":
                raise APIError(500, ev["message"], type="server_error")
            if ev["type"] == "delta":
                texts[ev["index"]].append(ev["text"])
                lps[ev["index"]].extend(ev["logprobs"])
            else:
                done[ev["index"]] = tag(ev)
    except ConnectionError:
        return Response(status_code=499)
    finally:
        watcher.cancel()
        server.pipeline.cancel(jobs)  # frees the slots of unfinished jobs
    choices = []
    for j in jobs:
        i, text = j.index, "".join(texts[j.index])
        if chat:
            c = {"index": i, "message": _assistant_message(text, req.reasoning),
                 "logprobs": server.chat_logprobs(lps[i]) if req.logprobs else None}
        else:
            c = {"index": i, "text": text,
                 "logprobs": server.completion_logprobs(lps[i], 0) if req.logprobs else None}
        c["finish_reason"] = done[i]["finish_reason"]
        choices.append(c)
    answer = {**head, "choices": choices, "usage": _usage(done, set())}
    timings = _timings(done)
    if timings is not None:  # (llama-server's; OpenAI clients ignore it)
        answer["timings"] = timings
    return JSONResponse(answer)


async def generate(server: Server, request: Request, req: GenRequest, chat: bool):
    jobs, q = await server.submit(req)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    n = req.n

    def tag(ev):
        if ev["type"] == "done":
            ev["prompt_key"] = ev["index"] // n
        return ev

    if not req.stream:
        return await _answer(server, request, req, jobs, q, chat, tag,
                             {"id": rid, "object": obj, "created": created, "model": server.model_id})

    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, usage=None, timings=None) -> bytes:
        d = {"id": rid, "object": chunk_obj, "created": created, "model": server.model_id, "choices": choices}
        if usage is not None or req.include_usage:
            d["usage"] = usage
        if timings is not None:
            d["timings"] = timings
        return _sse(_dumps(d))

    templates = {}  # choice index -> the JSON of a plain delta, split where its text goes

    def plain_delta(i: int, text: str) -> bytes:
        # A delta without logprobs is the same JSON every time but for its text: rendered once per choice.
        t = templates.get(i)
        if t is None:
            marker = "\ue000optiml-text\ue000"  # private-use characters: JSON keeps them as they are
            c = ({"index": i, "delta": {"content": marker}, "logprobs": None, "finish_reason": None} if chat
                 else {"index": i, "text": marker, "finish_reason": None, "logprobs": None})
            head, _, tail = chunk([c]).rpartition(_dumps(marker).encode())
            t = templates[i] = (head, tail)
        return t[0] + _dumps(text).encode() + t[1]

    def delta(ev) -> bytes:
        i, text = ev["index"], ev["text"]
        offset = offsets[i]
        offsets[i] += len(text)
        if chat and req.reasoning:  # reasoning and answer apart
            lp = server.chat_logprobs(ev["logprobs"]) if req.logprobs else None
            return _reasoning_chunks(chunk, i, splitters[i].feed(text), lp)
        if not req.logprobs:
            return plain_delta(i, text)
        if chat:
            c = {"index": i, "delta": {"content": text}, "logprobs": server.chat_logprobs(ev["logprobs"]),
                 "finish_reason": None}
        else:
            c = {"index": i, "text": text, "finish_reason": None,
                 "logprobs": server.completion_logprobs(ev["logprobs"], offset)}
        return chunk([c])

    def finish(ev) -> bytes:
        done[ev["index"]] = tag(ev)
        rest = _reasoning_chunks(chunk, ev["index"], splitters[ev["index"]].flush()) if chat and req.reasoning else b""
        c = {"index": ev["index"], "finish_reason": ev["finish_reason"], "logprobs": None}
        c.update({"delta": {}} if chat else {"text": ""})
        # llama-server's timings go in the stream's last chunk: this one, unless the usage chunk follows
        last = len(done) == len(jobs) and not req.include_usage
        return rest + chunk([c], timings=_timings(done) if last else None)

    done = {}
    offsets = {j.index: 0 for j in jobs}
    splitters = {j.index: _splitter(req.reasoning) for j in jobs} if chat and req.reasoning else {}

    shutdown = anyio.Event()  # set by sse-starlette when the server is told to stop (SIGTERM, Ctrl-C)

    async def drain():
        # A stream that has not ended SHUTDOWN_DRAIN_S after the server was told to stop ends with an error
        # event the client can read (it was cut mid-chunk, "incomplete chunked read", with nothing said).
        await shutdown.wait()
        await asyncio.sleep(SHUTDOWN_DRAIN_S)
        q.put_nowait({"type": "shutdown"})

    async def stream():
        # Server-sent events as bytes (sse-starlette sends bytes as they are): one write per list of
        # waiting events.
        # The role's chunk goes out with the first tokens, in one write: a relay that sends a stream's pieces
        # at intervals (optiml serve --ray) would otherwise hold the first token back for one interval.
        role = chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None} for j in jobs]) if chat else b""
        status = "499"  # counted in /metrics when the stream ends: until its end is sent, the client went away
        drainer = asyncio.ensure_future(drain())
        try:
            async for evs in _event_lists(q, len(jobs)):
                out = [role]
                role = b""
                for ev in evs:
                    if ev["type"] in ("error", "shutdown"):
                        status = "503" if ev["type"] == "shutdown" else "500"
                        message = ("the server is shutting down; retry the request" if ev["type"] == "shutdown"
                                   else ev["message"])
                        out.append(_sse(_dumps({"error": {"message": message, "type": "server_error", "param": None,
                                                          "code": "server_shutting_down" if status == "503" else None}})))
                        yield b"".join(out)
                        return
                    out.append(delta(ev) if ev["type"] == "delta" else finish(ev))
                yield b"".join(out)
            if req.include_usage:
                yield chunk([], _usage(done, set()), _timings(done))
            status = "200"
            yield _sse("[DONE]")
        except Exception:
            status = "500"
            raise
        finally:
            drainer.cancel()
            server.pipeline.cancel(jobs)  # the client went away (or all is done): free the slots
            server.metrics.requests.labels("chat" if chat else "completions", status).inc()

    return _EventStream(stream(), ping=15, shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_DRAIN_S + 2)


class _EventStream(EventSourceResponse):
    """sse-starlette's response without its per-event cancel scope when there is no send timeout (ours):
    at a token per event, that scope was a third of the event loop's work per token. (An sse-starlette
    without this method simply keeps its own.)"""

    async def _send_with_timeout(self, send, message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def server_error_response(exc: Exception) -> JSONResponse:
    e = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
    return JSONResponse(e.body(), status_code=500)


def template_error(e: ChatTemplateError) -> APIError:
    """A chat template's failure as an answer: 400 when the template refuses the messages (its own
    raise_exception), else 500: the model's template is broken or hostile, whatever the request."""
    if e.problem == "refused":
        return APIError(400, str(e), param="messages", code="chat_template_refused")
    return APIError(500, str(e), type="server_error", code="chat_template_error")


def _dumps(d) -> str:
    return jsonout.dumps(d, ensure_ascii=False, separators=(",", ":"))


class JSONResponse(_StarletteJSONResponse):
    """Starlette's JSON response with NaN and Infinity written as null (a logprob of -inf, a statistic
    not measured yet) instead of failing the request."""

    def render(self, content) -> bytes:
        text = _dumps(content)
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (a request's own, echoed in an error): as JSON escapes
            return jsonout.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _sse(data: str) -> bytes:
    """One server-sent event (a single-line data field; JSON never holds a raw newline)."""
    return b"data: " + data.encode() + b"\r\n\r\n"


def _endpoint(server: Server, name: str, auth: bool = True):
    """A route's handler around `fn`: the key checked, errors answered in OpenAI's shape, /metrics counted."""
    m = server.metrics

    def deco(fn):
        async def handler(request: Request):
            status = 500
            try:
                if auth:
                    server.check_key(request)
                resp = await fn(request)
                status = None if isinstance(resp, _EventStream) else resp.status_code  # (a stream counts its end)
                return resp
            except APIError as e:
                status = e.status
                return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            except ChatTemplateError as e:
                err = template_error(e)
                status = err.status
                return JSONResponse(err.body(), status_code=err.status)
            except OptimlError as e:  # a request the engine refuses (e.g. a bad sampling setting)
                status = 400
                return JSONResponse(bad(str(e)).body(), status_code=400)
            except Exception as e:  # a bug: answered here, inside the CORS middleware (Starlette's last
                # resort answers outside it, and a browser page would read an opaque network error)
                log.exception("%s %s failed", request.method, request.url.path)
                return server_error_response(e)
            finally:
                if status is not None:
                    m.requests.labels(name, str(status)).inc()

        return handler

    return deco


def create_app(server: Server) -> Starlette:
    m = server.metrics

    endpoint = functools.partial(_endpoint, server)

    prepared = functools.partial(_prepared, server)

    @endpoint("chat")
    async def chat(request: Request):
        return await generate(server, request, await prepared(request, functools.partial(_chat_prepare, server)),
                              chat=True)

    @endpoint("completions")
    async def completions(request: Request):
        return await generate(server, request, await prepared(request, completions_prepare), chat=False)

    def completions_prepare(raw: bytes) -> GenRequest:
        body = parse_json(raw)
        server.check_model(body)
        prompts, fields = completion_request(body, server.model.n_vocab)
        ids = [server.tokenizer.encode(p, add_special=True, parse_special=True) if isinstance(p, str) else list(p)
               for p in prompts]
        for i, p in enumerate(ids):
            server.check_prompt(p, "prompt", "the prompt" if len(ids) == 1 else f"prompt {i}")
        return GenRequest(prompts=ids, **fields)

    @endpoint("embeddings")
    async def embeddings(request: Request):
        return await _embeddings(server, request)

    @endpoint("tokenize")
    async def tokenize(request: Request):
        return await _json_route(server, request, _tokenized)

    @endpoint("detokenize")
    async def detokenize(request: Request):
        return await _json_route(server, request, _detokenized)

    @endpoint("models")
    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [_model_card(server)]})

    @endpoint("model")
    async def model(request: Request):
        server.check_model_name(request.path_params["name"])
        return JSONResponse(_model_card(server))

    @endpoint("health", auth=False)
    async def health(request: Request):
        return JSONResponse(dict(status="ok", **server.pipeline.status()))

    @endpoint("metrics", auth=False)
    async def metrics(request: Request):
        return Response(m.render(), media_type=CONTENT_TYPE)

    with open(CHAT_PAGE, encoding="utf-8") as f:
        page = f.read()

    @endpoint("page", auth=False)  # the page holds no data: its API calls carry the key the user types
    async def chat_page(request: Request):
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    async def http_error(request: Request, exc: HTTPException):
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:  # (a client on the wrong path, /v1/v1/... or llama-server's /completion)
            message += f"; the routes are {_route_list(routes)}"
        e = APIError(exc.status_code, message,
                     type="invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(e.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception):
        return server_error_response(exc)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.pipeline.start()
        try:
            yield
        finally:
            server.pipeline.stop()

    routes = [
        Route("/", chat_page, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/chat/completions", chat, methods=["POST"]),  # llama-server's paths without /v1
        Route("/completions", completions, methods=["POST"]),
        Route("/models", models, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),  # (llama-server's /embeddings answers otherwise)
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    cors = (dict(allow_origin_regex=LOCAL_ORIGINS) if server.cors_origins is None else
            dict(allow_origins=list(server.cors_origins)))
    middleware = [Middleware(CORSMiddleware, allow_methods=["GET", "POST"], allow_headers=["*"],
                             expose_headers=["Retry-After", "x-optiml-replica"], max_age=600, **cors)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = server
    return app


def _chat_prepare(server: Server, raw: bytes) -> GenRequest:
    """A chat request's body -> GenRequest: the messages rendered with the template (and its variables), the
    prompt checked, the template's stop strings added, and where the answer's reasoning goes."""
    body = parse_json(raw)
    server.check_model(body)
    messages, variables, fields = chat_request(body, server.model.n_vocab)
    tpl = server.model.chat_template  # ChatTemplateError: see template_error
    try:
        text = tpl.render(messages, add_generation_prompt=True, **{**server.template_variables, **variables})
    except ChatTemplateError as e:  # past the template's limits because of the messages' own size: theirs
        chars = sum(len(msg["content"]) for msg in messages)
        if e.problem == "limit" and chars > MAX_OUTPUT_CHARS // 2:
            raise bad(f"the messages hold {chars} characters, more than this server renders into a prompt "
                      f"({MAX_OUTPUT_CHARS} characters)", "messages", code="context_length_exceeded") from None
        raise
    ids = server.chat_ids(text)
    server.check_prompt(ids)
    fields["stops"] = fields["stops"] + [s for s in tpl.stop if s not in fields["stops"]]
    if body.get("reasoning_format") != "none" and (server.harmony or server.thinking):
        fields["reasoning"] = "harmony" if server.harmony else "think-open" if opened_by(text) else "think"
    return GenRequest(prompts=[ids], **fields)


def _route_list(routes: list) -> str:
    """The routes as a 404 names them: "GET /, POST /v1/chat/completions, ..."."""
    return ", ".join(f"{m} {r.path.replace(':path', '')}" for r in routes for m in sorted(r.methods - {"HEAD"}))


async def _embeddings(server: Server, request: Request) -> JSONResponse:
    """POST /v1/embeddings: each input's vector from the pipeline (it runs between generation steps)."""
    ids, fmt, pooling = await _prepared(server, request, functools.partial(_embeddings_prepare, server))
    try:
        task = server.pipeline.embed(ids, pooling)
    except QueueFull as e:
        server.metrics.rejected.inc()
        raise APIError(503 if server.pipeline.stopping else 429, f"the server is busy: {e}; retry later",
                       type="server_busy", code="queue_full", headers={"Retry-After": "1"}) from None
    result = asyncio.wrap_future(task.fut)
    while not (await asyncio.wait({result}, timeout=0.25))[0]:
        # A client that left, or a server told to stop (as its streams are told), cancels what remains.
        if AppStatus.should_exit:
            task.cancelled = True
            raise APIError(503, "the server is shutting down; retry the request", type="server_error",
                           code="server_shutting_down")
        if await request.is_disconnected():
            task.cancelled = True
            raise APIError(499, "the client closed the connection", type="invalid_request_error")
    try:
        vectors = result.result()
    except QueueFull as e:  # (the server stopped while it waited)
        raise APIError(503, f"{e}; retry the request", type="server_error", code="server_shutting_down") from None
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    n = sum(len(x) for x in ids)
    return JSONResponse({"object": "list", "data": data, "model": server.model_id,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


def _embeddings_prepare(server: Server, raw: bytes) -> tuple:
    """The request's inputs as token id lists (checked against the context), the encoding, the pooling."""
    body = parse_json(raw)
    server.check_model(body)
    inputs, fmt = embedding_request(body, server.model.n_vocab)
    pooling = choose_pooling(server.pooling, server.model.hparams)  # (a reranker's file: refused here)
    if pooling == "none":
        raise bad("pooling none gives a vector per token, which /v1/embeddings cannot return: start the server "
                  "with --pooling mean, cls or last", "input")
    ids = [server.tokenizer.encode(p, add_special=True, parse_special=True) if isinstance(p, str) else list(p)
           for p in inputs]
    for i, p in enumerate(ids):
        which = "the input" if len(ids) == 1 else f"input {i}"
        if not p:
            raise bad(f"{which} gives no tokens", "input")
        if len(p) > server.model.n_ctx:
            raise bad(f"{which} has {len(p)} tokens; the context holds {server.model.n_ctx} (--ctx)", "input",
                      code="context_length_exceeded")
    return ids, fmt, pooling


async def _prepared(server: Server, request: Request, prepare):
    """prepare(raw body), off the event loop for a large body: parsing, rendering and tokenizing megabytes
    takes seconds, which would stall every other client's stream."""
    raw = await read_body(request, server.max_body)
    return await run_in_threadpool(prepare, raw) if len(raw) > PREPARE_INLINE_BYTES else prepare(raw)


async def _json_route(server: Server, request: Request, answer) -> JSONResponse:
    """answer(server, request body) as JSON (_prepared's way)."""
    def run(raw: bytes) -> JSONResponse:
        body = parse_json(raw)
        server.check_model(body)
        return JSONResponse(answer(server, body))

    return await _prepared(server, request, run)


def _tokenized(server: Server, body: dict) -> dict:
    """llama-server's POST /tokenize: {"content", "add_special"?, "parse_special"?, "with_pieces"?} ->
    {"tokens": ids, or [{"id", "piece"}] with_pieces}."""
    content, add_special, parse_special, with_pieces = tokenize_request(body)
    ids = server.tokenizer.encode(content, add_special=add_special, parse_special=parse_special)
    if not with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece_json(server.tokenizer.token_to_piece(t, True))} for t in ids]}


def _detokenized(server: Server, body: dict) -> dict:
    """llama-server's POST /detokenize: {"tokens"} -> {"content"}: each token's text, special ones too, joined
    (as llama-server does)."""
    ids = detokenize_request(body, server.model.n_vocab)
    text = b"".join(server.tokenizer.token_to_piece(t, True) for t in ids)
    return {"content": text.decode("utf-8", "replace")}


def _piece_json(piece: bytes):
    """A token's piece as llama-server's /tokenize gives it: the text, or its bytes where they are not UTF-8
    (part of a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def _model_card(server: Server) -> dict:
    return {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "optiml",
            "meta": {"n_ctx": server.model.n_ctx, "n_vocab": server.model.n_vocab,
                     "n_parallel": server.pipeline.n_parallel}}


def _model_names(model_id: str, path: str) -> set:
    """The names a request's "model" may give, lowercased: the id, the file's name with and without its
    extension, and the known model names (optiml pull's manifest) whose file this is."""
    base = os.path.basename(path)
    names = {model_id, base, os.path.splitext(base)[0]}
    try:
        from ..hub.registry import manifest

        for mid, e in manifest().items():
            if e.get("file") == base:
                names |= {mid, *e.get("aliases", [])}
    except (OSError, ValueError):  # no manifest in this install: the file's names are enough
        pass
    return {n.lower() for n in names}
