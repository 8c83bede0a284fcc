"""Query-agnostic importance scorers: which stored tokens will a *future* question need?

At compress time the question is unknown. Each scorer, one file each, returns ``[L, H_kv, T]``
(higher = keep); ``SCORERS`` finds it by name, ``compute_importance`` runs it for one document:

* ``window``      attention from the last W queries of the document (``window.py``; SnapKV).
* ``accum``       attention received from every later query, normalised (``accum.py``).
* ``surprisal``   the model's own -log p(token | prefix) at ingest (``surprisal.py``).
* ``reconstruct`` attention of the model repeating the document, KVzip's idea (``reconstruct.py``).
* ``hybrid``      (default) the rank average of ``reconstruct`` and ``surprisal`` (``hybrid.py``).
* ``sentences``, ``sentences-local``, ``sentences-gap``: per-sentence surprisal (``sentences.py``).
* ``literals``    digits first, then their sentences: an order for ``lift`` (``literals.py``).

Adding a scorer: one file with a ``Scorer`` subclass, one line in ``SCORERS``.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from .accum import AccumScorer
from .base import Scorer, ScorerInput
from .hybrid import HybridScorer
from .literals import LiteralsScorer
from .reconstruct import ReconstructScorer
from .sentences import GapSentencesScorer, LocalSentencesScorer, SentencesScorer
from .surprisal import SurprisalScorer
from .window import WindowScorer

SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (WindowScorer, AccumScorer, SurprisalScorer, ReconstructScorer, HybridScorer, SentencesScorer,
                LocalSentencesScorer, GapSentencesScorer, LiteralsScorer)
}
DEFAULT_SCORER = "hybrid"
NEEDS_MODEL = frozenset(name for name, cls in SCORERS.items() if cls.needs_model)  # sentences, literals: the tokenizer only


def compute_importance(name: str, stats: dict[str, torch.Tensor], *, lm=None, keys=None, values=None,
                       token_ids=None, n_layers: int, n_heads: int) -> torch.Tensor:
    """The ``[L, H_kv, T]`` importance of scorer ``name`` for one document."""
    if name not in SCORERS:
        raise UsageError(f"unknown scorer {name!r}", hint=f"choose one of {', '.join(SCORERS)}", param="scorer")
    cls = SCORERS[name]
    missing = [s for s in cls.stats if s not in stats]
    if missing:
        raise UsageError(f"scorer {name!r} needs ingest statistics {missing} that this version lacks",
                         hint="re-ingest with statistics, or use the reconstruct scorer", param="scorer")
    if cls.needs_model and lm is None:
        raise UsageError(f"scorer {name!r} needs {cls.needs}", hint="give a loaded model (or use the window scorer)",
                         param="model")
    inputs = ScorerInput(stats=stats, n_layers=n_layers, n_heads=n_heads, lm=lm, keys=keys, values=values,
                         token_ids=token_ids)
    return cls().score(inputs)


__all__ = ["DEFAULT_SCORER", "NEEDS_MODEL", "SCORERS", "Scorer", "ScorerInput", "compute_importance"]
