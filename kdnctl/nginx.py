"""nginx in front of ``kdnctl serve-files``: kdnctl decides, nginx sends the bytes (issue 15).

Objects are immutable files named by their hash, exactly what nginx serves best (sendfile,
ranges, keep-alive, thousands of connections). The standard hand-off is ``X-Accel-Redirect``:

* every request reaches kdnctl through nginx's ``proxy_pass``; kdnctl keeps authentication,
  namespaces, listings, lookups and the object -> owner check, exactly as without nginx;
* for an object the token may read, kdnctl answers with no body and the header
  ``X-Accel-Redirect: /_kdn_objects/ab/<sha>``; nginx then serves that file from an
  ``internal`` location aliased to the store's ``objects/`` directory (a client asking for the
  internal path directly gets 404: only an upstream response can reach it);
* a token that may not see the object gets kdnctl's 404 and nginx sends nothing else.

``kdnctl serve-files --emit-nginx-config FILE`` writes the configuration (a complete
``nginx.conf`` for ``nginx -c FILE``, or with ``--nginx-server-only`` just the ``server``
block to include in an existing ``http`` block) and serves with the hand-off enabled. The
config also works with the Debian package's defaults (workers run as ``www-data``: the
objects directory must be readable by that user).
"""

from __future__ import annotations

import os
from pathlib import Path

from .durable import write_atomic

ACCEL_PREFIX = "/_kdn_objects/"


def accel_path(sha: str, prefix: str = ACCEL_PREFIX) -> str:
    """The internal URI nginx maps onto ``objects/<sha[:2]>/<sha>``."""
    return f"{prefix}{sha[:2]}/{sha}"


def server_block(objects_dir: str | os.PathLike, upstream: str, listen: str, *,
                 prefix: str = ACCEL_PREFIX) -> str:
    """The ``server { ... }`` block: proxy to kdnctl, internal location over ``objects_dir``."""
    objects = str(Path(objects_dir).resolve())
    return f"""server {{
    listen {listen};
    server_name _;
    access_log off;
    # objects are sent by nginx itself (X-Accel-Redirect from kdnctl): zero-copy sendfile
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;

    location ~ "^{prefix}(?<kdn_fan>[0-9a-f]{{2}})/(?<kdn_sha>[0-9a-f]{{64}})$" {{
        internal;                     # reachable only through kdnctl's X-Accel-Redirect
        alias {objects}/$kdn_fan/$kdn_sha;
        # Cache-Control comes from kdnctl's response; nginx drops an upstream ETag on a
        # redirect, so the strong ETag (the object hash) is set here
        etag off;
        add_header ETag '"$kdn_sha"';
        default_type application/octet-stream;
    }}

    location {prefix} {{
        internal;
        return 404;
    }}

    location / {{
        proxy_pass http://{upstream};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_buffering on;
        client_max_body_size 8m;
    }}
}}
"""


def full_config(objects_dir: str | os.PathLike, upstream: str, listen: str, *, run_dir: str | os.PathLike,
                prefix: str = ACCEL_PREFIX, workers: int | str = "auto", user: str | None = None) -> str:
    """A complete ``nginx.conf`` (for ``nginx -p RUN_DIR -c FILE``) with pid, logs and temp
    files under ``run_dir``, upstream keep-alive to kdnctl, and :func:`server_block`."""
    run = Path(run_dir).resolve()
    user_line = f"user {user};\n" if user else ""
    return f"""{user_line}worker_processes {workers};
pid {run}/nginx.pid;
error_log {run}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    client_body_temp_path {run}/client_body;
    proxy_temp_path {run}/proxy;
    fastcgi_temp_path {run}/fastcgi;
    uwsgi_temp_path {run}/uwsgi;
    scgi_temp_path {run}/scgi;
    upstream kdnctl {{
        server {upstream};
        keepalive 64;
    }}
{_indent(server_block(objects_dir, "kdnctl", listen, prefix=prefix))}}}
"""


def _indent(text: str) -> str:
    return "".join("    " + line if line.strip() else line for line in text.splitlines(True))


def write_config(path: str | os.PathLike, store_root: str | os.PathLike, *, upstream: str, listen: str,
                 server_only: bool = False, user: str | None = None) -> Path:
    """Write the config for ``store_root`` to ``path`` (atomically); returns the path. The run
    directory of a full config is ``<path's folder>/nginx-run``."""
    path = Path(path)
    objects = Path(store_root) / "objects"
    if server_only:
        text = server_block(objects, upstream, listen)
    else:
        run = path.parent / "nginx-run"
        run.mkdir(parents=True, exist_ok=True)
        text = full_config(objects, upstream, listen, run_dir=run, user=user)
    write_atomic(path, [text.encode("utf-8")])
    return path
