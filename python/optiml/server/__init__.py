"""optiml serve: an OpenAI-compatible HTTP server with continuous batching (pip install "optiml[serve]").

    from optiml.server import Server, create_app
    app = create_app(Server(optiml.Model(path, n_ctx=4096, n_seq=4), n_parallel=4))   # an ASGI app

Modules: app (routes); pipeline (the thread that owns the Model) with its parts: scheduler (what runs
next, no model), runner (steps the model), output (each token's native output stage, the events), offload
(when attention goes to the CPU); schemas (request checks, errors), structured (response_format through
llguidance), metrics (Prometheus), ray_serve (replicas on Ray Serve, pip install "optiml[ray]"; imported
only by serve_ray).
"""

from __future__ import annotations

import sys

from ..engine.chat_template import ChatTemplateError
from ..engine.model import Model
from ..engine.sparsity import describe

__all__ = ["Server", "create_app", "serve", "serve_ray"]


def __getattr__(name):
    if name in ("Server", "create_app"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)


def check_server_packages() -> None:
    """SystemExit naming the serve extra when any package the server imports is missing (a partial install:
    uvicorn alone, say), before a model is fetched or loaded."""
    import importlib.util

    missing = [m for m in ("uvicorn", "anyio", "starlette", "sse_starlette", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"optiml serve needs the server packages ({', '.join(missing)} missing): "
                         'pip install "optiml[serve]" (in a checkout: pip install ".[serve]")')


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8080, n_parallel: int = 4, n_ctx: int | None = None,
          api_key: str | None = None, n_threads: int | None = None, max_queue: int = 64, chunk: int = 256,
          model_id: str | None = None, log_level: str = "info", predictors="auto", device: str = "auto", vram=None,
          n_gpu_layers: int | None = None, gpu_neurons=None, kv_vram=None, max_itl_ms: float | None = None,
          use_mmap="auto", kv_type_k=None, kv_type_v=None, n_cpu_moe=None, cors_origins=None,
          chat_template_kwargs=None, pooling=None) -> None:
    """Loads the model with one KV slot of n_ctx positions per parallel sequence and serves until stopped (the
    port answers 503 "Loading model" meanwhile, as llama-server's does).
    predictors, device, vram, n_gpu_layers, gpu_neurons, kv_vram, use_mmap, kv_type_k, kv_type_v, n_cpu_moe: as
    optiml.Model's. With kv_vram holding
    fewer sequences than n_parallel, the others' attention runs on the CPU when the offload policy finds
    it pays (server/offload.py), within max_itl_ms per step when given. cors_origins: the web pages' origins
    that may call the API from a browser (["*"]: any; None: pages served from this machine). chat_template_kwargs:
    the chat template's extra variables for every request (a request's own chat_template_kwargs win). pooling:
    /v1/embeddings' (mean, cls, last; default the file's pooling_type, else mean)."""
    check_server_packages()
    import uvicorn

    from .app import Server, create_app
    from .loading import LoadingGate

    def load():
        model = Model(model_path, n_ctx=n_ctx, n_threads=n_threads, n_seq=n_parallel, predictors=predictors,
                      device=device, vram=vram, n_gpu_layers=n_gpu_layers, gpu_neurons=gpu_neurons, kv_vram=kv_vram,
                      use_mmap=use_mmap, kv_type_k=kv_type_k, kv_type_v=kv_type_v, n_cpu_moe=n_cpu_moe)
        server = Server(model, n_parallel=n_parallel, api_key=api_key, model_id=model_id, max_queue=max_queue,
                        chunk=chunk, max_itl_ms=max_itl_ms, cors_origins=cors_origins,
                        chat_template_kwargs=chat_template_kwargs, pooling=pooling)
        offload = (f"; KV of {model.plan.n_seq_device} on the device, the rest's attention on the CPU when it pays"
                   if model.plan.n_seq_device < n_parallel else "")
        print(f"optiml serve: {server.model_id}: {n_parallel} slots of {model.n_ctx} tokens, queue {max_queue}"
              f"{offload}; FFN: {describe(model.sparsity, model.predictors, model.sparsity_note)}", flush=True)
        try:
            model.chat_template  # compiled now: a broken one is reported before the first request
        except ChatTemplateError as e:
            print(f"optiml serve: warning: {e}. /v1/chat/completions answers 500 (code chat_template_error); "
                  "/v1/completions works", flush=True)
        uv.model_id = server.model_id
        return create_app(server)

    class Announcing(uvicorn.Server):
        # The port is bound first and answers 503 while the model loads (loading.py); the address is announced
        # once the model answers there. A port in use loads nothing (uvicorn's own error line, exit status 3).
        model_id = None

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                gate.begin()

        def announce(self):
            # port 0: the system chose one, which clients need to hear (the first socket's, where a host name
            # bound more than one)
            bound = self.servers[0].sockets[0].getsockname()[1] if port == 0 and self.servers else port
            url = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
            print(f"optiml serve: {self.model_id} on {url}/v1; chat page at {url}/", flush=True)

    gate = LoadingGate(load, stopping=lambda: uv.should_exit)
    uv = Announcing(uvicorn.Config(gate, host=host, port=port, log_level=log_level))
    gate.on_ready = uv.announce
    gate.on_error = lambda: setattr(uv, "should_exit", True)
    uv.run()
    if gate.error is not None:  # the model did not load: its error, as before the port was bound
        raise gate.error
    if not uv.started:  # as uvicorn.run ends when the server did not start
        sys.exit(3)


def serve_ray(model: str, **kwargs) -> None:
    """optiml serve --ray: serve's arguments plus replicas, address, min_replicas, max_replicas,
    stream_interval_ms (optiml.server.ray_serve.serve_ray). Without Ray installed: SystemExit saying what
    to install."""
    try:
        from .ray_serve import serve_ray as run
    except ImportError as e:
        raise SystemExit(str(e)) from None
    run(model, **kwargs)
