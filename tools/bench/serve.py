"""Serving throughput and latency: N concurrent streaming clients against `optiml serve` (and llama-server).

    python tools/bench/serve.py -m ~/.cache/optiml/models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2
    python tools/bench/serve.py -m MODEL.gguf -t 2 --clients 1 4 8 16 --llama-server /path/to/llama-server

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
import math
import shutil
import statistics
import sys
import time

import harness
from serving import PROMPT, Connection, free_port, one_request, run_level, start_server, stop_server, wait_ready


def stream_times(model, n: int) -> tuple[float, list, int]:
    """Model.stream's (start, time of each piece, tokens generated), as a client sees the server's."""
    t0 = time.perf_counter()
    ts = [time.perf_counter() for _ in model.stream(PROMPT, max_tokens=n, temperature=0)]
    return t0, ts, model.last_stats["gen_tokens"]


def rates(t0: float, ts: list, n: int) -> tuple[float | None, float | None]:
    """(end to end, generation) tokens/s of one stream of n tokens whose text pieces arrived at ts. Tokens
    are counted, not pieces: a piece may hold several tokens (held back until a UTF-8 character is whole).
    The generation rate (first piece to last) needs two pieces apart in time: None otherwise (--gen 1)."""
    if not ts or n < 1:
        return None, None
    e2e = n / (ts[-1] - t0)
    gen = (n - 1) / (ts[-1] - ts[0]) if n > 1 and ts[-1] > ts[0] else None
    return e2e, gen


def ms(seconds: float) -> str:
    """A latency for the table; "-" where there was none to measure (no gap between tokens with --gen 1)."""
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.0f}ms"


def single_stream(url: str, model, body: dict, reps: int) -> None:
    """One client against optiml generate in this process, alternating, same prompt and length."""
    runs = []  # per rep: {"serve": (e2e, gen), "generate": (e2e, gen)}
    conn = Connection(url)
    for _ in range(reps):
        out: list = []
        one_request(conn, body, out)
        runs.append({"serve": rates(*out[0], body["max_tokens"]),  # exactly max_tokens: end of text biased away
                     "generate": rates(*stream_times(model, body["max_tokens"]))})
    conn.close()
    med = statistics.median
    print(f"\n1 client against optiml generate ({reps} alternating runs of {body['max_tokens']} tokens, medians, "
          "tokens/s; tokens counted, not streamed pieces)")
    # The median of each run's ratio to the generate run beside it, as well: the machine's speed drifts
    # between runs (other work, clocks), much less within a pair.
    for label, i in (("end to end (from the request)", 0), ("generation (first to last token)", 1)):
        pairs = [(r["serve"][i], r["generate"][i]) for r in runs if r["serve"][i] and r["generate"][i]]
        if not pairs:
            print(f"  {label:34} - (needs at least two tokens arriving apart)")
            continue
        serve, gen = med(a for a, _ in pairs), med(b for _, b in pairs)
        print(f"  {label:34} serve {serve:7.1f}   generate {gen:7.1f}   ratio {serve / gen:.3f}   "
              f"(median of paired ratios {med(a / b for a, b in pairs):.3f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="a GGUF file or a known model name")
    ap.add_argument("-t", "--threads", type=harness.positive, default=2)
    ap.add_argument("--clients", type=harness.positive, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=harness.positive, default=2, help="requests per client")
    ap.add_argument("--gen", type=harness.positive, default=64, help="tokens generated per request")
    ap.add_argument("--ctx", type=harness.positive, default=512, help="context per slot")
    ap.add_argument("--llama-server", default=None, help="llama-server binary to compare with")
    args, res = harness.parse(ap, "serve")
    if args.llama_server and not shutil.which(args.llama_server):
        ap.error(f"--llama-server {args.llama_server}: no such program (give the path of a llama-server binary)")
    args.model = harness.model_arg(ap, args.model)

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
                res.add(server=name, clients=c, **r)
                print(f"{name:13} {c:7d} {r['tok_s']:8.1f} {ms(r['ttft_p50']):>9} {ms(r['ttft_p99']):>9} "
                      f"{ms(r['itl_p99']):>8}", flush=True)
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
    res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
