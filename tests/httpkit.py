"""A real uvicorn server in a background thread, for tests that need HTTP on loopback."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from kdnctl.server import create_app, uvicorn_limits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    def __init__(self, root, tokens=None, limits=None, **kw):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(root, tokens, limits=limits, **kw), host="127.0.0.1", port=self.port,
                                log_level="warning", timeout_graceful_shutdown=2, **uvicorn_limits(limits))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
