"""The compress pipeline, one stage per file, each found by name in ``STAGES``:

* ``score``     (score.py)     every token ranked by the recipe's scorer; the press and allocator
* ``evict``     (evict.py)     token eviction without a size budget: the press's picks per layer
* ``store``     (plain.py)     those picks gathered and quantized chunk by chunk
* ``ladder``    (ladder.py)    a size budget in per-row tiers, the press evicting what the cap forces
* ``coder``     (coder.py)     ec: the quantizer and the key basis
* ``select``    (select.py)    ec: the kept tokens, by the recipe's press (every token without ``keep``)
* ``refit``     (refit.py)     ec: the kept values refitted to the document's own queries
* ``precision`` (precision.py) ec: per-token levels and per-channel weights
* ``quantize``  (quantize.py)  ec: the transformed keys/values, their steps, the codes at one scale
* ``encode``    (encode.py)    ec: the scale fitted to the byte cap, each chunk's tensors and meta

``PIPELINES`` names the stages each kind of recipe runs, in order (``pipeline_for``). In ``ec``
the refit runs before quantizing because the steps are fitted to the values it stores (with
``refit_decoded`` it runs once more inside ``encode``, against the keys as they will decode).
Adding a stage: one file with a ``Stage`` subclass, one line in ``STAGES``, its place in a pipeline.
"""

from __future__ import annotations

from .base import Job, Stage
from .coder import ECCoder
from .encode import Encode
from .evict import EvictTokens
from .ladder import LadderTiers
from .plain import StoreKept
from .precision import AllocatePrecision
from .quantize import Quantize
from .refit import RefitValues
from .score import ScoreTokens
from .select import SelectTokens

STAGES: dict[str, type[Stage]] = {
    cls.name: cls
    for cls in (ScoreTokens, EvictTokens, StoreKept, LadderTiers, ECCoder, SelectTokens, RefitValues,
                AllocatePrecision, Quantize, Encode)
}
PIPELINES: dict[str, tuple[str, ...]] = {
    "plain": ("score", "evict", "store"),  # no size budget: keep and/or a quantizer
    "ladder": ("score", "ladder"),  # a size budget in tiers
    "ec": ("score", "coder", "select", "refit", "precision", "quantize", "encode"),  # a size budget, entropy-coded
}


def pipeline_for(recipe) -> str:
    """The name of the pipeline a resolved recipe runs."""
    if not recipe.sized:
        return "plain"
    return "ec" if recipe.quant == "ec" else "ladder"


def run_pipeline(job: Job, name: str) -> Job:
    """Each stage of pipeline ``name`` in turn over ``job``."""
    for stage in PIPELINES[name]:
        STAGES[stage]().run(job)
    return job


__all__ = ["PIPELINES", "STAGES", "Job", "Stage", "pipeline_for", "run_pipeline"]
