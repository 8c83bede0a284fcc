"""Recipes: a TOML file naming a pipeline's steps and their settings.

    name = "size-0.25"
    label = "b0.25"                      # optional: name of the final version
    [ingest]
    chunk_tokens = 256
    window = 32
    [compress]                           # kdnctl.compress.recipe.CompressRecipe's fields
    budget = 0.25                        # size cap: <= 0.25 x the fp16 K/V bytes
    quant = "auto"                       # auto (default): the method for the budget; uniform, floor, ladder, ec, int4, ...
    keep = 0.95                          # at most this token fraction kept
    protect = 64                         # the last 64 tokens (and the prompt header) never evicted, lifted first
    press = "kvcrush"                    # selects the kept tokens (`kdnctl methods`)
    scorer = "hybrid"                    # ranks the tokens
    allocator = "uniform"                # uniform | pyramid | adaptive: the kept share per layer
    [compress.press_options]             # the press's settings, e.g. KVCrush's ratio/anchor/page_size
    ratio = 0.25
    [compress.allocator_options]         # e.g. pyramid's beta
    [compress.options]                   # experimental settings (kdnctl.compress.options.OPTIONS)
    lift = "literals"

Recipes written before keep parsing: ``method`` is the press, a press's settings in
``[compress.options]`` go to it, and the options may stand in ``[compress]`` itself.
Every version made by a recipe stores the same step dicts in its ``recipe`` metadata
(``{"steps": [ingest, compress, ...]}``), so a version can be rebuilt from its metadata.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError, UsageError

KNOWN_SECTIONS = {"name", "label", "description", "ingest", "compress", "edit"}


@dataclass
class Recipe:
    name: str
    label: str | None = None
    ingest: dict = field(default_factory=dict)
    compress: dict | None = None
    edit: dict | None = None
    path: Path | None = None

    def ingest_options(self):
        from .ingest import IngestOptions

        allowed = {"chunk_tokens", "window", "stats", "block_tokens"}
        bad = set(self.ingest) - allowed
        if bad:
            raise UsageError(f"recipe {self.name}: unknown [ingest] keys {sorted(bad)}", hint=f"allowed: {sorted(allowed)}")
        return IngestOptions(**self.ingest)

    def compress_recipe(self):
        from .compress.document import CompressRecipe

        if self.compress is None:
            raise UsageError(f"recipe {self.name} has no [compress] step")
        return CompressRecipe.from_dict(self.compress)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"recipe {path} does not exist", hint="shipped recipes are in recipes/")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"recipe {path} is not valid TOML: {exc}") from None
    unknown = set(data) - KNOWN_SECTIONS
    if unknown:
        raise UsageError(f"recipe {path}: unknown sections {sorted(unknown)}", hint=f"known: {sorted(KNOWN_SECTIONS)}")
    return Recipe(name=data.get("name", path.stem), label=data.get("label"), ingest=data.get("ingest", {}),
                  compress=data.get("compress"), edit=data.get("edit"), path=path)
