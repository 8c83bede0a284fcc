"""`kdnctl serve-files` (publish a store read-only over HTTP) and `kdnctl pull` (mirror one)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import JsonOpt, StoreOpt, emit_json, message, open_store, store_root

TokenFileOpt = typer.Option(None, "--token-file", help="File holding the bearer token to send.")


def serve_files(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (0.0.0.0 = all)."),
    port: int = typer.Option(8700, "--port", help="TCP port."),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="Require bearer tokens: one `TOKEN namespace1,namespace2` per line, `*` = all."),
    max_body: int = typer.Option(4 << 20, "--max-body-bytes", help="Largest accepted request body (lookups)."),
    no_access_log: bool = typer.Option(False, "--no-access-log", help="Do not log every request to stderr."),
    emit_nginx_config: Optional[Path] = typer.Option(
        None, "--emit-nginx-config", help="Write an nginx config that fronts this server (nginx sends object bytes "
        "via X-Accel-Redirect, kdnctl keeps auth and namespaces) and serve with the hand-off on."),
    nginx_listen: str = typer.Option("8080", "--nginx-listen", help="Where the emitted nginx config listens."),
    nginx_server_only: bool = typer.Option(False, "--nginx-server-only", help="Emit only the `server` block."),
    nginx_user: Optional[str] = typer.Option(None, "--nginx-user", help="`user` directive of the emitted config "
                                             "(the account nginx workers read the objects as)."),
    x_accel: bool = typer.Option(False, "--x-accel", help="Answer object downloads with X-Accel-Redirect (behind nginx)."),
    signed_links: bool = typer.Option(False, "--signed-links", help="With --emit-nginx-config: version listings carry "
                                      "signed object links (fresh secret per start) that nginx checks and serves "
                                      "without asking kdnctl (needs nginx's secure_link module)."),
    link_ttl: int = typer.Option(600, "--link-ttl", help="Seconds a signed object link stays valid."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", help="Seconds a connection may take to send a "
                                         "complete request head (from connect, or after a response)."),
    body_timeout: float = typer.Option(30.0, "--body-timeout", help="Seconds to receive a request body (lookups)."),
    keep_alive: float = typer.Option(5.0, "--keep-alive", help="Seconds an idle keep-alive connection stays open."),
    max_connections: int = typer.Option(512, "--max-connections", help="Open connections at most; at the cap the "
                                        "longest-idle connection is closed. Keep it under `ulimit -n`."),
    store: Optional[Path] = StoreOpt,
) -> None:
    """Serve the store's bundles read-only over HTTP (see docs/serve-files.md)."""
    from ..errors import UsageError
    from ..server import Limits, serve

    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {port}")
    try:
        limits = Limits(header_timeout, body_timeout, keep_alive, max_connections)
    except UsageError as exc:  # the library speaks of values; name the flags here
        raise UsageError(exc.message.replace("header_timeout_s", "--header-timeout")
                         .replace("body_timeout_s", "--body-timeout").replace("keep_alive_s", "--keep-alive")
                         .replace("max_connections", "--max-connections")) from None
    root = store_root(store)
    open_store(store).close()  # fail fast, with the usual message, when there is no store
    auth = f"tokens from {token_file}" if token_file else "no authentication"
    accel = secret = None
    if signed_links and emit_nginx_config is None:
        raise UsageError("--signed-links needs --emit-nginx-config (nginx must hold the same secret)")
    if link_ttl < 1:
        raise UsageError(f"--link-ttl must be >= 1, got {link_ttl}")
    if emit_nginx_config is not None:
        from ..server.nginx import ACCEL_PREFIX, new_link_secret, write_config

        secret = new_link_secret() if signed_links else None
        path = write_config(emit_nginx_config, root, upstream=f"{host}:{port}", listen=nginx_listen,
                            server_only=nginx_server_only, user=nginx_user, link_secret=secret)
        message(f"wrote {path}: run `nginx -c {path.resolve()}`; clients use the nginx address ({nginx_listen})")
        accel = ACCEL_PREFIX
    elif x_accel:
        from ..server.nginx import ACCEL_PREFIX

        accel = ACCEL_PREFIX
    message(f"serving {root} read-only on http://{host}:{port} ({auth}{', X-Accel-Redirect' if accel else ''}); Ctrl-C stops")
    serve(root, host, port, token_file, max_body_bytes=max_body, access_log=not no_access_log, limits=limits,
          accel_prefix=accel, link_secret=secret, link_ttl_s=link_ttl)


def pull(
    url: str = typer.Argument(..., help="A `kdnctl serve-files` URL, e.g. http://10.0.0.5:8700."),
    docs: Optional[List[str]] = typer.Argument(None, help="Document ids (default: every document the token sees)."),
    label: Optional[str] = typer.Option(None, "--label", help="Only this version label (default: all labels)."),
    token_file: Optional[Path] = TokenFileOpt,
    store: Optional[Path] = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Mirror documents' bundles from a remote store into the local store (verified)."""
    from ..store.client import RemoteStore, mirror

    token = _read_token(token_file)
    st = open_store(store, create=True)
    try:
        with RemoteStore(url, token=token) as remote:
            report = mirror(remote, st, docs or None, label,
                            on_doc=None if as_json else lambda d, s: message(f"{s} {d}"))
    finally:
        st.close()
    if as_json:
        emit_json(report)
        return
    message(f"pulled {len(report['pulled'])} document(s), {len(report['unchanged'])} unchanged, "
            f"{len(report['skipped'])} skipped; {report['objects']} object(s), {report['bytes'] / 1e6:.1f} MB")


def _read_token(path: Optional[Path]) -> Optional[str]:
    if path is None:
        return None
    from ..errors import InputError

    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read token file {path}: {exc}") from None
    if not token or len(token.split()) != 1:
        raise InputError(f"token file {path} must hold exactly one token")
    return token


def register(app: typer.Typer) -> None:
    app.command("serve-files")(serve_files)
    app.command("pull")(pull)
