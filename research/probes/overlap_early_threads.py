"""Does the decode thread's own torch work matter beside a forward that shares its cores? The
0.25 default behind the question's forward as the product runs it (``shared``: the forward drops
to one thread when it starts) against the forward dropped to one thread before the load starts
(``early``: the decode thread's first torch call then sees one thread too), and ``full``, the
order rotating from one repetition to the next; torch on two threads otherwise.

    python research/probes/overlap_early_threads.py 1024,4096,8000 7
"""
import sys, time, statistics, tempfile
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research" / "probes")); sys.path.insert(0, str(ROOT / "bench")); sys.path.insert(0, str(ROOT))
import torch, ttft
from default_version import default_store
from kdnctl.engine import overlap
from kdnctl.ingest.prompting import PromptFormat
from kdnctl.models.load import load_model
from kdnctl.engine.hf import load_document
from kdnctl.engine.generate import generate
torch.set_num_threads(2)
EARLY = {"on": False}
_wait = overlap.LayersReady.wait


def wait(self, layer):
    """The product's wait; in the early mode, torch's two threads come back at the first layer
    after the decode is done, as the product's sharing gives them back."""
    _wait(self, layer)
    if EARLY["on"] and all(e.is_set() for e in self._events):
        EARLY["on"] = False
        torch.set_num_threads(2)


overlap.LayersReady.wait = wait
lm = load_model(dtype="float32")
q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, ttft.QUESTION)

def run(st, doc, mode):
    t0 = time.perf_counter()
    if mode == "full":
        ctx = load_document(lm, st, doc, "full", overlap=True)
    elif mode == "early":
        torch.set_num_threads(1)  # the forward then finds one thread and shares nothing itself
        EARLY["on"] = True
        ctx = load_document(lm, st, doc, "default", overlap=True)
    else:
        ctx = load_document(lm, st, doc, "default", overlap=True)
    r = generate(lm, ctx, q, max_new_tokens=1, t0=t0)
    EARLY["on"] = False
    torch.set_num_threads(2)
    return r.ttft_s

MODES = ("full", "shared", "early")
for size in [int(s) for s in sys.argv[1].split(",")]:
    with tempfile.TemporaryDirectory() as tmp:
        st, doc = default_store(lm, size, Path(tmp))
        for m in MODES: run(st, doc, m)
        res = {m: [] for m in MODES}
        for rep in range(int(sys.argv[2])):
            k = rep % 3
            for m in MODES[k:] + MODES[:k]:
                res[m].append(run(st, doc, m))
        med = {m: statistics.median(v) for m, v in res.items()}
        pe = statistics.median(a / b for a, b in zip(res["early"], res["shared"]))
        print(size, {m: round(v, 3) for m, v in med.items()}, "shared/full %.3f early/full %.3f early/shared(paired) %.3f" % (med["shared"]/med["full"], med["early"]/med["full"], pe), flush=True)
        st.close()
