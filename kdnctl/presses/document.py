"""Selection over documents stored as several chunks (one bundle per chunk).

Each chunk bundle holds, per layer, one ``[H, T_i, D]`` tensor, so within a chunk every head
of a layer must keep the same number of tokens, not just within the document. Selecting at
document level and cutting per chunk does not give that (head 0 may keep 10 tokens of chunk
0, head 1 only 7). So:

1. select at document level with the document's per-layer quotas (from an allocator, see
   :mod:`kdnctl.allocate`; the press's own rule, sinks and recent tokens included);
2. per layer, give chunk c the mean over heads of how many of each head's selected tokens
   fall in it, rounded with largest remainders (ties to the earlier chunk) so the chunk
   quotas sum to the layer quota exactly; exact integer arithmetic, so deterministic;
3. run the press again per chunk on the context sliced to that chunk, with those quotas,
   keeping sinks only in the document's first chunk and recent tokens only in its last.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kdnctl.errors import UsageError
from kdnctl.presses.base import Press, ScoreContext


def check_chunk_bounds(chunk_bounds: list[tuple[int, int]], n_tokens: int) -> None:
    """Chunks must tile ``[0, T)`` in order, each non-empty."""
    if not chunk_bounds:
        raise UsageError("a document needs at least one chunk")
    pos = 0
    for start, end in chunk_bounds:
        if start != pos or end <= start:
            raise UsageError(f"chunk bounds {chunk_bounds} do not tile [0, {n_tokens}) in order")
        pos = end
    if pos != n_tokens:
        raise UsageError(f"chunk bounds end at {pos}, the document has {n_tokens} tokens")


def chunk_quotas(kept: list[Tensor], chunk_bounds: list[tuple[int, int]]) -> list[list[int]]:
    """result[c][l]: tokens layer l keeps in chunk c, from document-level kept indices."""
    edges = torch.tensor([end for _, end in chunk_bounds], dtype=torch.long)
    n_chunks = len(chunk_bounds)
    lengths = [end - start for start, end in chunk_bounds]
    per_layer = []
    for idx in kept:
        h, k = idx.shape
        # chunk of each kept token; bucketize(right=True) maps position p to #edges <= p
        which = torch.bucketize(idx, edges, right=True)
        totals = torch.bincount(which.flatten(), minlength=n_chunks)[:n_chunks].tolist()
        if h == 0:
            per_layer.append([0] * n_chunks)
            continue
        quotas = [tot // h for tot in totals]
        rems = [tot % h for tot in totals]  # remainder numerators over h: exact ordering
        order = sorted(range(n_chunks), key=lambda c: (-rems[c], c))
        short = k - sum(quotas)
        for c in order:
            if short == 0:
                break
            if rems[c] and quotas[c] < lengths[c]:
                quotas[c] += 1
                short -= 1
        if short:
            raise AssertionError("chunk quotas do not add up; mean-over-heads invariant broken")
        per_layer.append(quotas)
    return [[per_layer[layer][c] for layer in range(len(kept))] for c in range(n_chunks)]


def select_document(
    press: Press,
    ctx: ScoreContext,
    quotas: list[int],
    chunk_bounds: list[tuple[int, int]],
) -> list[list[Tensor]]:
    """result[c][l] = int64 ``[H, k_{c,l}]`` chunk-local kept indices (0-based in chunk c,
    ascending); for every layer, sum over chunks of k_{c,l} == ``quotas[l]``."""
    check_chunk_bounds(chunk_bounds, ctx.n_tokens)
    doc_kept = press.select(ctx, quotas)
    per_chunk = chunk_quotas(doc_kept, chunk_bounds)
    last = len(chunk_bounds) - 1
    out = []
    for c, (start, end) in enumerate(chunk_bounds):
        sub = ctx.slice(start, end)
        out.append(press.select(sub, per_chunk[c], keep_sinks=c == 0, keep_recent=c == last))
    return out
