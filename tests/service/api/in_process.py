"""The real app on a real uvicorn server in this process, over an engine the test built: for tests
that need to reach into the engine or the service's modules while real HTTP requests run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from service.engine.engine import InferenceEngine
from service.server import create_server
from service.settings import Settings
from tests.live_server import free_port
from tests.service.api.helpers import wait_for


@contextmanager
def serve_in_process(engine: InferenceEngine, settings: Settings) -> Iterator[httpx.Client]:
    """A client of `engine` served with `settings` on a free loopback port, once it is ready."""
    app = create_server(settings, engine)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_config=None, access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=60.0) as client:

            def ready() -> bool:
                try:
                    return client.get("/readyz").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(ready, "the in-process server")
            yield client
    finally:
        server.should_exit = True
        thread.join()
