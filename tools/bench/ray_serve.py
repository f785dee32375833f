"""optiml serve on Ray Serve: aggregate tokens/s and time to first token for 1 and 2 replicas, beside the
single-node server, on this machine.

    python tools/bench/ray_serve.py -m ~/.cache/optiml/models/SmolLM2-135M-Instruct.Q4_1.gguf
    python tools/bench/ray_serve.py -m MODEL.gguf --rounds 5 --requests 6 --gen 96

Three servers, each replica one thread (one core) with --parallel slots, all up at once:
  plain        optiml serve (uvicorn, no Ray) in a subprocess, driven by --parallel clients
  ray x1       a Ray Serve application of 1 replica (route /one) driven by --parallel clients
  ray x2       a Ray Serve application of 2 replicas (route /two) driven by 2 x --parallel clients
(one local Ray cluster, loopback, no dashboard, 3 logical CPUs for the 3 replicas; only the application
being measured does work). "ray x2 at twice the load of ray x1" answers both goals of issue #48 at once:
throughput (x2 over x1, goal >= 1.6) and p99 time to first token (x2 over x1 at half its load, goal <= 1).

Clients stream /v1/completions one after another (`--requests` each), every prompt different from the
first token on (no shared prefix: the router balances by load alone), exactly `--gen` generated tokens
(end of generation biased away). The client is tools/bench_serve.py's: raw sockets, timestamps only while
the answer arrives. A round runs every server once (in rotating order); the figures are the medians of
`--rounds` rounds, as the machine is shared and noisy. These closed-loop clients start together and,
their answers being equally long, keep arriving together: every replica reads its clients' prompts in
one step, the worst case for the time to the first token, and the p99 of 16 or 32 requests is their
maximum.

Then open-loop arrivals (`--rate`, Poisson, as users arrive): ray x1 at R requests a second and ray x2 at
2R, `--open-requests` and twice as many, so that a p99 is a percentile; times to the first token count
from when a request was due, waits for a free slot included. Then, at 1 client, the cost of the Ray hops
(time to first token against the plain server), and the router's own work per request.

Sizing for N machines (what scales, what the router costs): see SIZING below, printed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import harness  # noqa: E402  (tools/bench/: makes optiml importable, here and in the servers it starts; --json)

import threading  # noqa: E402

from serving import PROMPT, Connection, event_times, free_port, start_server, stop_server, wait_ready  # noqa: E402

SIZING = """\
Sizing for N machines
- What scales: each replica is a whole optiml server (its own Model, KV slots and scheduler thread), so
  replicas add throughput as long as each gets its own cores and memory bandwidth: across machines that
  is linear in the replicas; on one machine decoding is memory-bound, so replicas on one socket scale
  until they share out its bandwidth (a replica per NUMA node or per GPU is the natural unit). Give each
  replica --threads = the cores it owns (Ray reserves them as num_cpus) and, with --device cuda, one GPU
  (num_gpus=1, --vram its budget). Memory per replica: the model (a mapped file is shared by the
  replicas of one node; --no-mmap copies it) plus the KV cache of --parallel slots of --ctx tokens.
  Plan --parallel slots per replica and as many concurrent clients: a replica takes no more requests
  than it has slots, the rest wait in the router for the first free slot anywhere (--queue of them).
