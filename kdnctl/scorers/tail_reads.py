"""What the end of a document reads: a second order for part of an evicting kept set.

At 0.083 the kept third goes to the sentences a question will ask about (``sentences-gap``:
surprising, out of place, records of a template). The text that follows the document is a
different reader: man pages continue by reusing what they already said (GRANT's grammar repeats
every four lines, an option list names options described earlier), and what it copies is not
what surprisal ranks high. The document's own last queries are the best offline view of that
reader: in the middle layers (where eviction costs the continuation most) they
attend to the sources the next lines will copy. ``compress --tail-reads R`` fills a share R of
the kept tokens (beyond the header and the forced tail) with whole sentences in the order of
the mean attention their tokens get from the last ``TAIL_WINDOW`` queries of the document, the
rest by the scorer as before (``kdnctl.compress.stages.select.shared_keep``). Measured in docs/compression.md
("What the end of the document reads").
"""

from __future__ import annotations

import torch

TAIL_WINDOW = 128  # the document's last queries whose attention is read
MIDDLE = (0.4, 0.8)  # the middle layers, as fractions of depth: 12-23 of SmolLM2's 30


def middle_layers(n_layers: int) -> range:
    """The layers whose attention ranks: ``[0.4 L, 0.8 L)``."""
    a, b = int(MIDDLE[0] * n_layers), int(MIDDLE[1] * n_layers)
    return range(a, max(b, a + 1))


def sentence_reads(window: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """``[L, H, T]`` attention from the last queries (``prefill``'s ``window`` statistic) ->
    ``[T]``: every token scores its sentence's mean over the middle layers and all heads, plus a
    tie-break that puts later tokens first (the nearer source among equals)."""
    n_layers, _, t = window.shape
    per_token = window[list(middle_layers(n_layers))].double().mean((0, 1))
    out = torch.zeros(t, dtype=torch.float64)  # float64: the tie-break stays above rounding
    for a, b in bounds:
        out[a:b] = per_token[a:b].mean()
    return out + 1e-9 * torch.arange(t, dtype=torch.float64) / max(t, 1) * float(out.abs().max().clamp_min(1e-12))


def tail_read_scores(lm, token_ids: list[int], window: int = TAIL_WINDOW) -> torch.Tensor:
    """``[T]`` scores: ``sentence_reads`` of one prefill of the document (attention only)."""
    from ..engine.prefill import prefill
    from .sentences import sentence_bounds, token_texts

    stats = prefill(lm.model, token_ids, stats=("window",), window=window).stats["window"]
    return sentence_reads(stats, sentence_bounds(token_texts(lm.tokenizer, token_ids)))
