"""The compress pipeline of the entropy-coded ``ec`` layout, one stage per file:

    select -> refit -> precision -> quantize -> encode

* ``select``    (select.py)    the kept tokens, by the recipe's press (every token without ``keep``)
* ``refit``     (refit.py)     the kept values refitted to the document's own queries (``refit``)
* ``precision`` (precision.py) per-token levels and per-channel weights
* ``quantize``  (quantize.py)  the transformed keys/values, their steps, the codes at one scale
* ``encode``    (encode.py)    the scale fitted to the byte cap, each chunk's tensors and meta

The refit runs before quantizing because the steps are fitted to the values it stores (with
``refit_decoded`` it runs once more inside ``encode``, against the keys as they will decode).
Adding a stage: one file with a ``Stage`` subclass, its name in ``STAGES`` and ``PIPELINE``.
"""

from __future__ import annotations

from .base import Job, Stage
from .encode import Encode
from .precision import AllocatePrecision
from .quantize import Quantize
from .refit import RefitValues
from .select import SelectTokens

STAGES: dict[str, type[Stage]] = {cls.name: cls for cls in (SelectTokens, RefitValues, AllocatePrecision, Quantize, Encode)}
PIPELINE = ("select", "refit", "precision", "quantize", "encode")


def run_pipeline(job: Job, stages: tuple[str, ...] = PIPELINE) -> Job:
    """Each stage of ``stages`` in turn over ``job``."""
    for name in stages:
        STAGES[name]().run(job)
    return job


__all__ = ["PIPELINE", "STAGES", "Job", "Stage", "run_pipeline"]
