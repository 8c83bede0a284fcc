"""Time to first token of the default behind the forward with other layer groups, against full.
    python research/results/ttft-4k-2026-11-30/overlap_groups.py SIZE REPEATS"""
import sys, hashlib, tempfile, statistics
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
import torch
torch.set_num_threads(1)
import ttft
from kdnctl.engine import overlap as ov, hf
from kdnctl.compress.document import CompressRecipe, compress_document
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.corpus import Document
from kdnctl.ingest.prompting import PromptFormat
from kdnctl.models.load import load_model
from kdnctl.store import Store
orig = ov.layer_groups
def small_first(n, k=1, rest=5):
    first = [range(0, k)]
    return first + [range(k + a.start, k + a.stop) for a in orig(n - k, rest)]
configs = {"six equal": orig, "2 then 5": lambda n: small_first(n, 2, 5), "1 then 6": lambda n: small_first(n, 1, 6), "3 then 5": lambda n: small_first(n, 3, 5)}
lm = load_model(dtype="float32")
fmt = PromptFormat.for_tokenizer(lm.tokenizer)
q = fmt.question_ids(lm.tokenizer, ttft.QUESTION)
size = int(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    st = Store(Path(tmp) / "s")
    text = ttft.corpus_text(lm.tokenizer, size)
    doc = Document("d.txt", text, "b", hashlib.sha256(text.encode()).hexdigest())
    ingest_documents(st, lm, [doc], IngestOptions())
    with st.writer():
        compress_document(st, "d.txt", CompressRecipe(), lm=lm, label="default")
    res = {k: [] for k in ["full", *configs]}
    for rep in range(int(sys.argv[2])):
        res["full"].append(ttft.stored_ttft(lm, st, "d.txt", "full", q))
        for name, f in configs.items():
            hf.layer_groups = f
            res[name].append(ttft.stored_ttft(lm, st, "d.txt", "default", q))
        hf.layer_groups = orig
    full = statistics.median(res["full"])
    for k, v in res.items():
        print(size, k, round(statistics.median(v), 3), round(statistics.median(v) / full, 3))
