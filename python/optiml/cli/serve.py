"""optiml serve: the OpenAI-compatible HTTP server with continuous batching (optiml.server)."""

from __future__ import annotations

from ..server import serve, serve_ray
from . import common


def add_arguments(p) -> None:
    p.add_argument("-m", "--model", required=True, help=common.MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", "-np", type=int, default=4, help="sequences generated at once (KV slots)")
    p.add_argument("--ctx", type=int, default=None, help="context per slot (default: the model's, at most 4096)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("-t", "--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("--queue", type=int, default=64, help="sequences that may wait for a slot before 429")
    p.add_argument("--chunk", type=int, default=256, help="most prompt tokens run per step (across requests)")
    p.add_argument("--alias", default=None, help="model id clients use (default: the file name)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="a web page origin (https://app.example.com) allowed to call the API from a browser; "
                        "repeat for more, '*' for any (default: pages served from this machine only)")
    p.add_argument("--predictors", default="auto", help=common.PREDICTORS_HELP)
    common.add_device_args(p)
    p.add_argument("--kv-vram", default=None,
                   help="device memory for the KV cache (a size: 2GiB); with less than --parallel sequences need, "
                        "the others keep their KV cache in host memory and their attention runs on the CPU while "
                        "the device runs the linear layers (CPU attention offload), when the measured costs say "
                        "it raises throughput")
    p.add_argument("--max-itl-ms", type=float, default=None,
                   help="with --kv-vram: start a sequence on the CPU only while a step stays within this many "
                        "milliseconds")
    p.add_argument("--ray", action="store_true",
                   help="serve as replicas on Ray Serve behind one endpoint (pip install \"optiml[ray]\"): a local "
                        "cluster started and stopped with the server, or the one at --address")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: how many replicas (each its own engine)")
    p.add_argument("--min-replicas", type=int, default=None, help="with --ray: autoscaling's lower bound")
    p.add_argument("--max-replicas", type=int, default=None, help="with --ray: autoscaling's upper bound")
    p.add_argument("--address", default=None, help="with --ray: a running cluster (ray://head:10001, head:6379, auto)")
    p.add_argument("--stream-interval-ms", type=float, default=100,
                   help="with --ray: send a stream's pieces at most this often (0: every token; each costs the proxy)")


def run(args) -> int:
    kw = dict(host=args.host, port=args.port, n_parallel=args.parallel, n_ctx=args.ctx, api_key=args.api_key,
              n_threads=args.threads, max_queue=args.queue, chunk=args.chunk, model_id=args.alias,
              predictors=common.predictors(args), kv_vram=args.kv_vram, max_itl_ms=args.max_itl_ms,
              use_mmap=common.use_mmap(args), cors_origins=args.cors_origin, **common.device(args))
    if args.quiet:  # (-q: the access log and uvicorn's lines go; warnings and errors stay)
        kw["log_level"] = "warning"
    ray_only = [f for f, v in (("--replicas", args.replicas != 1), ("--min-replicas", args.min_replicas),
                               ("--max-replicas", args.max_replicas), ("--address", args.address),
                               ("--stream-interval-ms", args.stream_interval_ms != 100)) if v]
    if not args.ray:
        if ray_only:
            raise SystemExit(f"optiml serve: {', '.join(ray_only)} need --ray")
        serve(common.model_arg(args.model), **kw)
        return 0
    # the model is resolved on each replica's node (a name or Hugging Face reference there too)
    serve_ray(args.model, replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
              address=args.address, stream_interval_ms=args.stream_interval_ms, **kw)
    return 0
