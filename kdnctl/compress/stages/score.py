"""Score: every token ranked by the recipe's scorer (query-agnostic), and the press and allocator
the recipe builds. Statistics a scorer needs that ingest did not record are computed here from
one prefill of the document, where the model is at hand."""

from __future__ import annotations

import time

import torch

from ...format.bundle import stats_of
from ...presses.base import ScoreContext
from ...scorers import compute_importance
from ...scorers.rank import rank01
from .base import Job, Stage


def cat_stats(bundles) -> dict[str, torch.Tensor]:
    """The statistics every chunk recorded, joined along the tokens."""
    per_chunk = [stats_of(b.tensors) for b in bundles]
    names = set.intersection(*(set(s) for s in per_chunk))
    return {n: torch.cat([s[n].float() for s in per_chunk], dim=-1) for n in sorted(names)}


def attention_stats(lm, token_ids: list[int], ingest_recipe: dict) -> dict[str, torch.Tensor]:
    """``window`` and ``accum`` of a document computed after the fact (one prefill)."""
    from ...engine.prefill import prefill

    steps = ingest_recipe.get("steps", [ingest_recipe])
    window = int(steps[0].get("window", 32)) if steps else 32
    res = prefill(lm.model, token_ids, stats=("accum", "window"), window=window)
    return {name: t.float() for name, t in res.stats.items()}


def can_prefill(job: Job) -> bool:
    """The document's statistics can be computed now: the model is here and the version is a
    whole prefix document from its first token."""
    return job.lm is not None and job.bundles[0].meta["token_start"] == 0 and job.src.mode == "prefix"


class ScoreTokens(Stage):
    """``importance`` ``[L, H, T]`` (zeros where the recipe ranks nothing), the ``lift`` weights,
    the press, the allocator and the press's context."""

    name = "score"

    def run(self, job: Job) -> None:
        recipe, keys, values, token_ids, lm = job.recipe, job.keys, job.values, job.token_ids, job.lm
        n_layers, n_heads = len(keys), keys[0].shape[0]
        if not (recipe.keep < 1 or recipe.sized):
            job.importance = torch.zeros(n_layers, n_heads, len(token_ids))
            return
        stats = cat_stats(job.bundles)
        job.press = recipe.build_press(job.header)
        job.allocator = recipe.build_allocator()
        if recipe.uses_scorer and recipe.scorer in ("accum", "window") and recipe.scorer not in stats and can_prefill(job):
            stats.update(attention_stats(lm, token_ids, job.src.recipe))  # not recorded at ingest
        t_score = time.perf_counter()  # the scorer alone (model passes): reported apart from selection
        importance = compute_importance(recipe.scorer, stats, lm=lm, keys=keys, values=values, token_ids=token_ids,
                                        n_layers=n_layers, n_heads=n_heads) if recipe.uses_scorer \
            else torch.zeros(n_layers, n_heads, len(token_ids))
        if recipe.sized and recipe.lift:  # upgrade weights: the better rank of the scorers
            lifted = torch.stack([rank01(importance if name == recipe.scorer and recipe.uses_scorer else
                                         compute_importance(name, stats, lm=lm, keys=keys, values=values,
                                                            token_ids=token_ids, n_layers=n_layers, n_heads=n_heads))
                                  for name in recipe.lift.split("+")]).amax(0)  # the recipe's scorer: no second pass
            job.lift = lifted if recipe.quant == "ec" else torch.maximum(rank01(importance), lifted)
        job.score_seconds = time.perf_counter() - t_score
        job.importance, job.stats = importance, stats
        job.ctx = ScoreContext(importance=importance, keys=keys, values=values, stats=stats, seed=recipe.seed)
