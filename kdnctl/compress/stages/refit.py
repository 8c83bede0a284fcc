"""Refit: what eviction takes from attention, given back through the kept tokens' values.

The kept tokens' values are refitted (``kdnctl.compress.refit``) so that attention over the kept
keys alone gives the document's own queries, placed after it, the full cache's output. With
``refit_decoded`` the fit waits for the keys' steps: the encode stage calls ``refitted`` again
with the keys as the loader will decode them. A long document (its queries read from the stored
K/V) also gets held-out queries that check each head's fit.
"""

from __future__ import annotations

import torch

from ...format.bundle import KVBundle
from ...quant.sensitivity import key_weights, recorded_key_weights
from ..refit import QUESTION_OFFSET, cached_queries, document_queries, picked_queries, query_rows, refit_values
from .base import Job, Stage


def refit_queries(lm, token_ids: list[int], bundles: list[KVBundle], n_layers: int, raw=None):
    """(queries per layer, attention scale per layer) the value refit fits to: the document's
    own, placed after it (``kdnctl.compress.refit.document_queries``; ``raw``: as read there)."""
    last = max(int(b.layer_positions(0).max()) for b in bundles)
    return document_queries(lm, token_ids, n_layers, last + 1 + QUESTION_OFFSET, raw=raw)


def refitted(rho: float, queries: list[torch.Tensor], scales: list[float], keys: list[torch.Tensor],
             values: list[torch.Tensor], rows: torch.Tensor, hold: torch.Tensor | None = None,
             kept_keys: list[torch.Tensor] | None = None, checks: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The kept ``rows``' values per layer, refitted to the full attention; the kept tokens
    ``hold`` marks keep theirs; ``kept_keys`` per layer: the keys they are read with (default:
    ``keys``' rows); ``checks`` per layer: held-out queries each head's fit is checked on
    (``refit_values``)."""
    kept_keys = kept_keys or [None] * len(keys)
    checks = checks or [None] * len(keys)
    return [refit_values(q, k, v, rows, s, rho, hold, kk, c).to(v.dtype)
            for q, k, v, s, kk, c in zip(queries, keys, values, scales, kept_keys, checks)]


CHECK_ROWS = 256  # held-out rows a long document's fit is checked on (a choice per head, not a fit)


def held_out_rows(n_tokens: int, pick: torch.Tensor, count: int = CHECK_ROWS) -> torch.Tensor:
    """Up to ``count`` rows spread over the document, each half a spacing after a picked row and
    not picked itself."""
    spacing = (n_tokens - 1) / max(pick.numel() - 1, 1)
    rows = (pick.double() + spacing / 2).round().long().clamp_max(n_tokens - 1).unique()
    rows = rows[~torch.isin(rows, pick)]
    return rows[torch.linspace(0, rows.numel() - 1, min(rows.numel(), count)).round().long().unique()]


def reads_stored_cache(job: Job, pick: torch.Tensor) -> bool:
    """Whether the refit's queries come from a pass over the picked rows alone that reads the
    source's K/V (``cached_queries``): the rows are at most half of the document (2,048 tokens and
    more), the source is a prefix prefill's K/V as the model computed them (every token, the
    model's dtype), and its chunks recorded the key weights the skipped forward would measure."""
    if 2 * pick.numel() > len(job.token_ids) or getattr(job.src, "mode", "prefix") != "prefix":
        return False
    dtype = next(job.lm.model.parameters()).dtype
    if any(k.dtype != dtype or v.dtype != dtype for chunk in job.dense for k, v in chunk):
        return False
    if any(k.shape[1] != len(job.token_ids) for k in job.all_keys):
        return False
    return recorded_key_weights(job.lm, job.bundles, len(job.token_ids)) is not None


def first_pass_queries(job: Job) -> list[torch.Tensor] | None:
    """The refit's picked queries per layer: from the stored K/V where :func:`reads_stored_cache`
    (``job.queries_read_cache``: the precision stage takes the recorded key weights), else from
    the forward that measures the key weights (``kdnctl.quant.sensitivity``; the precision stage
    reads them from there, kept), or None where the key weights of this document are already
    known: one decoder pass serves both."""
    n_heads, _, d = job.all_keys[0].shape
    pick = query_rows(len(job.token_ids))
    if reads_stored_cache(job, pick):
        job.queries_read_cache = True
        return cached_queries(job.lm, job.token_ids, job.all_keys, job.all_values, pick)
    raw: list = [None] * job.n_layers

    def keep(i: int, q: torch.Tensor) -> None:
        raw[i] = picked_queries(q, pick)

    key_weights(job.lm, job.token_ids, job.n_layers, n_heads, d, rope=job.theta is not None, also=keep)
    return raw if all(q is not None for q in raw) else None


class RefitValues(Stage):
    """Evicting recipes with ``refit``: the document's queries, and (unless ``refit_decoded``)
    the kept values refitted to them."""

    name = "refit"

    def run(self, job: Job) -> None:
        recipe = job.recipe
        if job.rows is None or not recipe.refit:
            return
        job.fit_queries = refit_queries(job.lm, job.token_ids, job.bundles, job.n_layers, first_pass_queries(job))
        if job.queries_read_cache:
            # a long document: other rows of it, read the same way, check each head's fit
            rows = held_out_rows(len(job.token_ids), query_rows(len(job.token_ids)))
            job.check_queries = refit_queries(job.lm, job.token_ids, job.bundles, job.n_layers, cached_queries(
                job.lm, job.token_ids, job.all_keys, job.all_values, rows))[0]
        if recipe.refit_decoded:  # after the keys' steps are known (the encode stage)
            job.values = [v[:, job.rows] for v in job.values]
        else:
            job.values = refitted(recipe.refit, *job.fit_queries, job.all_keys, job.all_values, job.rows, job.hold,
                                  checks=job.check_queries)