- What does not scale: one request runs on one replica (its tokens come as fast as the single server's),
  and each replica has its own prefix cache, which the prefix-affinity router keeps useful (above: the
  turns of a chat stay on one replica).
- What the router costs: every request takes two hops (Ray Serve's proxy, then the ingress) and every
  streamed item costs a message in both (the "proxy" and "ingress" columns, per token, with items of
  --stream-interval-ms; plus the replica's own share of Ray's work, "replicas" against "plain"), and a
  Ray Serve cluster spends some CPU when idle ("ray other": the controller, the GCS, the agents). These
  costs are per item and per second, not per unit of model work: against a 135M model on one core they
  are a large share of a token (above), against a model 10x the work they are a tenth of it. The routing
  decision itself (the prompt's block hashes against each replica's recent blocks) is microseconds.
- Many replicas: one ingress relays every token of every stream; give it replicas of its own
  (deployments: OptimlIngress num_replicas) when its CPU nears a core. Each ingress routes by what it
  sent itself, so put client affinity (a chat's turns to one ingress) in the load balancer in front of
  Ray Serve's proxies (one per node).
"""


def chat_ttft(url: str, requests: int, bias: dict, max_tokens: int = 8) -> float:
    """One client's median time to the first token of a streamed chat answer (the role's chunk does
    not count), one request at a time, every conversation different."""
    import json

    conn = Connection(url)
    try:
        times = []
        for k in range(requests):
            b = {"messages": [{"role": "user", "content": f"Question {k}: {PROMPT[:200]}"}], "max_tokens": max_tokens,
                 "temperature": 0, "stream": True, "logit_bias": bias}
            t0, arrived = conn.stream(url_path(url) + "/v1/chat/completions", json.dumps(b).encode())
            times.append(event_times(arrived)[0] - t0)
        return statistics.median(times)
    finally:
        conn.close()


def run_level(url: str, clients: int, requests: int, body: dict, tag: str) -> dict:
    """`clients` closed-loop clients, `requests` each, every prompt different from its first token."""
    import json

    results: list = []
    failed: list = []
    lock = threading.Lock()

    def client(c):
        conn = Connection(url)
        try:
            for k in range(requests):
                b = dict(body, prompt=f"{tag} {c}.{k}: {PROMPT}")
                t0, arrived = conn.stream(url_path(url) + "/v1/completions", json.dumps(b).encode())
                with lock:
                    results.append((t0, arrived))
        except BaseException as e:  # SystemExit too: the server's bad answer
            failed.append(e)
        finally:
            conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failed:
        raise SystemExit(f"{url}: {failed[0]}")
    ttft = sorted(event_times(a)[0] - s for s, a in results)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"tok_s": clients * requests * body["max_tokens"] / wall, "ttft_p50": pct(ttft, 0.5),
            "ttft_p99": pct(ttft, 0.99)}


def open_loop(url: str, rate: float, n: int, body: dict, tag: str, seed: int) -> dict:
    """`n` requests at Poisson arrivals of `rate` a second (a pool of senders, each on its own kept-alive
    connection); times to the first token from when each request was due."""
    import json
    import queue
    import random

    rnd = random.Random(seed)
    todo: queue.Queue = queue.Queue()
    results: list = []
    failed: list = []
    lock = threading.Lock()

    def sender():
        conn = Connection(url)
        try:
            while (item := todo.get()) is not None:
                k, due = item
                while (wait := due - time.perf_counter()) > 0:
                    time.sleep(wait)
                _, arrived = conn.stream(url_path(url) + "/v1/completions",
                                         json.dumps(dict(body, prompt=f"{tag} {k}: {PROMPT}")).encode())
                with lock:
                    results.append((due, event_times(arrived)[0], arrived[-1][0]))
        except BaseException as e:  # SystemExit too: the server's bad answer
            failed.append(e)
        finally:
            conn.close()

    senders = [threading.Thread(target=sender) for _ in range(32)]
    for t in senders:
        t.start()
    due = time.perf_counter() + 0.1
    for k in range(n):
        due += rnd.expovariate(rate)
        todo.put((k, due))
    for _ in senders:
        todo.put(None)
    for t in senders:
        t.join()
    if failed:
        raise SystemExit(f"{url}: {failed[0]}")
    ttft = sorted(first - due for due, first, _ in results)
    wall = max(end for *_, end in results) - min(due for due, *_ in results)
    return {"tok_s": n * body["max_tokens"] / wall, "ttft_p50": ttft[len(ttft) // 2],
            "ttft_p90": ttft[int(0.9 * len(ttft))], "ttft_p99": ttft[int(0.99 * len(ttft))]}


ROLES = {"proxy": b"ProxyActor", "ingress": b"OptimlIngress", "replicas": b"OptimlReplica"}


def ray_cpu(plain_pid: int | None = None) -> dict:
    """CPU milliseconds so far of this machine's Ray Serve processes by role (Linux /proc; "ray other":
    the controller, raylet, GCS and agents), and of the plain server's process."""
    out = dict.fromkeys(list(ROLES) + ["ray other", "plain"], 0.0)
    tick = 1000.0 / os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{d}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = "plain" if d == str(plain_pid) else next((r for r, key in ROLES.items() if key in cmd), None)
        if role is None and (b"ray::" in cmd or b"/ray/" in cmd):
            role = "ray other"
        if role is not None:
            out[role] += (int(st[11]) + int(st[12])) * tick
    return out


def url_path(url: str) -> str:
    """The path part of a base URL (a Ray Serve application's route prefix)."""
    rest = url.split("://", 1)[1]
    return rest[rest.index("/"):] if "/" in rest else ""


def affinity(url: str, conversations: int = 8, turns: int = 4, at_once: int = 4) -> tuple[float, float]:
    """Multi-turn chats, `at_once` of them at a time: (share of follow-up turns answered by the replica
    that answered the turn before, share of their prompt tokens read from the prefix cache)."""
    import concurrent.futures

    import httpx

    def chat(c):
        msgs = [{"role": "system", "content": f"Chat {c}. You are a patient assistant who explains things step by "
                                              f"step to a student named Student{c}."}]
        same = cached = prompt = 0
        last = None
        with httpx.Client(timeout=120) as http:
            for t in range(turns):
                msgs.append({"role": "user", "content": f"Question {t}: what is {t + 2} times {c + 3}?"})
                r = http.post(url + "/v1/chat/completions",
                              json={"messages": msgs, "max_tokens": 12, "temperature": 0})
                r.raise_for_status()
                d = r.json()
                msgs.append({"role": "assistant", "content": d["choices"][0]["message"]["content"]})
                replica = r.headers["x-optiml-replica"]
                if t:
                    same += replica == last
                    cached += d["usage"]["prompt_tokens_details"]["cached_tokens"]
                    prompt += d["usage"]["prompt_tokens"]
                last = replica
        return same, cached, prompt

    with concurrent.futures.ThreadPoolExecutor(at_once) as ex:
        res = list(ex.map(chat, range(conversations)))
    return (sum(r[0] for r in res) / (conversations * (turns - 1)),
            sum(r[1] for r in res) / max(1, sum(r[2] for r in res)))


def router_cost(prompt_chars: int, replicas: int, capacity: int = 4096, reps: int = 2000) -> float:
    """Seconds the prefix router spends per request: hashing the prompt's blocks and matching them
    against each replica's recent blocks (full history tables)."""
    import collections
    import random

    from optiml.server.ray_serve import PrefixAffinityRouter, block_hashes

    r = object.__new__(PrefixAffinityRouter)
    r.initialize_state(capacity=capacity)
    rnd = random.Random(0)
    for i in range(replicas):
        r._seen[i] = collections.OrderedDict((rnd.getrandbits(60), None) for _ in range(capacity))
    text = "".join(rnd.choice("abcdefgh ") for _ in range(prompt_chars))
    r._seen[0].update((h, None) for h in block_hashes(text, r._block))  # one replica holds the whole prompt
    t0 = time.perf_counter()
    for _ in range(reps):
        hashes = block_hashes(text, r._block)
        max(r._match(i, hashes) for i in range(replicas))
    return (time.perf_counter() - t0) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None,
                    help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the cache)")
    ap.add_argument("--parallel", type=harness.positive, default=4, help="slots per replica, and clients per replica")
    ap.add_argument("--requests", type=harness.positive, default=4, help="requests per client per round")
    ap.add_argument("--gen", type=harness.positive, default=64, help="tokens generated per request")
    ap.add_argument("--ctx", type=harness.positive, default=512, help="context per slot")
    ap.add_argument("--rounds", type=harness.positive, default=3)
    ap.add_argument("--rate", type=float, default=None,
                    help="open-loop requests a second for ray x1 (x2 gets twice as many); default: 40%% of ray "
                         "x1's closed-loop requests a second in this run; 0 skips the open-loop part")
    ap.add_argument("--open-requests", type=harness.positive, default=150,
                    help="open-loop requests per round for ray x1 (x2: twice as many)")
    ap.add_argument("--stream-interval-ms", type=float, default=100,
                    help="the replicas' stream batching (optiml serve --ray's; 0: every piece as it comes)")
    args, results = harness.parse(ap, "ray_serve")
    if args.rate is not None and args.rate < 0:
        ap.error(f"--rate is requests a second: 0 (skip the open loop) or more, not {args.rate}")
    model = harness.model_arg(ap, args.model or "smollm2-135m-instruct")
    try:
        import ray  # noqa: F401  (checked before any server starts)
    except ImportError:
        sys.exit('ray_serve.py needs Ray Serve: pip install ".[ray]"')

    import optiml
    tok = optiml.tokenizer.load(model)
    body = {"max_tokens": args.gen, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100 for t in tok.eog_ids}}
    P = args.parallel

    from ray import serve

    from optiml.server import ray_serve as rs

    port = free_port()
    plain = start_server(
        [sys.executable, "-m", "optiml", "serve", "-m", model, "--port", str(port), "--parallel", str(P),
         "--ctx", str(args.ctx), "-t", "1", "--queue", str(4 * P)])
    servers = {"plain": (f"http://127.0.0.1:{port}", P)}
    ray_port = free_port()
    t0 = time.perf_counter()
    rs.start_local_cluster(num_cpus=3)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": ray_port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        common = dict(cpus=1, n_parallel=P, max_queue=4 * P, stream_interval_ms=args.stream_interval_ms,
                      model_kwargs={"n_ctx": args.ctx, "n_threads": 1}, server_kwargs={"model_id": "bench"})
        serve.run(rs.build(model, replicas=1, **common), name="one", route_prefix="/one")
        serve.run(rs.build(model, replicas=2, **common), name="two", route_prefix="/two")
        servers["ray x1"] = (f"http://127.0.0.1:{ray_port}/one", P)
        servers["ray x2"] = (f"http://127.0.0.1:{ray_port}/two", 2 * P)
        wait_ready(servers["plain"][0], plain)
        print(f"cluster and 3 replicas up in {time.perf_counter() - t0:.0f} s; {args.rounds} rounds of "
              f"{args.requests} requests per client, {args.gen} tokens each, {P} slots and 1 thread per replica, "
              f"streams sent every {args.stream_interval_ms:g} ms",
              flush=True)
        for name, (url, _) in servers.items():  # warm up (and the first grammar-free request's setup)
            run_level(url, 1, 1, dict(body, max_tokens=4), "warm")

        rows = {name: [] for name in servers}
        cpu = {name: dict.fromkeys(list(ROLES) + ["ray other", "plain", "bench"], 0.0) for name in servers}
        names = list(servers)
        print(f"load average before: {os.getloadavg()[0]:.1f} (2 cores here: others' work shares them)")
        for r in range(args.rounds):
            for name in names[r % 3:] + names[:r % 3]:  # rotate the order: drift is shared out
                url, clients = servers[name]
                before = dict(ray_cpu(plain.pid), bench=time.process_time() * 1e3)
                res = run_level(url, clients, args.requests, body, f"r{r}")
                after = dict(ray_cpu(plain.pid), bench=time.process_time() * 1e3)
                for role in cpu[name]:
                    cpu[name][role] += after[role] - before[role]
                rows[name].append(res)
                print(f"  round {r + 1} {name:7} {clients:2d} clients {res['tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{res['ttft_p50'] * 1e3:6.0f} ms  p99 {res['ttft_p99'] * 1e3:6.0f} ms", flush=True)
        med = {name: {k: statistics.median(x[k] for x in rs_) for k in rs_[0]} for name, rs_ in rows.items()}
        print(f"\nmedians of {args.rounds} rounds")
        print(f"{'server':8} {'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}")
        for name, m in med.items():
            results.add(loop="closed", server=name, clients=servers[name][1], **m)
            print(f"{name:8} {servers[name][1]:7d} {m['tok_s']:8.1f} {m['ttft_p50'] * 1e3:7.0f}ms "
                  f"{m['ttft_p99'] * 1e3:7.0f}ms")
        one, two, pl = med["ray x1"], med["ray x2"], med["plain"]
        print(f"\nray x2 / ray x1: throughput x{two['tok_s'] / one['tok_s']:.2f} (goal >= 1.6), p99 TTFT "
              f"x{two['ttft_p99'] / one['ttft_p99']:.2f} at twice the load (goal <= 1)")
        print(f"ray x2 / plain:  throughput x{two['tok_s'] / pl['tok_s']:.2f}; ray x1 / plain: "
              f"x{one['tok_s'] / pl['tok_s']:.2f} (the Ray hops' CPU on a shared core)")
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        print("\nCPU per generated token (ms), all rounds: the plain server's process, Ray Serve's by role, this "
              "benchmark's own (its clients and Ray's driver)")
        roles = ["plain"] + list(ROLES) + ["ray other", "bench"]
        print(f"{'server':8} " + " ".join(f"{role:>10}" for role in roles))
        for name in servers:
            tokens = args.rounds * servers[name][1] * args.requests * args.gen
            print(f"{name:8} " + " ".join(f"{cpu[name][role] / tokens:10.2f}" for role in roles))
        x1 = {role: cpu["ray x1"][role] / (args.rounds * P * args.requests * args.gen) for role in roles}
        per_token = x1["replicas"] + x1["proxy"] + x1["ingress"] + x1["ray other"]
        print(f"2 replicas on 2 idle cores, from these costs: x{2 * x1['replicas'] / per_token:.2f} one replica's "
              "throughput (one replica has a core to itself, the hops and Ray's background on the other)")

        # Open loop: users who arrive independently, at a rate well below what one replica serves.
        rate = args.rate if args.rate is not None else 0.4 * one["tok_s"] / args.gen
        if rate > 0:
            print(f"\nopen loop: Poisson arrivals, ray x1 at {rate:.2f} requests/s ({args.open_requests} a round), "
                  f"ray x2 at {2 * rate:.2f} ({2 * args.open_requests}); time to first token from when a request "
                  "was due")
            orows = {"ray x1": [], "ray x2": []}
            for r in range(args.rounds):
                for name, k in (("ray x1", 1), ("ray x2", 2))[::1 if r % 2 == 0 else -1]:
                    res = open_loop(servers[name][0], k * rate, k * args.open_requests, body, f"o{r}", 100 * r + k)
                    orows[name].append(res)
                    print(f"  round {r + 1} {name:7} {k * rate:5.2f}/s {res['tok_s']:7.1f} tok/s  TTFT p50 "
                          f"{res['ttft_p50'] * 1e3:6.0f} ms  p90 {res['ttft_p90'] * 1e3:6.0f} ms  p99 "
                          f"{res['ttft_p99'] * 1e3:6.0f} ms", flush=True)
            omed = {name: {k: statistics.median(x[k] for x in v) for k in v[0]} for name, v in orows.items()}
            for name, k in (("ray x1", 1), ("ray x2", 2)):
                results.add(loop="open", server=name, rate=k * rate, **omed[name])
            o1, o2 = omed["ray x1"], omed["ray x2"]
            print(f"medians of {args.rounds} rounds: p99 TTFT ray x1 {o1['ttft_p99'] * 1e3:.0f} ms, ray x2 at twice the "
                  f"rate {o2['ttft_p99'] * 1e3:.0f} ms: x{o2['ttft_p99'] / o1['ttft_p99']:.2f} (goal <= 1); p50 "
                  f"x{o2['ttft_p50'] / o1['ttft_p50']:.2f}")

        # The hops at no load: time to first token of one client, one short request at a time.
        lone = {name: [] for name in ("plain", "ray x1")}
        for _ in range(3):
            for name in lone:
                lone[name].append(run_level(servers[name][0], 1, 4, dict(body, max_tokens=8), "lone")["ttft_p50"])
        a, b = statistics.median(lone["plain"]), statistics.median(lone["ray x1"])
        print(f"\n1 client: TTFT p50 plain {a * 1e3:.1f} ms, ray x1 {b * 1e3:.1f} ms: the proxy and ingress hops "
              f"add {(b - a) * 1e3:.1f} ms")
        results.add(loop="1 client", server="plain", clients=1, ttft_p50=a)
        results.add(loop="1 client", server="ray x1", clients=1, ttft_p50=b)
        a, b = (statistics.median(chat_ttft(servers[name][0], 4, body["logit_bias"]) for _ in range(3)) for name in ("plain", "ray x1"))
        print(f"1 client, chat streams: time to the first token p50 plain {a * 1e3:.1f} ms, ray x1 {b * 1e3:.1f} ms "
              f"(with {args.stream_interval_ms:g} ms stream pieces)")
        same, cached = affinity(servers["ray x2"][0])
        print(f"prefix affinity, 8 chats of 4 turns, 4 at a time, on ray x2: {same:.0%} of follow-up turns on the "
              f"replica of the turn before (random: 50%), {cached:.0%} of their prompt tokens from its cache")
        for chars, n in ((2000, 2), (8000, 16)):
            print(f"router: {router_cost(chars, n) * 1e6:.0f} us per request for a {chars}-character prompt and "
                  f"{n} replicas of full history")
        print("\n" + SIZING)
        results.write(args.json)
    finally:
        stop_server(plain)
        try:
            serve.shutdown()
        finally:
            rs.stop_cluster()
    return 0


if __name__ == "__main__":
    sys.exit(main())
