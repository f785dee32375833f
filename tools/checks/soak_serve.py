#!/usr/bin/env python3
"""Soak test of `optiml serve` under abuse, on 127.0.0.1 only, bounded in requests and time.

Starts the server as a child process (--parallel slots), asks each distinct greedy request once alone
(the reference answers), warms up, notes the server's resident memory, then runs --requests requests
from --clients concurrent clients (more clients than slots), mixing:
    chat       valid greedy chats (non-streamed), checked against the reference answer
    stream     greedy streams read to the end, checked the same way
    cancel     streams closed after the first few events (the server must free the slot)
    malformed  broken JSON, wrong types, unknown fields' values, non-UTF-8, bad HTTP, wrong paths
    oversize   bodies past the server's 16 MiB limit (413), announced or streamed
    slow       a valid chat sent a few bytes at a time, then read slowly
Afterwards the server must still answer correctly, /health must show every slot idle and the queue
empty, and resident memory must be within --rss-tolerance (5%) of its level after warm-up.

    python tools/checks/soak_serve.py -m ~/.cache/optiml/models/SmolLM2-135M-Instruct.Q4_1.gguf --requests 3000

Prints the figures and exits 1 when any check fails. tests/test_soak.py runs a short version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter

PROMPTS = ["Hi!", "What is 2+2?", "Name a color.", "Say hello in French.", "Count to five.",
           "What is the capital of Italy?", "Write one word.", "Tell me a fact about cats."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Client:
    """A minimal HTTP/1.1 client over asyncio streams (one connection per request, Connection: close),
    so malformed requests, slow senders and half-read streams are fully under control."""

    def __init__(self, port: int, timeout: float):
        self.port = port
        self.timeout = timeout

    async def raw(self, data: bytes, slow: float = 0.0, read_limit: int | None = None,
                  timeout: float | None = None) -> tuple[int, bytes]:
        timeout = self.timeout if timeout is None else timeout
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), timeout)
        try:
            if slow:
                for i in range(0, len(data), 16):
                    w.write(data[i:i + 16])
                    await w.drain()
                    await asyncio.sleep(slow)
            else:
                w.write(data)
                await w.drain()
            if read_limit is not None:  # read a little, then hang up
                got = b""
                while len(got) < read_limit:
                    part = await asyncio.wait_for(r.read(256), timeout)
                    if not part:
                        break
                    got += part
                return _status(got), got
            got = await asyncio.wait_for(r.read(-1), timeout)
            return _status(got), got
        finally:
            w.close()
            try:
                await w.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                      **kw) -> tuple[int, bytes]:
        h = {"Host": f"127.0.0.1:{self.port}", "Connection": "close"}
        if body is not None:
            h["Content-Type"] = "application/json"
            h["Content-Length"] = str(len(body))
        h.update(headers or {})
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        return await self.raw(head.encode() + (body or b""), **kw)


def _status(resp: bytes) -> int:
    try:
        return int(resp.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def _body(resp: bytes) -> bytes:
    head, _, body = resp.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size.split(b";")[0] or b"0", 16)
            if n == 0:
                break
            out += rest[:n]
            rest = rest[n + 2:]
        return out
    return body


def chat_body(prompt: str, max_tokens: int, stream: bool = False) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": stream}).encode()


def chat_text(resp: bytes) -> str:
    return json.loads(_body(resp))["choices"][0]["message"]["content"]


def stream_text(resp: bytes) -> tuple[str, bool]:
    text, done = [], False
    for line in _body(resp).decode("utf-8", "replace").splitlines():
        if not line.startswith("data: "):
            continue
        data = line[6:].strip()
        if data == "[DONE]":
            done = True
            continue
        d = json.loads(data)
        if "error" in d:
            raise RuntimeError(d["error"])
        for c in d["choices"]:
            text.append(c.get("delta", {}).get("content") or "")
    return "".join(text), done


MALFORMED = [
    ("POST", "/v1/chat/completions", b"{not json"),
    ("POST", "/v1/chat/completions", b"[1, 2, 3]"),
    ("POST", "/v1/chat/completions", b"\xff\xfe\x00garbage"),
    ("POST", "/v1/chat/completions", b'{"messages": "hi"}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": 5, "content": []}]}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -4}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 100000}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"zz": 1}}'),
    ("POST", "/v1/chat/completions", b'{"messages": [], "model": 12}'),
    ("POST", "/v1/completions", b'{"prompt": [99999999999]}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "stop": {"a": 1}}'),
    ("POST", "/v1/completions", b'{"prompt": "' + b"x " * 20000 + b'"}'),  # more tokens than the context
    ("GET", "/v1/chat/completions", None),
    ("POST", "/v1/nope", b"{}"),
    ("GET", "/v1/models/../../etc/passwd", None),
    ("DELETE", "/health", None),
]
RAW_GARBAGE = [b"GARBAGE\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: zz\r\n\r\n",
               b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64), b"GET / HTTP/9.9\r\n\r\n",
               b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro"]


async def soak(a) -> int:
    port = free_port()
    cmd = [sys.executable, "-m", "optiml", "serve", "-m", a.model, "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(a.parallel), "--ctx", str(a.ctx), "--queue", str(a.queue), "-t", str(a.threads)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log: list[str] = []

    async def pump():
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, proc.stdout.readline)
            if not line:
                return
            log.append(line.decode("utf-8", "replace"))

    pump_task = asyncio.ensure_future(pump())
    cl = Client(port, a.timeout)
    failures: list[str] = []
    counts: Counter = Counter()
    try:
        t0 = time.monotonic()
        while True:
            try:
                st, _ = await cl.request("GET", "/health")
                if st == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 120:
                raise SystemExit("the server did not start:\n" + "".join(log[-30:]))
            await asyncio.sleep(0.2)

        # The reference answers, each request alone.
        lengths = [2, 5, 8]
        reference = {}
        for p in PROMPTS:
            for n in lengths:
                st, resp = await cl.request("POST", "/v1/chat/completions", chat_body(p, n))
                if st != 200:
                    raise SystemExit(f"reference request failed with {st}: {_body(resp)[:300]!r}")
                reference[(p, n)] = chat_text(resp)

        rng = random.Random(a.seed)
        kinds = ["chat"] * 30 + ["stream"] * 10 + ["cancel"] * 15 + ["malformed"] * 30 + ["oversize"] * 5 + \
                ["slow"] * 5 + ["garbage"] * 5

        async def one(kind: str) -> None:
            p, n = rng.choice(PROMPTS), rng.choice(lengths)
            try:
                if kind == "chat":
                    st, resp = await cl.request("POST", "/v1/chat/completions", chat_body(p, n))
                    if st == 429:
                        counts["busy 429"] += 1
                        return
                    if st != 200:
                        failures.append(f"chat: status {st}: {_body(resp)[:200]!r}")
                    elif chat_text(resp) != reference[(p, n)]:
                        failures.append(f"chat {p!r} n={n}: {chat_text(resp)!r} != alone {reference[(p, n)]!r}")
                    else:
                        counts["greedy completions checked"] += 1
                elif kind == "stream":
                    st, resp = await cl.request("POST", "/v1/chat/completions", chat_body(p, n, stream=True))
                    if st == 429:
                        counts["busy 429"] += 1
                        return
                    text, done = stream_text(resp)
                    if st != 200 or not done:
                        failures.append(f"stream: status {st}, [DONE] {done}")
                    elif text != reference[(p, n)]:
                        failures.append(f"stream {p!r} n={n}: {text!r} != alone {reference[(p, n)]!r}")
                    else:
                        counts["greedy completions checked"] += 1
                elif kind == "cancel":
                    await cl.request("POST", "/v1/chat/completions", chat_body(p, 64, stream=True),
                                     read_limit=rng.choice([1, 200, 400]))
                    counts["streams cancelled"] += 1
                elif kind == "malformed":
                    method, path, body = rng.choice(MALFORMED)
                    st, resp = await cl.request(method, path, body)
                    if not 400 <= st < 500:
                        failures.append(f"malformed {method} {path} {body[:40] if body else b''!r}: status {st}")
                    counts["malformed (4xx)"] += 1
                elif kind == "oversize":
                    if rng.random() < 0.5:  # announced: refused from the header
                        st, _ = await cl.request("POST", "/v1/chat/completions", b"{}",
                                                 headers={"Content-Length": str(64 << 20)}, read_limit=12)
                    else:  # streamed in chunks past the limit
                        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                "Transfer-Encoding: chunked\r\n\r\n").encode()
                        chunk = b"100000\r\n" + b"x" * 0x100000 + b"\r\n"
                        try:
                            st, _ = await cl.raw(head + chunk * 17 + b"0\r\n\r\n")
                        except (ConnectionError, OSError):
                            st = 413  # the server hung up once it had refused the body
                    if st not in (413, 0):
                        failures.append(f"oversize: status {st}")
                    counts["oversize (413)"] += 1
                elif kind == "slow":
                    st, resp = await cl.request("POST", "/v1/chat/completions", chat_body(p, n), slow=0.01)
                    if st == 200 and chat_text(resp) == reference[(p, n)]:
                        counts["greedy completions checked"] += 1
                        counts["slow clients"] += 1
                    elif st != 429:
                        failures.append(f"slow: status {st}")
                else:
                    try:
                        # A body shorter than its Content-Length leaves the server waiting for the rest,
                        # as HTTP says: hang up after 2 s, as such a client would (then the next kind).
                        await cl.raw(rng.choice(RAW_GARBAGE), read_limit=12, timeout=2.0)
                    except (ConnectionError, OSError):
                        pass
                    counts["garbage bytes"] += 1
            except (asyncio.TimeoutError, ConnectionError, OSError) as e:
                failures.append(f"{kind}: {type(e).__name__}: {e}")

        # Warm-up: a round of every kind, then the baseline memory.
        await asyncio.gather(*(one(k) for k in sorted(set(kinds)) * 3))
        await asyncio.sleep(1.0)
        rss_warm = rss_kib(proc.pid)
        counts.clear()
        failures.clear()

        start = time.monotonic()
        todo = a.requests
        sem = asyncio.Semaphore(a.clients)
        peak = rss_warm

        async def worker(kind):
            nonlocal peak
            async with sem:
                if time.monotonic() - start > a.max_seconds:
                    counts["skipped (time bound)"] += 1
                    return
                await one(kind)
                peak = max(peak, rss_kib(proc.pid))

        await asyncio.gather(*(worker(rng.choice(kinds)) for _ in range(todo)))
        elapsed = time.monotonic() - start

        # Afterwards: idle slots, memory back, still correct.
        await asyncio.sleep(2.0)
        st, resp = await cl.request("GET", "/health")
        health = json.loads(_body(resp))
        if health.get("slots_processing") != 0 or health.get("queue") != 0 or health.get("slots_idle") != a.parallel:
            failures.append(f"slots leaked: /health says {health}")
        for (p, n), want in list(reference.items())[:6]:
            st, resp = await cl.request("POST", "/v1/chat/completions", chat_body(p, n))
            if st != 200 or chat_text(resp) != want:
                failures.append(f"after the soak: {p!r} -> {st} {_body(resp)[:100]!r}, alone {want!r}")
        st, resp = await cl.request("GET", "/metrics")
        running = [ln for ln in _body(resp).decode().splitlines() if ln.startswith("optiml_running_sequences ")]
        if not running or float(running[0].split()[1]) != 0:
            failures.append(f"metrics: {running}")
        rss_end = rss_kib(proc.pid)
        if proc.poll() is not None:
            failures.append(f"the server exited with {proc.returncode}")
        change = (rss_end - rss_warm) / rss_warm
        if abs(change) > a.rss_tolerance:
            failures.append(f"resident memory {rss_warm / 1024:.1f} MiB after warm-up, {rss_end / 1024:.1f} MiB "
                            f"after the soak ({change:+.1%}, tolerance {a.rss_tolerance:.0%})")

        print(f"soak: {a.requests} requests from {a.clients} clients on {a.parallel} slots in {elapsed:.1f} s")
        for k, v in sorted(counts.items()):
            print(f"  {k}: {v}")
        print(f"  RSS after warm-up {rss_warm / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB, "
              f"after {rss_end / 1024:.1f} MiB ({change:+.2%})")
        print(f"  /health after: {health}")
        print(f"  failures: {len(failures)}")
        for f in failures[:20]:
            print("   ", f)
        return 1 if failures else 0
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        pump_task.cancel()
        if proc.returncode not in (0, -15) and a.verbose:
            print("".join(log[-40:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--clients", type=int, default=12, help="concurrent clients (more than --parallel)")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--queue", type=int, default=6, help="server queue: small, so that some requests get 429")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=900, help="time bound: later requests are skipped")
    ap.add_argument("--timeout", type=float, default=120, help="per request")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    return asyncio.run(soak(a))


if __name__ == "__main__":
    sys.exit(main())
