"""Shared CLI plumbing: output streams, progress bars, store/model options, error mapping."""

from __future__ import annotations

import errno
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import typer

from ..errors import KdnError

StoreOpt = typer.Option(None, "--store", envvar="KDN_STORE", help="Store directory (default ./.kdn).")
ModelOpt = typer.Option(None, "--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct).")
JsonOpt = typer.Option(False, "--json", help="Print machine-readable JSON on stdout.")
RayOpt = typer.Option(None, "--ray", help="Run on a Ray cluster: its address (e.g. 10.0.0.5:6379, or auto), or "
                      "`local` to start one here (needs `pip install 'kdnctl\\[ray]'`; see docs/scale-out.md).")
WorkersOpt = typer.Option(None, "--workers", help="With --ray: model-holding workers (default: one per GPU, or 1).")
BatchOpt = typer.Option(16, "--batch", help="With --ray: commit the catalog every N finished documents (or every "
                        "5 s); a driver crash loses at most the uncommitted batch.")

# Library parameter (KdnError.param) -> the command-line flag that sets it.
FLAGS: dict[str, str] = {
    "alpha": "--alpha", "budget": "--budget", "chunk_tokens": "--chunk-tokens", "chunks": "--chunks",
    "heads": "--heads", "label": "--label", "model": "--model", "recompute": "--recompute",
    "retrieve": "--retrieve", "scorer": "--scorer", "source": "--from", "steer": "--steer",
    "allocator": "--option allocator", "method": "--press", "press": "--press", "quant": "--quant", "corpus": "--corpus",
    "protect": "--option protect", "option": "--option",
    "keep": "--keep", "window": "--window", "doc_id": "DOC",
}


def store_root(store: Optional[Path]) -> Path:
    if store is not None:
        return Path(store)
    from ..store import default_store_root

    return default_store_root()


def open_store(store: Optional[Path], *, create: bool = False):
    from ..store import Store

    return Store(store_root(store), create=create)


def check_name(kind: str, value: Optional[str], flag: str, hint: Optional[str] = None) -> None:
    """Validate a doc id / label before any work (no orphan objects, no wasted prefill)."""
    if value is None:
        return
    from ..errors import UsageError
    from ..store.records import id_problem

    problem = id_problem(kind, value)
    if problem:
        raise UsageError(f"{flag}: {problem}", hint=hint)


def load_lm(model: Optional[str], dtype: Optional[str] = None, device: Optional[str] = None,
            compresses: bool = False):
    """The model; with ``compresses`` the compress kernels load (or compile, where
    ``scripts/install.sh`` did not) on a thread meanwhile."""
    from ..models.load import load_model

    if compresses:
        import threading

        from ..kernels.ec.deflate_size import warm

        threading.Thread(target=warm, daemon=True).start()
    with status("loading model"):
        return load_model(model, dtype=dtype, device=device)


def message(text: str) -> None:
    """Human messages go to stderr so stdout stays data."""
    print(text, file=sys.stderr)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def interactive() -> bool:
    return sys.stderr.isatty() and os.environ.get("CI") != "true"


@contextmanager
def status(text: str):
    if interactive():
        from rich.console import Console

        with Console(stderr=True).status(text):
            yield
    else:
        yield


def progress_bar(total: int, desc: str, unit: str = "tok"):
    """A tqdm bar on a terminal; elsewhere (a log, CI, a pipe) plain lines on stderr: one per
    document (``unit="doc"``), one per quarter of ``total`` for other steps, none for tokens
    (the commands that count tokens say when each document is done: ``doc_done``)."""
    if not interactive():
        return LineProgress(total, desc, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr)


def doc_done(desc: str):
    """``on_doc`` for the library's ingest where no terminal shows a bar: a line per document."""
    if interactive():
        return None
    return lambda doc_id, status: message(f"{desc}: {doc_id} {status}")


class LineProgress:
    """``progress_bar`` where no terminal shows a bar: a line when a step (a document, a quarter) ends."""

    def __init__(self, total: int, desc: str, unit: str) -> None:
        self.total, self.desc, self.unit, self.n, self.postfix = total, desc, unit, 0, ""
        self.step = 1 if unit == "doc" else float("inf") if unit == "tok" else max(total / 4, 1)
        self.next = self.step

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.next and self.total:
            while self.next <= self.n:
                self.next += self.step
            extra = f", {self.postfix}" if self.postfix else ""
            sys.stderr.write(f"{self.desc}: {min(self.n, self.total)}/{self.total} {self.unit}{extra}\n")
            sys.stderr.flush()

    def close(self) -> None:
        return None


def _discard_new_stores() -> None:
    from ..store.created import discard_unused_new_stores

    try:
        discard_unused_new_stores()
    except OSError:
        pass


def run_cli(app: typer.Typer, args: list[str] | None = None) -> None:
    """Entry point: one place maps domain errors to a one-line message and an exit code.
    ``args`` defaults to the process's command line."""
    debug = os.environ.get("KDNCTL_DEBUG") == "1"
    from ..store.created import forget_new_stores

    forget_new_stores()  # only stores this command creates count
    try:
        try:
            app(args=args, standalone_mode=False)
        except BaseException as exc:
            if not (type(exc).__name__ == "Exit" and getattr(exc, "exit_code", 1) == 0):
                _discard_new_stores()  # a command that failed before writing leaves no new store behind
            raise
    except KdnError as exc:
        if debug:
            raise
        message(exc.one_line(FLAGS.get(exc.param or "")))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        message("error: interrupted")
        sys.exit(130)
    except (typer.Abort,):
        sys.exit(1)
    except Exception as exc:  # click usage errors and anything unexpected
        # Typer may use its own copy of click, so usage errors are recognised by shape.
        if type(exc).__name__ == "Exit" and hasattr(exc, "exit_code"):
            sys.exit(exc.exit_code)
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            message(f"error: {exc.format_message()} (hint: see --help)")
            sys.exit(2)
        if debug:
            raise
        if isinstance(exc, OSError) and exc.errno == errno.EROFS:
            message(f"error: {exc.filename or 'the target'} is on a read-only file system (hint: write to a writable "
                    "copy or another path)")
            sys.exit(7)
        message(f"error: unexpected {type(exc).__name__}: {exc} (hint: rerun with KDNCTL_DEBUG=1 for a traceback)")
        sys.exit(1)
