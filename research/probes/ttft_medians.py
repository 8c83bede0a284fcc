"""Cell by cell medians of several ``bench/ttft.py --profile`` runs: one run's table moves by more
than a change of a few percent, so a machine's row is the median of its runs.

    python research/probes/ttft_medians.py RUN1.txt RUN2.txt RUN3.txt
"""

from __future__ import annotations

import statistics
import sys

TABLES = [("`b0.25` / `full` TTFT, behind the forward", "| context tokens | behind the forward", "behind / full"),
          ("decode GB/s (two threads)", "| context tokens | fp32 MB | dequantize s", "GB/s"),
          ("ingest / bare prefill", "| context tokens | ingest tok/s", "ingest/bare"),
          ("`b0.25` compress / bare prefill", "| context tokens | ingest tok/s", "compress / bare prefill")]


def table(path: str, header_start: str) -> dict[str, dict[str, str]]:
    lines = open(path).read().splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    head = [c.strip() for c in lines[i].strip("|").split("|")]
    out = {}
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = dict(zip(head, cells))
    return out


def main() -> None:
    runs = sys.argv[1:]
    print(f"medians of {len(runs)} runs ({', '.join(runs)}); each run's values in brackets\n")
    for what, start, col in TABLES:
        tabs = [table(p, start) for p in runs]
        cells = []
        for n in tabs[0]:
            vals = [float(t[n][col].rstrip("x")) for t in tabs]
            cells.append(f"{n}: **{statistics.median(vals):.2f}** ({' / '.join(f'{v:.2f}' for v in vals)})")
        print(f"- {what}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
