"""Driving an HTTP server under load, shared by serve.py and offload.py: start one on a free port, wait
until it is ready, and time N streaming clients against it (tokens/s, time to first token, inter-token
latency) with a client light enough not to compete with the server for the cores."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse

import httpx

PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
          "combined movable metal type, oil-based ink and a wooden screw press. Write a long story about it:")


EVENT_END = re.compile(rb"\r?\n\r?\n")  # the blank line that ends a server-sent event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list) -> subprocess.Popen:
    """Starts a server whose stderr goes to a temporary file (proc.log), so that a failure can show why."""
    log = tempfile.NamedTemporaryFile(prefix="bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=log)
    proc.log = log.name
    log.close()
    return proc


def server_log(proc, lines: int = 40) -> str:
    """The last lines of what the server wrote to stderr."""
    try:
        with open(proc.log, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip() or "(nothing on stderr)"
    except (AttributeError, OSError):
        return "(no log)"


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(AttributeError, OSError):
        os.unlink(proc.log)


def wait_ready(url: str, proc, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server {' '.join(map(str, proc.args))} exited with {proc.returncode}; its "
                             f"stderr:\n{server_log(proc)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not become ready in {timeout:.0f} s; its stderr:\n{server_log(proc)}")


class Connection:
    """A kept-alive HTTP/1.1 connection on a raw socket: the client's work per arrival is one recv and
    one timestamp, so it takes as little as it can of the cores the server computes on (http.client's
    chunked reader cost about 0.13 ms per streamed token here, as much as the server's event loop)."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        self.addr = (u.hostname, u.port)
        self.sock = None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def stream(self, path: str, payload: bytes) -> tuple[float, list]:
        """POSTs payload and reads the chunked response to its end: (start time, [(time, raw bytes)])."""
        for attempt in range(2):
            if self.sock is None:
                self.sock = socket.create_connection(self.addr, timeout=600)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = (f"POST {path} HTTP/1.1\r\nHost: {self.addr[0]}:{self.addr[1]}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
            t0 = time.perf_counter()
            arrived, tail = [], b""
            try:
                self.sock.sendall(head + payload)
                while True:
                    data = self.sock.recv(1 << 16)
                    if not data:
                        raise ConnectionResetError("the server closed the connection")
                    arrived.append((time.perf_counter(), data))
                    if len(arrived) == 1 and not data.startswith((b"HTTP/1.1 200 ", b"HTTP/1.0 200 ")):
                        raise SystemExit(f"the server answered {data[:400]!r}")
                    tail = (tail + data)[-7:]
                    if tail == b"\r\n0\r\n\r\n":  # the last chunk of a chunked response
                        return t0, arrived
            except (ConnectionResetError, BrokenPipeError):
                # A kept-alive connection the server had closed (llama-server does after some streams):
                # once more on a new one, with the clock restarted.
                self.close()
                if len(arrived) > 0 or attempt:
                    raise
        raise AssertionError("unreachable")


def event_times(arrived: list) -> list:
    """The arrival time of each server-sent event that carries text (a completion's or a chat delta's),
    from a chunked HTTP response."""
    raw = b"".join(d for _, d in arrived)
    ends, n = [], 0  # raw offset where each arrival ends
    for t, d in arrived:
        n += len(d)
        ends.append((n, t))
    head_end = raw.index(b"\r\n\r\n") + 4
    status = raw[:raw.index(b"\r\n")]
    if b" 200 " not in status:
        raise SystemExit(f"the server answered {status!r}: {raw[head_end:head_end + 300]!r}")
    # De-chunk, remembering for each body byte where it was in the raw stream.
    body, where, i = bytearray(), [], head_end
    while True:
        eol = raw.index(b"\r\n", i)
        size = int(raw[i:eol].split(b";")[0], 16)
        if size == 0:
            break
        body += raw[eol + 2:eol + 2 + size]
        where.append((len(body), eol + 2 + size))
        i = eol + 2 + size + 2
    times, k, w, start = [], 0, 0, 0
    for m in EVENT_END.finditer(bytes(body)):
        line = bytes(body[start:m.start()]).decode().strip()
        start = m.end()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        d = json.loads(line[6:])
        c = d["choices"][0] if d.get("choices") else {}
        if not (c.get("text") or (c.get("delta") or {}).get("content")):
            continue
        while where[w][0] < m.end():
            w += 1
        raw_at = where[w][1]
        while ends[k][0] < raw_at:
            k += 1
        times.append(ends[k][1])
    return times


def one_request(conn: Connection, body: dict, out: list) -> None:
    """One streamed request: appends (start, [time of each event that carries text]). The stream is
    only timestamped while it arrives; it is parsed afterwards, so the client's own work does not compete
    with the server for the cores. Both servers get the same client."""
    t0, arrived = conn.stream("/v1/completions", json.dumps(body).encode())
    out.append((t0, event_times(arrived)))


def run_level(url: str, clients: int, requests: int, body: dict) -> dict:
    results: list = []
    errors: list = []

    def client():
        try:
            conn = Connection(url)
            for _ in range(requests):
                one_request(conn, body, results)
            conn.close()
        except BaseException as e:  # (a thread's exception would be printed and forgotten: the figures were wrong)
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} of {clients} clients of {url} failed; the first: "
                         f"{type(errors[0]).__name__}: {errors[0]}")
    if len(results) != clients * requests:
        raise SystemExit(f"{url}: {len(results)} of {clients * requests} requests completed")
    # A streamed piece may carry more than one token (held back by UTF-8): count tokens, not pieces.
    tokens = clients * requests * body["max_tokens"]
    ttft = sorted(ts[0] - start for start, ts in results if ts)
    itl = sorted(b - a for _, ts in results for a, b in zip(ts, ts[1:]))

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {"tok_s": tokens / wall, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p99": pct(itl, 0.99)}


if __name__ == "__main__":
    import sys

    print("tools/bench/serving.py: a library used by the other benchmarks: see tools/bench/run.py", file=sys.stderr)
    sys.exit(2)
