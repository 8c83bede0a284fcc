"""The kdnctl Typer application: wires command modules together. No logic lives here."""

from __future__ import annotations

import typer

from . import (ask_cmd, compress_cmd, edit_cmd, eval_cmd, eval_compose_cmd, export_cmd, ingest_cmd, run_cmd,
               serve_cmd, store_cmds)
from .common import run_cli

app = typer.Typer(
    name="kdnctl",
    help="Precompute, compress, edit and publish LLM KV caches for a document corpus.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Every command module is imported explicitly: one that fails to import fails the CLI loudly.
COMMAND_MODULES = (ingest_cmd, ask_cmd, store_cmds, compress_cmd, eval_cmd, edit_cmd, serve_cmd, run_cmd,
                   eval_compose_cmd, export_cmd)
for module in COMMAND_MODULES:
    module.register(app)


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
