"""`kdnctl serve-files`: a read-only HTTP server that lets engines pull bundles from a store.

- app.py     the ASGI app and its endpoints (namespaces filtered before lookups)
- auth.py    token file, grants, Access
- http.py    error bodies, raw path segments, ranges, file streaming
- limits.py  header/body/keep-alive timeouts and the connection cap (uvicorn h11, guarded)
- run.py     serve(): uvicorn with the limits, logs on stderr
"""

from .app import MAX_BODY_BYTES, create_app, find_chunk
from .auth import Access, authorize, load_tokens
from .http import parse_range
from .limits import Limits, guarded_protocol, uvicorn_limits
from .run import serve

__all__ = ["MAX_BODY_BYTES", "Access", "Limits", "authorize", "create_app", "find_chunk", "guarded_protocol",
           "load_tokens", "parse_range", "serve", "uvicorn_limits"]
