"""Evict: the kept tokens of a token-eviction recipe (``keep`` without a size budget), per layer
and KV head: the allocator splits ``keep`` over layers, the press picks over the whole document
and the picks are split back into chunks (``kdnctl.presses.document``)."""

from __future__ import annotations

from ...allocate import allocate
from ...errors import UnsupportedError
from ...presses.document import select_document
from .base import Job, Stage
from .score import attention_stats, can_prefill


class EvictTokens(Stage):
    name = "evict"

    def run(self, job: Job) -> None:
        recipe, ctx = job.recipe, job.ctx
        if not (recipe.keep < 1 and not recipe.sized):
            return
        try:
            job.picks = select_document(job.press, ctx, allocate(job.allocator, job.press, ctx, recipe.keep),
                                        job.local_bounds)
        except UnsupportedError as exc:
            # A statistic ingest did not record (``accum`` is opt-in): compute it now from one
            # prefill of the document, when the model is at hand and the version starts at 0.
            if "statistic" not in exc.message or not can_prefill(job):
                raise UnsupportedError(exc.message, hint="ingest with `--stats all`, or pass --model so compress "
                                       "can compute it") from None
            ctx.stats = {**ctx.stats, **attention_stats(job.lm, job.token_ids, job.src.recipe)}
            job.picks = select_document(job.press, ctx, allocate(job.allocator, job.press, ctx, recipe.keep),
                                        job.local_bounds)
