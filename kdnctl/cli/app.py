"""The kdnctl Typer application: wires command modules together. No logic lives here."""

from __future__ import annotations

import typer

from . import ask_cmd, ingest_cmd, store_cmds
from .common import run_cli

app = typer.Typer(
    name="kdnctl",
    help="Precompute, compress, edit and publish LLM KV caches for a document corpus.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for module in (ingest_cmd, ask_cmd, store_cmds):
    module.register(app)

for optional in ("compress_cmd", "eval_cmd", "edit_cmd", "serve_cmd", "run_cmd", "compose_cmd", "export_cmd"):
    try:
        module = __import__(f"kdnctl.cli.{optional}", fromlist=["register"])
    except ModuleNotFoundError as exc:  # a command module not written yet must not break the rest
        if exc.name != f"kdnctl.cli.{optional}":
            raise
        continue
    module.register(app)


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
