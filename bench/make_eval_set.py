"""Regenerate the real-text evaluation set from this machine's man pages.

    python bench/make_eval_set.py [--out examples/eval/realtext.jsonl] [--seed 14]
    python bench/make_eval_set.py --out examples/eval/realtext-multifact.jsonl --seed 15 \
        --needle 0 --multifact 160 --continuation 0 --exclude examples/eval/realtext.jsonl
    python bench/make_eval_set.py --out examples/eval/realtext-words.jsonl --seed 16 \
        --needle 0 --multifact 0 --continuation 0 --word-needle 60 --word-fact 60 --max-tokens 2000 \
        --min-page-tokens 800 \
        --exclude examples/eval/realtext.jsonl examples/eval/realtext-multifact.jsonl \
                  examples/eval/realtext-continuation.jsonl

Needs groff and /usr/share/man (Debian: ``apt-get install groff-base``, man pages of the
installed packages). Writes the tasks (one JSON object a line, also a corpus record: ``id`` +
``text``) and ``<out stem>.meta.json`` (seed, counts, pages, tool versions, sha256 of the tasks). Every task carries
its half, ``split``: ``tune`` or ``report`` (``realtext.assign_splits``).
The committed file is what the project measures with; a machine with other packages installed
draws other pages, so regenerate only on purpose. Tokens are counted with the default
model's (SmolLM2) tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdnctl.evaluation.realtext import (CONTINUATION_TOKENS, answer_kind, assign_splits, build_set, find_pages,  # noqa: E402
                                       page_family)


def load_tokenizer():
    from transformers import AutoTokenizer

    from kdnctl.models.load import converted_dir_for, resolve_model_path

    path = resolve_model_path(None)
    hf_dir = converted_dir_for(path) if path.is_file() else path
    if not (hf_dir / "tokenizer.json").is_file() and not (hf_dir / "tokenizer_config.json").is_file():
        from kdnctl.models.load import load_model

        return load_model().tokenizer  # converts the GGUF once
    return AutoTokenizer.from_pretrained(hf_dir)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "examples" / "eval" / "realtext.jsonl"))
    ap.add_argument("--man-root", default="/usr/share/man")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--needle", type=int, default=60)
    ap.add_argument("--multifact", type=int, default=40)
    ap.add_argument("--continuation", type=int, default=30)
    ap.add_argument("--word-needle", type=int, default=0, help="needles whose answer is a word")
    ap.add_argument("--word-fact", type=int, default=0, help="multi-fact tasks whose answers are words")
    ap.add_argument("--min-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--min-page-tokens", type=int, default=None,
                    help="shortest page drawn (default: --max-tokens plus a continuation, so every length fits); "
                         "a context drawn longer than its page is the whole page")
    ap.add_argument("--exclude", nargs="*", default=[],
                    help="task files whose pages' command families this set must not use (a disjoint set)")
    args = ap.parse_args()
    skip = frozenset(page_family(json.loads(line)["source"]) for f in args.exclude
                     for line in Path(f).read_text().splitlines() if line.strip())
    tok = load_tokenizer()
    rng = random.Random(args.seed)
    count = lambda t: len(tok(t, add_special_tokens=False).input_ids)  # noqa: E731
    want = args.needle + args.multifact + args.continuation + args.word_needle + args.word_fact
    # spare pages: a continuation split can fail on a page (then the next page is used)
    min_page = args.min_page_tokens or args.max_tokens + CONTINUATION_TOKENS + 60
    pages = find_pages(Path(args.man_root), rng=rng, want=want + 20, min_chars=4 * min(args.max_tokens, min_page),
                       count_tokens=count, min_tokens=min_page,
                       skip_families=skip)
    print(f"{len(pages)} pages", file=sys.stderr)
    tasks = build_set(pages, tok, n_needle=args.needle, n_multifact=args.multifact,
                      n_continuation=args.continuation, min_tokens=args.min_tokens,
                      max_tokens=args.max_tokens, rng=rng, set_name=Path(args.out).stem,
                      n_word_needle=args.word_needle, n_word_fact=args.word_fact)
    assign_splits(tasks)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tasks).encode("utf-8")
    write_atomic(out, data)
    groff = subprocess.run(["groff", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    meta = {"generator": "bench/make_eval_set.py", "seed": args.seed, "man_root": args.man_root,
            "counts": dict(Counter(t["kind"] for t in tasks)),
            "answer_kinds": dict(Counter(answer_kind(t["kind"], t.get("answer")) for t in tasks)),
            "splits": dict(Counter(t["split"] for t in tasks)), "excluded_sets": args.exclude, "min_tokens": args.min_tokens,
            "max_tokens": args.max_tokens, "min_page_tokens": min_page, "continuation_tokens": CONTINUATION_TOKENS,
            "tokenizer": Path(getattr(tok, "name_or_path", "")).name, "groff": groff[0] if groff else None,
            "sources": [t["source"] for t in tasks], "sha256": hashlib.sha256(data).hexdigest()}
    write_atomic(out.with_name(out.stem + ".meta.json"), (json.dumps(meta, indent=1) + "\n").encode())
    total = sum(t["context_tokens"] for t in tasks)
    print(f"wrote {out} ({len(tasks)} tasks, {total} context tokens, {len(data) / 1e6:.2f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
