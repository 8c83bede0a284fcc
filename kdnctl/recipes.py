"""Recipes: a TOML file naming a pipeline's steps and their settings.

    name = "size-0.25"
    label = "int4-b0.25-p64-sentences"   # optional: label of the final version
    [ingest]
    chunk_tokens = 256
    window = 32
    [compress]
    budget = 0.25                        # size cap: <= 0.25 x the fp16 K/V bytes
    quant = "floor"                      # "auto" (default), "uniform": best single tier, "floor": + upgrades, "ladder", "fp16"
    keep = 0.95                          # with a budget: at most this token fraction (the floor's upgrades use the rest)
    protect = 64                         # with a budget: the last 64 tokens (and the header) never evicted, lifted first
    method = "kvcrush"                   # picks the evicted tokens
    scorer = "hybrid"
    group_size = 32
    allocator = "uniform"                # optional: uniform | pyramid | adaptive (kdnctl.allocate)
    [compress.options]                   # method options, e.g. KVCrush's ratio/anchor/page_size
    ratio = 0.25
    [compress.allocator_options]         # optional, e.g. pyramid's beta

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
        from .compress import CompressRecipe

        if self.compress is None:
            raise UsageError(f"recipe {self.name} has no [compress] step")
        c = dict(self.compress)
        options = c.pop("options", {})
        allowed = {"method", "budget", "keep", "scorer", "quant", "group_size", "seed", "allocator", "allocator_options",
                   "protect", "coding", "lift", "key_weight", "layers", "backfill", "backfill_shift", "backfill_key_shift",
                   "key_basis", "refit", "refit_hold", "refit_decoded", "refit_feedback",
                   "protect_level", "tail_reads",
                   "lift_share", "lift_level", "lift_role"}
        bad = set(c) - allowed
        if bad:
            raise UsageError(f"recipe {self.name}: unknown [compress] keys {sorted(bad)}", hint=f"allowed: {sorted(allowed)}")
        if "keep" in c and "budget" not in c:
            c["budget"] = None  # pure token eviction
        return CompressRecipe(**c, method_options=options)


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
