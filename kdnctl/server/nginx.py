"""nginx in front of ``kdnctl serve-files``: kdnctl decides, nginx sends the bytes.

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

import base64
import hashlib
import os
import secrets
from pathlib import Path

from ..store.durable import write_atomic

ACCEL_PREFIX = "/_kdn_objects/"


def link_query(sha: str, secret: str, expires: int) -> str:
    """The query string of a signed object link (nginx ``secure_link``): ``e=EXPIRES&s=SIG``,
    SIG = base64url(MD5("<expires>/v1/objects/<sha> <secret>")), the form nginx's
    ``secure_link_md5 "$secure_link_expires$uri <secret>"`` checks."""
    digest = hashlib.md5(f"{expires}/v1/objects/{sha} {secret}".encode()).digest()
    return f"e={expires}&s={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()}"


def new_link_secret() -> str:
    return secrets.token_urlsafe(32)  # URL-safe: no quote or space to escape in the config


def accel_path(sha: str, prefix: str = ACCEL_PREFIX) -> str:
    """The internal URI nginx maps onto ``objects/<sha[:2]>/<sha>``."""
    return f"{prefix}{sha[:2]}/{sha}"


def _signed_location(objects: str, secret: str) -> str:
    """Object requests carrying a signed link (``?e=..&s=..``, issued by kdnctl in the version
    listings it answers to an authorised token) are checked and sent by nginx alone; any other
    object request goes to kdnctl (named location) exactly as before."""
    return f"""
    location ~ "^/v1/objects/(?<kdn_sfan>[0-9a-f]{{2}})(?<kdn_srest>[0-9a-f]{{62}})$" {{
        access_log off;               # a signed link is a capability: kept out of the logs
        error_page 418 = @kdnctl;
        if ($arg_s = "") {{ return 418; }}  # no link: kdnctl decides (X-Accel-Redirect)
        secure_link $arg_s,$arg_e;
        secure_link_md5 "$secure_link_expires$uri {secret}";
        if ($secure_link = "") {{ return 403; }}   # forged, or another object's link
        if ($secure_link = "0") {{ return 410; }}  # expired: ask kdnctl for a fresh listing
        alias {objects}/$kdn_sfan/$kdn_sfan$kdn_srest;
        etag off;
        add_header ETag '"$kdn_sfan$kdn_srest"';
        add_header Cache-Control "private, max-age=31536000, immutable";
        default_type application/octet-stream;
    }}
"""


def server_block(objects_dir: str | os.PathLike, upstream: str, listen: str, *,
                 prefix: str = ACCEL_PREFIX, link_secret: str | None = None) -> str:
    """The ``server { ... }`` block: proxy to kdnctl, internal location over ``objects_dir``;
    with ``link_secret``, also the signed-link location (nginx's secure_link module)."""
    objects = str(Path(objects_dir).resolve())
    signed = _signed_location(objects, link_secret) if link_secret else ""
    proxy = f"""proxy_pass http://{upstream};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_buffering on;
        client_max_body_size 8m;"""
    named = f"""
    location @kdnctl {{
        {proxy}
    }}
""" if link_secret else ""
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
        {proxy}
    }}
{signed}{named}}}
"""


def full_config(objects_dir: str | os.PathLike, upstream: str, listen: str, *, run_dir: str | os.PathLike,
                prefix: str = ACCEL_PREFIX, workers: int | str = "auto", user: str | None = None,
                link_secret: str | None = None) -> str:
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
{_indent(server_block(objects_dir, "kdnctl", listen, prefix=prefix, link_secret=link_secret))}}}
"""


def _indent(text: str) -> str:
    return "".join("    " + line if line.strip() else line for line in text.splitlines(True))


def write_config(path: str | os.PathLike, store_root: str | os.PathLike, *, upstream: str, listen: str,
                 server_only: bool = False, user: str | None = None, link_secret: str | None = None) -> Path:
    """Write the config for ``store_root`` to ``path`` (atomically; mode 0600 when it holds a
    link secret); returns the path. The run directory of a full config is
    ``<path's folder>/nginx-run``."""
    path = Path(path)
    objects = Path(store_root) / "objects"
    if server_only:
        text = server_block(objects, upstream, listen, link_secret=link_secret)
    else:
        run = path.parent / "nginx-run"
        run.mkdir(parents=True, exist_ok=True)
        text = full_config(objects, upstream, listen, run_dir=run, user=user, link_secret=link_secret)
    # the config holds the link secret: readable by its owner only
    write_atomic(path, [text.encode("utf-8")], mode=0o600 if link_secret else 0o644)
    return path
