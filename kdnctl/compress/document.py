"""``kdnctl compress``: a stored version -> a size-budgeted, pruned and/or quantized new version.

Two budgets. ``budget`` (size, the default 0.25): the stored bytes of each document are at most
``budget`` x its fp16 K/V size, everything included; precision fills it (``kdnctl.compress.sizing``'s
tiers, evicting only what the cap forces, or ``quant="ec"``: ``kdnctl.compress.stages``).
``keep`` (token eviction, the meaning ``budget`` had before): the fraction of tokens kept per
layer and KV head.

Per document: load the source chunks, score every token (query-agnostic), let the allocator
split the budget over layers and the press pick kept tokens per layer and KV head over the WHOLE
document, split the picks back into chunks, gather K/V (and any steering bias), quantize, commit
in one transaction. The source stays; the same recipe again is a no-op.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import UnsupportedError, UsageError
from ..format.bundle import decode_bundle
from ..quant import layer_kv
from ..store import Store
from ..versions import commit, existing_version, write_derived
from . import sizing
from .key_basis import key_basis_scope
from .layer_profile import profile_scope, wants_profile
from .recipe import CompressRecipe  # noqa: F401 (re-exported: callers import it from here)
from .stages import Job, pipeline_for, run_pipeline

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel


@dataclass
class CompressResult:
    doc_id: str
    label: str
    status: str  # "compressed" | "unchanged"
    source_bytes: int = 0
    bytes: int = 0
    seconds: float = 0.0
    score_seconds: float = 0.0
    fp16_bytes: int = 0
    kept: float = 1.0  # fraction of tokens kept (size budget: what the cap forced)
    mix: dict | None = None  # ladder rows per tier, keys and values apart

    @property
    def fraction_of_fp16(self) -> float:
        return self.bytes / self.fp16_bytes if self.fp16_bytes else 0.0

    @property
    def ratio(self) -> float:
        return self.source_bytes / self.bytes if self.bytes else 0.0


def compress_document(store: Store, doc_id: str, recipe: CompressRecipe, *, lm=None, source: str = "full",
                      label: str | None = None, fingerprint: str | None = None) -> CompressResult:
    t0 = time.perf_counter()
    label = label or recipe.default_label()
    done = existing_result(store, doc_id, recipe, source, label)
    if done is not None:
        return done
    src = store.get_version(doc_id, source)
    # a model with no key basis or Fisher profile in the store gets them now (compress/key_basis.py, layer_profile.py)
    with key_basis_scope(store, lm, recipe.uses_key_basis), profile_scope(store, lm, wants_profile(recipe)):
        record, score_s, extra = build_compressed_version(store, src, recipe, label, source, lm=lm,
                                                          fingerprint=fingerprint, with_sizes=True)
    commit(store, record)
    return CompressResult(doc_id, label, "compressed", src.nbytes, record.nbytes, time.perf_counter() - t0, score_s,
                          *extra)


def existing_result(store: Store, doc_id: str, recipe: CompressRecipe, source: str, label: str) -> CompressResult | None:
    """The "unchanged" result when ``label`` already holds this recipe's output (None when it
    must be made); a label made by another recipe is an error."""
    step = {"source": source, **recipe.as_dict()}
    src = store.get_version(doc_id, source)
    try:
        done = existing_version(store, doc_id, label, step)
    except UsageError as exc:
        if not (recipe.sized and label == recipe.default_label() == f"b{recipe.budget:g}"):
            raise
        raise UsageError(f"{exc.message}: an earlier default recipe of --budget {recipe.budget:g}",
                         hint=f"keep it and name the new one with --label NAME (e.g. {label}-new)", param="label") from None
    return CompressResult(doc_id, label, "unchanged", src.nbytes, done.nbytes) if done is not None else None


def build_compressed_version(objects, src, recipe: CompressRecipe, label: str, source: str, *, lm=None,
                             fingerprint: str | None = None, with_sizes: bool = False):
    """Read ``src``'s chunks from ``objects`` (a Store or an ObjectDir), run the recipe's pipeline
    (``kdnctl.compress.stages``), write the new version's chunks there and return (its record,
    not committed; the scorer's seconds)."""
    doc_id = src.doc_id
    step = {"source": source, **recipe.as_dict()}
    # a size cap is fitted with the longer of the version's name and its recipe spelled out: what a
    # recipe stores does not depend on the (shorter) name it is given, and any name fits the cap
    fit_label = max(label, recipe.recipe_label(), key=len) if recipe.sized else label
    # every byte checked as a load checks it: against the XXH3 / BLAKE3 the catalog recorded where
    # it did (a sha256 of an 8k-token version's 370 MB takes ~0.35 s at ~1 GB/s), else against the sha256 name
    bundles = [decode_bundle(objects.read_object_checked(c.object, c.blake3, c.xxh3), expect_fingerprint=fingerprint)
               for c in src.chunks]
    if any("quant" in b.meta for b in bundles):
        raise UnsupportedError(f"{doc_id} [{source}] is already quantized", hint="compress from an unquantized version (e.g. full)", param="source")
    if any("positions" not in b.tensors for b in bundles) and (recipe.keep < 1 or recipe.sized):
        raise UnsupportedError(f"{doc_id} [{source}] is already pruned", hint="compress from an unpruned version (e.g. full)", param="source")
    n_layers = bundles[0].n_layers
    dense = [[layer_kv(b, i) for i in range(n_layers)] for b in bundles]
    keys = [torch.cat([d[i][0] for d in dense], dim=1).float() for i in range(n_layers)]
    values = [torch.cat([d[i][1] for d in dense], dim=1).float() for i in range(n_layers)]
    token_ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
    base = bundles[0].meta["token_start"]
    local_bounds = [(b.meta["token_start"] - base, b.meta["token_end"] - base) for b in bundles]
    fp16 = sizing.fp16_bytes(len(token_ids), n_layers, keys[0].shape[0], keys[0].shape[-1])
    job = Job(src=src, label=fit_label, step=step, recipe=recipe, bundles=bundles, keys=keys, values=values,
              token_ids=token_ids, local_bounds=local_bounds, fp16=fp16, lm=lm, dense=dense, all_keys=keys,
              all_values=values)
    new_tensors, metas, kept, mix = run_pipeline(job, pipeline_for(recipe)).result
    record = write_derived(objects, src, label, step, bundles, new_tensors, meta=metas, indices=range(len(bundles)))
    return (record, job.score_seconds, (fp16, kept, mix)) if with_sizes else (record, job.score_seconds)
