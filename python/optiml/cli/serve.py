"""optiml serve: the OpenAI-compatible HTTP server with continuous batching (optiml.server)."""

from __future__ import annotations

from .._core import ArgumentError
from ..server import serve, serve_ray
from . import common


def add_arguments(p) -> None:
    p.add_argument("-m", "--model", required=True, help=common.MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080,
                   help="port to listen on (default: 8080; 0: any free port, the one taken is announced)")
    p.add_argument("--parallel", "-np", type=int, default=4,
                   help="sequences generated at once (KV slots; default: 4)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context per slot in tokens (default: the model's, at most 4096)")
    # llama-server's -c is the total shared by its slots; --ctx here is per slot. Both are taken, one at a time.
    p.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="llama-server's meaning: the context of all slots together, each slot getting N // "
                        "--parallel (0: the default, as without it); give this or --ctx, not both")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the API (all but /, /health and /metrics)")
    p.add_argument("-t", "--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("--queue", type=int, default=64,
                   help="sequences that may wait for a slot before 429 (default: 64; 0: none wait)")
    p.add_argument("--chunk", type=int, default=256,
                   help="most prompt tokens run per step, across requests (default: 256)")
    p.add_argument("--alias", default=None, help="model id clients use (default: the file name)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="a web page origin (https://app.example.com) allowed to call the API from a browser; "
                        "repeat for more, '*' for any (default: pages served from this machine only)")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="extra variables for the chat template in every request, as a JSON object (llama-server's; "
                        "Qwen3: '{\"enable_thinking\": false}'); a request's own chat_template_kwargs win")
    p.add_argument("--pooling", choices=("mean", "cls", "last"), default=None,
                   help="how /v1/embeddings pools a text's token states (llama-server's; default: the file's "
                        "pooling_type, else mean)")
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


def check(args) -> int | None:
    """The settings' bounds, checked before anything loads (ArgumentError: one line, exit status 2); returns
    the context per slot (None: the model's default)."""
    # (without these checks a port past 65535 was taken modulo 65536 and announced as given, and a negative
    # one failed after the model loaded)
    if not 0 <= args.port <= 65535:
        raise ArgumentError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    if args.ray and args.port == 0:
        raise ArgumentError("--port 0 (any free port) is not supported with --ray: give a port")
    if args.parallel < 1:
        raise ArgumentError(f"--parallel must be at least 1, got {args.parallel}")
    if args.queue < 0:
        raise ArgumentError(f"--queue must be at least 0, got {args.queue}")
    if args.chunk < 1:
        raise ArgumentError(f"--chunk must be at least 1, got {args.chunk}")
    if args.ctx is not None and args.ctx < 1:
        raise ArgumentError(f"--ctx must be at least 1, got {args.ctx}")
    if args.ctx_size is not None and args.ctx_size < 0:
        raise ArgumentError(f"-c/--ctx-size must be at least 0, got {args.ctx_size}")
    if args.ctx_size is None or args.ctx_size == 0:  # (llama-server's -c 0: the model's own context)
        return args.ctx
    if args.ctx is not None:
        raise ArgumentError("give -c/--ctx-size (all slots together, as llama-server's) or --ctx (per slot), not both")
    per_slot = args.ctx_size // args.parallel
    if per_slot < 1:
        raise ArgumentError(f"-c/--ctx-size {args.ctx_size} is shared by --parallel {args.parallel} slots: less "
                            f"than one token each; give at least {args.parallel}")
    return per_slot


def run(args) -> int:
    n_ctx = check(args)
    kw = dict(host=args.host, port=args.port, n_parallel=args.parallel, n_ctx=n_ctx, api_key=args.api_key,
              n_threads=args.threads, max_queue=args.queue, chunk=args.chunk, model_id=args.alias,
              predictors=common.predictors(args), kv_vram=args.kv_vram, max_itl_ms=args.max_itl_ms,
              use_mmap=common.use_mmap(args), cors_origins=args.cors_origin,
              chat_template_kwargs=common.template_variables(args.chat_template_kwargs) or None, pooling=args.pooling,
              **common.device(args))
    if args.quiet:  # (-q: the access log and uvicorn's lines go; warnings and errors stay)
        kw["log_level"] = "warning"
    ray_only = [f for f, v in (("--replicas", args.replicas != 1), ("--min-replicas", args.min_replicas),
                               ("--max-replicas", args.max_replicas), ("--address", args.address),
                               ("--stream-interval-ms", args.stream_interval_ms != 100)) if v]
    if not args.ray:
        if ray_only:
            raise ArgumentError(f"{', '.join(ray_only)} need --ray")
        serve(common.model_arg(args.model), **kw)
        return 0
    # the model is resolved on each replica's node (a name or Hugging Face reference there too)
    serve_ray(args.model, replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
              address=args.address, stream_interval_ms=args.stream_interval_ms, **kw)
    return 0
