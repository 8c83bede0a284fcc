"""``bench/quality.py`` with spread bins one octave wide (the default) beside half an octave, in one
run: a recipe whose label ends in ``-half`` compresses with ``SPREAD_BINS_PER_OCTAVE = 2``, every
other with the default. Takes ``bench/quality.py``'s arguments:

    python research/probes/quality_bins_ab.py --no-default-recipes --per-task --interleave \\
        --threads 1 --recipe "--budget 0.25" --recipe "--budget 0.25 --label b0.25-half" ...
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import quality  # noqa: E402

from kdnctl.compress.stages import payload_size  # noqa: E402
from kdnctl.quant import entropy  # noqa: E402

DEFAULT = entropy.SPREAD_BINS_PER_OCTAVE
real = quality.run_compress


def run_compress(args, *rest, **kw):
    half = any(a.endswith("-half") for a in args)
    entropy.SPREAD_BINS_PER_OCTAVE = payload_size.SPREAD_BINS_PER_OCTAVE = 2 if half else DEFAULT
    try:
        return real(args, *rest, **kw)
    finally:
        entropy.SPREAD_BINS_PER_OCTAVE = payload_size.SPREAD_BINS_PER_OCTAVE = DEFAULT


quality.run_compress = run_compress

if __name__ == "__main__":
    print("recipes labelled *-half: " + shlex.join(["SPREAD_BINS_PER_OCTAVE=2"]), file=sys.stderr)
    quality.main()
