"""Time to first token of the 0.25 default with its decode behind the question's forward, the
waiting forward decoding jobs of its group itself (``helper``, the product) or idling until the
background thread has written it (the load as it was), against ``full`` in the same run,
interleaved repetitions, one torch thread (``bench/ttft.py``'s setting).

    python research/probes/overlap_help.py --sizes 1024,2048,4096,8000 --repeats 7
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "research" / "probes"))

import torch  # noqa: E402

import ttft  # noqa: E402
from default_version import default_store  # noqa: E402
from kdnctl.engine import overlap  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402

WAITS: list[float] = []
_wait = overlap.LayersReady.wait
_start = overlap.LayersReady.start
HELP = {"on": True}


def timed_wait(self, layer):
    t = time.perf_counter()
    _wait(self, layer)
    WAITS.append(time.perf_counter() - t)


def start(self, decode, helper=None):
    _start(self, decode, helper=helper if HELP["on"] else None)


overlap.LayersReady.wait = timed_wait
overlap.LayersReady.start = start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096,8000")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model(dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    q = fmt.question_ids(lm.tokenizer, ttft.QUESTION)
    print("| context tokens | full s | behind, idle wait s | behind, helping s | idle / full | helping / full | "
          "helping / idle (paired median) | forward's wait s: idle, helping |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            st, doc_id = default_store(lm, size, Path(tmp))
            n_tok = st.get_version(doc_id, "full").n_tokens
            for name in ("full", "default"):
                ttft.stored_ttft(lm, st, doc_id, name, q)
            res = {"full": [], "idle": [], "help": []}
            waits = {"idle": [], "help": []}
            for rep in range(args.repeats):
                order = ["idle", "help"] if rep % 2 == 0 else ["help", "idle"]
                res["full"].append(ttft.stored_ttft(lm, st, doc_id, "full", q))
                for mode in order:
                    HELP["on"] = mode == "help"
                    WAITS.clear()
                    res[mode].append(ttft.stored_ttft(lm, st, doc_id, "default", q))
                    waits[mode].append(sum(WAITS))
            m = {k: statistics.median(v) for k, v in res.items()}
            paired = statistics.median(h / i for h, i in zip(res["help"], res["idle"]))
            print(f"| {n_tok} | {m['full']:.3f} | {m['idle']:.3f} | {m['help']:.3f} | {m['idle'] / m['full']:.3f} | "
                  f"{m['help'] / m['full']:.3f} | {paired:.3f} | {statistics.median(waits['idle']):.4f}, "
                  f"{statistics.median(waits['help']):.4f} |", flush=True)
            st.close()


if __name__ == "__main__":
    main()
