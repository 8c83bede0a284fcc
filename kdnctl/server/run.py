"""Running serve-files under uvicorn: logging on stderr, limits, a clean exit on SIGINT/SIGTERM."""

from __future__ import annotations

import os
import sys

from .app import MAX_BODY_BYTES, create_app
from .auth import load_tokens
from .limits import Limits, uvicorn_limits


def _log_config(level: str) -> dict:
    # uvicorn's default sends the access log to stdout; keep stdout clean, everything on stderr.
    fmt = "%(asctime)s %(levelname)s %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": fmt}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        },
    }


def serve(store_root: str | os.PathLike, host: str = "127.0.0.1", port: int = 8700,
          token_file: str | os.PathLike | None = None, *, max_body_bytes: int = MAX_BODY_BYTES,
          access_log: bool = True, log_level: str = "info", graceful_timeout_s: float = 10.0,
          limits: Limits | None = None, accel_prefix: str | None = None, link_secret: str | None = None,
          link_ttl_s: int | None = None) -> None:
    """Run the server until SIGINT/SIGTERM; in-flight requests get ``graceful_timeout_s`` to finish."""
    import uvicorn

    limits = limits or Limits()
    tokens = load_tokens(token_file) if token_file else None
    extra = {"link_ttl_s": link_ttl_s} if link_ttl_s else {}
    app = create_app(store_root, tokens, max_body_bytes=max_body_bytes, limits=limits, accel_prefix=accel_prefix,
                     link_secret=link_secret, **extra)
    if tokens is None and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving {store_root} on {host} without --token-file: anyone who can reach it can read it",
              file=sys.stderr)
    config = uvicorn.Config(app, host=host, port=port, log_config=_log_config(log_level), access_log=access_log,
                            timeout_graceful_shutdown=graceful_timeout_s, server_header=False,
                            **uvicorn_limits(limits))
    _server_class()(config).run()


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # SIGINT/SIGTERM is how a server is meant to stop: after the graceful shutdown exit 0
            # instead of letting uvicorn re-raise the signal (the CLI would report "interrupted").
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return Server
