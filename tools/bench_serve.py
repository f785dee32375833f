"""Serving throughput and latency: N concurrent streaming clients against `optiml serve` (and llama-server).

    python tools/bench_serve.py -m ~/.cache/optiml/models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2
    python tools/bench_serve.py -m MODEL.gguf -t 2 --clients 1 4 8 16 --llama-server /path/to/llama-server

Each client sends `--requests` streamed /v1/completions one after another, with a fixed prompt and exactly
`--gen` generated tokens (the end-of-generation tokens get a -100 logit bias). Per concurrency level:
aggregate generated tokens/s (all tokens / wall time), time to first token p50/p99 and inter-token
latency p99. The server runs with --parallel = the largest client count. With --llama-server (a binary
built from llama.cpp, e.g. the vendored copy in llama-cpp-python's source distribution) the same clients
run against it with -np, the same context per slot and threads, in the same run, alternating per level.
The single-stream reference is optiml.Model.generate in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
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
    """The arrival time of each server-sent event that carries text, from a chunked HTTP response."""
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
        if not (d.get("choices") and d["choices"][0].get("text")):
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

    def client():
        conn = Connection(url)
        for _ in range(requests):
            one_request(conn, body, results)
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    # A streamed piece may carry more than one token (held back by UTF-8): count tokens, not pieces.
    tokens = clients * requests * body["max_tokens"]
    ttft = sorted(ts[0] - start for start, ts in results if ts)
    itl = sorted(b - a for _, ts in results for a, b in zip(ts, ts[1:]))

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {"tok_s": tokens / wall, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p99": pct(itl, 0.99)}


def stream_times(model, n: int) -> tuple[float, list]:
    """Model.stream's (start, time of each piece), as a client sees the server's."""
    t0 = time.perf_counter()
    return t0, [time.perf_counter() for _ in model.stream(PROMPT, max_tokens=n, temperature=0)]


def single_stream(url: str, model, body: dict, reps: int) -> None:
    """One client against optiml generate in this process, alternating, same prompt and length."""
    e2e = {"serve": [], "generate": []}
    rate = {"serve": [], "generate": []}
    conn = Connection(url)
    for _ in range(reps):
        out: list = []
        one_request(conn, body, out)
        runs = {"serve": out[0], "generate": stream_times(model, body["max_tokens"])}
        for name, (t0, ts) in runs.items():
            e2e[name].append(len(ts) / (ts[-1] - t0))
            rate[name].append((len(ts) - 1) / (ts[-1] - ts[0]))
    conn.close()
    med = statistics.median
    print(f"\n1 client against optiml generate ({reps} alternating runs of {body['max_tokens']} tokens, medians, "
          "tokens/s; a streamed piece is a token here, both sides)")
    # The median of each run's ratio to the generate run beside it, as well: the machine's speed drifts
    # between runs (other work, clocks), much less within a pair.
    for label, d in (("end to end (from the request)", e2e), ("generation (first to last token)", rate)):
        pairs = med([a / b for a, b in zip(d["serve"], d["generate"])])
        print(f"  {label:34} serve {med(d['serve']):7.1f}   generate {med(d['generate']):7.1f}   "
              f"ratio {med(d['serve']) / med(d['generate']):.3f}   (median of paired ratios {pairs:.3f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--ctx", type=int, default=512, help="context per slot")
    ap.add_argument("--llama-server", default=None, help="llama-server binary to compare with")
    args = ap.parse_args()

    import optiml

    tok = optiml.tokenizer.load(args.model)
    bias = {str(t): -100 for t in tok.eog_ids}
    body = {"prompt": PROMPT, "max_tokens": args.gen, "temperature": 0, "stream": True, "logit_bias": bias}
    n_par = max(args.clients)

    model = optiml.Model(args.model, n_ctx=args.ctx, n_threads=args.threads)
    model.generate(PROMPT, max_tokens=8, temperature=0)  # warm up, and the prompt is cached as the server's is

    servers = {}
    port = free_port()
    servers["optiml"] = (f"http://127.0.0.1:{port}", start_server(
        [sys.executable, "-m", "optiml", "serve", "-m", args.model, "--port", str(port), "--parallel", str(n_par),
         "--ctx", str(args.ctx), "-t", str(args.threads), "--queue", str(4 * n_par)]))
    if args.llama_server:
        port = free_port()
        servers["llama-server"] = (f"http://127.0.0.1:{port}", start_server(
            [args.llama_server, "-m", args.model, "--port", str(port), "-np", str(n_par), "-c",
             str(args.ctx * n_par), "-t", str(args.threads), "-tb", str(args.threads), "--cont-batching"]))
    try:
        for url, proc in servers.values():
            wait_ready(url, proc)
        for url, _ in servers.values():  # warm up
            run_level(url, 1, 1, dict(body, max_tokens=4))
        print(f"\n{'server':13} {'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99':>8}")
        rows = {}
        for c in args.clients:
            for name, (url, _) in servers.items():  # alternate servers at each level
                r = run_level(url, c, args.requests, body)
                rows[(name, c)] = r
                print(f"{name:13} {c:7d} {r['tok_s']:8.1f} {r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p99'] * 1e3:7.0f}ms "
                      f"{r['itl_p99'] * 1e3:6.0f}ms", flush=True)
        if "llama-server" in servers:
            print("\nratio optiml / llama-server (tok/s):",
                  ", ".join(f"{c}: {rows[('optiml', c)]['tok_s'] / rows[('llama-server', c)]['tok_s']:.2f}x"
                            for c in args.clients))
        if 1 in args.clients:
            single_stream(servers["optiml"][0], model, body, max(args.requests, 5))
    finally:
        model.close()
        for _, proc in servers.values():
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
