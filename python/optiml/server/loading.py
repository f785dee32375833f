"""optiml serve's port while the model loads: it listens from the start and answers every request as
llama-server does meanwhile (503, "Loading model", Retry-After), so that health checks and clients see a server
that is coming up rather than a refused connection; then the app built by the load answers. A load that fails
stops the server, and serve() raises its error. A server told to stop while it loads stops at once (the load's
thread is left to the process's exit) and never announces itself."""

from __future__ import annotations

import asyncio
import threading

from starlette.responses import JSONResponse

from .schemas import APIError


class LoadingGate:
    """An ASGI app standing in for the one load() returns (load runs in a thread, begun by begin() once the port
    is bound). on_ready and on_error are called on the event loop when the load ends; stopping() says whether the
    server has been told to stop."""

    def __init__(self, load, stopping=lambda: False):
        self._load = load
        self._stopping = stopping
        self._task = None
        self._lifespan = None  # the loaded app's own lifespan, entered once it is loaded
        self.app = None
        self.error: BaseException | None = None
        self.on_ready = None
        self.on_error = None

    def begin(self) -> None:
        loop = asyncio.get_running_loop()

        def run():  # (a daemon thread: a load that cannot be interrupted does not hold the process's exit)
            try:
                app, error = self._load(), None
            except BaseException as e:  # (reported by serve(), after the server stops)
                app, error = None, e
            try:
                loop.call_soon_threadsafe(self._loaded, app, error)
            except RuntimeError:  # the loop is closed: the server stopped while it loaded
                pass

        threading.Thread(target=run, name="optiml-load", daemon=True).start()

    def _loaded(self, app, error) -> None:
        self._task = asyncio.ensure_future(self._start(app, error))

    async def _start(self, app, error) -> None:
        if error is not None:
            self.error = error
            if self.on_error:
                self.on_error()
            return
        if self._stopping():  # told to stop while it loaded: nothing to start or announce
            return
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        self._lifespan, self.app = lifespan, app
        if self.on_ready:
            self.on_ready()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan_messages(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        e = APIError(503, "Loading model", type="unavailable_error", code="loading_model", headers={"Retry-After": "1"})
        await JSONResponse(e.body(), status_code=503, headers=e.headers)(scope, receive, send)

    async def _lifespan_messages(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._task is not None:
                    await self._task  # (an app being started: started, then stopped)
                if self._lifespan is not None:
                    await self._lifespan.__aexit__(None, None, None)
                await send({"type": "lifespan.shutdown.complete"})
                return
