"""Time to first token when the K/V come over a link: what fewer stored bytes buy.

    python bench/link_ttft.py [--sizes 1024,4096] [--gbits 1,10] [--repeats 3]

A knowledge delivery network stores K/V once and ships them to the engines that ask. This
measures that path end to end. One document per size (the example corpus, as ``bench/ttft.py``
builds it) is ingested and compressed with the shipped default (``b0.25``); the store is served
by ``kdnctl serve-files`` on 127.0.0.1; a relay process in front of it is the link: every byte
the server sends leaves the relay no sooner than a link of ``--gbits`` Gbit/s would deliver it
(one link shared by every connection, as a NIC is; the relay forwards the other direction as it
comes). Each question opens a fresh ``RemoteStore`` through the relay (version listing, every
chunk fetched in parallel and checked against the BLAKE3 the listing records), the loader
decodes, and the time to the question's first token is taken: the path of ``kdnctl ask
--remote URL``. Each compressed version is also timed with its chunks fetched before any is decoded
(the loader's streamed decode turned off: ``kdnctl/engine/streamed.py``). In the same run: each
version fetched from the server straight over loopback (no relay: the HTTP fetch and its checks
without a link), read from the local store, and a full prefill of the same tokens. Before each
question the version's object files are read once, off the clock, so that every row reads a hot
store (the page cache) whatever the machine's memory reclaim did in between. Medians of
``--repeats``, interleaved (every repetition runs every link and version once); ratios against
``full`` over the same link.

The relay moves the bytes inside the kernel (``splice``). With each link the run prints how much
later, on average, its blocks left than the link would have sent them; where that is not small
beside the times in the table, the rate asked for is above what the relay reaches, and the row
measures the relay, not a link.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import start_kdnctl  # noqa: E402
from ttft import QUESTION, corpus_text  # noqa: E402

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.engine import streamed  # noqa: E402
from kdnctl.engine.generate import generate  # noqa: E402
from kdnctl.engine.hf import load_document  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402
from kdnctl.store.client import RemoteStore  # noqa: E402

BLOCK = 1 << 20  # bytes per relay step (the pipe's size, the kernel's default limit): 0.8 ms of a 10 Gbit/s link


class PacedRelay:
    """``127.0.0.1:port`` -> ``127.0.0.1:target``; bytes from the target leave at ``rate`` bytes/s
    at most, over all connections together (each block waits for the link to be free, then for
    its own transmission time)."""

    def __init__(self, target: int, rate: float):
        self.target, self.rate = target, rate
        self.lock = threading.Lock()
        self.free_at = 0.0  # when the link has sent everything handed to it so far
        self.sent, self.busy = 0, 0.0  # bytes paced, seconds the link was sending them
        self.late, self.blocks = 0.0, 0  # seconds blocks left the relay after the link would have sent them
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]

    def serve(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.target))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def schedule(self, n: int, now: float) -> float:
        """When a block of ``n`` bytes that arrives at ``now`` has been sent: once the link has
        sent everything before it (or at once where the link is idle), plus its own time."""
        with self.lock:
            start = max(now, self.free_at)
            self.free_at = start + n / self.rate
            self.sent += n
            self.busy += n / self.rate
            return self.free_at

    def _wait(self, n: int) -> float:
        due = self.schedule(n, time.perf_counter())
        while (left := due - time.perf_counter()) > 0:
            time.sleep(left)
        return due

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        """Move ``src``'s bytes to ``dst`` block by block; the bytes go socket -> pipe -> socket
        inside the kernel (``splice``: no copy through Python, the GIL released), so the relay
        itself keeps up with the links it stands for."""
        rd, wr = os.pipe()
        try:
            fcntl.fcntl(wr, fcntl.F_SETPIPE_SZ, BLOCK)
            while n := os.splice(src.fileno(), wr, BLOCK):
                due = self._wait(n) if paced else None
                while n:
                    n -= os.splice(rd, dst.fileno(), n)
                if due is not None:
                    late = time.perf_counter() - due
                    with self.lock:
                        self.late += max(0.0, late)
                        self.blocks += 1
        except OSError:
            pass
        finally:
            os.close(rd)
            os.close(wr)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def relay_main(target: int, gbits: float) -> None:
    """The relay process: prints its port, then serves until killed; on a line ``stats`` from
    its stdin it prints the bytes it paced, the seconds the link spent sending them, the seconds
    its blocks were delivered late (the relay, not the link, was the bottleneck) and the blocks."""
    relay = PacedRelay(target, gbits * 1e9 / 8)
    threading.Thread(target=relay.serve, daemon=True).start()
    print(relay.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            with relay.lock:
                print(relay.sent, relay.busy, relay.late, relay.blocks, flush=True)


def start_relay(target: int, gbits: float) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, __file__, "--relay", str(target), str(gbits)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def relay_stats(proc: subprocess.Popen) -> tuple[float, ...]:
    proc.stdin.write("stats\n")
    proc.stdin.flush()
    return tuple(float(x) for x in proc.stdout.readline().split())


def warm_objects(root: Path, store, doc_id: str, label: str) -> None:
    """Read a version's object files once (off the clock): the server and a local load find them
    in the page cache, as a store's hot versions are, and not wherever the machine's memory
    reclaim (here a DAMON ``pageout`` scheme) last left them."""
    for c in store.get_version(doc_id, label).chunks:
        with open(root / "objects" / c.object[:2] / c.object, "rb") as f:
            while f.read(1 << 24):
                pass


@contextlib.contextmanager
def fetched_first(on: bool):
    """With ``on``, the loader without its streamed decode (``kdnctl.engine.streamed``): every
    chunk fetched before any is decoded, as remote loads went before it, for this run's comparison."""
    real = streamed.applies
    if on:
        streamed.applies = lambda lm, store: False
    try:
        yield
    finally:
        streamed.applies = real


@torch.inference_mode()
def ttft(lm, store, doc_id: str, label: str, question: list[int], url: str | None,
         first: bool = False) -> tuple[float, int]:
    """(seconds to the first token, bytes read) of one question over ``doc_id``'s ``label``:
    through a fresh RemoteStore at ``url``, or from the local ``store`` where ``url`` is None;
    ``first``: every chunk fetched before any is decoded."""
    t0 = time.perf_counter()
    remote = RemoteStore(url) if url else None
    try:
        with fetched_first(first):
            ctx = load_document(lm, remote or store, doc_id, label, overlap=True)
        return generate(lm, ctx, question, max_new_tokens=1, t0=t0).ttft_s, ctx.nbytes
    finally:
        if remote is not None:
            remote.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--gbits", default="1,10", help="link rates, Gbit/s, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--labels", default="full,b0.25", help="stored versions (the first is the ratios' baseline)")
    ap.add_argument("--relay", nargs=2, metavar=("TARGET_PORT", "GBITS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.relay:
        relay_main(int(args.relay[0]), float(args.relay[1]))
        return
    torch.manual_seed(0)
    lm = load_model(device="cpu", dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    question = fmt.question_ids(lm.tokenizer, QUESTION)
    sizes = [int(s) for s in args.sizes.split(",")]
    rates = [float(g) for g in args.gbits.split(",")]
    labels = args.labels.split(",")
    with tempfile.TemporaryDirectory() as tmp_s:
        root = Path(tmp_s) / "store"
        store = Store(root)
        docs = {}
        for size in sizes:
            text = corpus_text(lm.tokenizer, size)
            doc = Document(f"bench-{size}.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
            ingest_documents(store, lm, [doc], IngestOptions())
            with store.writer():
                for label in labels:
                    if label != "full":
                        compress_document(store, doc.doc_id, CompressRecipe(budget=float(label.removeprefix("b"))),
                                          lm=lm, label=label)
            docs[size] = (doc.doc_id, fmt.document_ids(lm.tokenizer, text)[0])
        server, port = start_kdnctl(root)
        relays = {g: start_relay(port, g) for g in rates}
        try:
            links = [(f"{g:g} Gbit/s", f"http://127.0.0.1:{relays[g][1]}") for g in rates] + [
                ("loopback, no relay", f"http://127.0.0.1:{port}"), ("local store", None)]
            # (name, label, fetched first): the stored versions, and each compressed one with its
            # chunks fetched before any is decoded (over a link; a local load has no such choice)
            runs = [(lb, lb, False) for lb in labels] + [(f"{lb}, fetched first", lb, True) for lb in labels[1:]]
            for name, url in links:  # first calls off the clock (numba, the key basis, the connections)
                for label in labels:
                    ttft(lm, store, docs[sizes[0]][0], label, question, url)
            before = {g: relay_stats(p) for g, (p, _) in relays.items()}
            times: dict[tuple, list[float]] = {}
            nbytes: dict[tuple, int] = {}
            prefill: dict[int, list[float]] = {}
            for _ in range(args.repeats):
                for size in sizes:
                    doc_id, ids = docs[size]
                    for name, url in links:
                        for run, label, first in runs:
                            if first and url is None:
                                continue
                            warm_objects(root, store, doc_id, label)
                            s, n = ttft(lm, store, doc_id, label, question, url, first)
                            print(f"{size} tokens, {name}, {run}: {s:.3f} s", file=sys.stderr, flush=True)
                            times.setdefault((size, name, run), []).append(s)
                            nbytes[size, label] = n
                    prefill.setdefault(size, []).append(bare_prefill_seconds(lm.model, ids + question))
            after = {g: relay_stats(p) for g, (p, _) in relays.items()}
        finally:
            for proc, _ in relays.values():
                proc.kill()
            server.kill()
        store.close()
    print(f"device: CPU, float32, torch threads {torch.get_num_threads()}; a {len(question)}-token question; "
          f"medians of {args.repeats}; seconds to the first token")
    for g in rates:
        sent, busy, late, blocks = (a - b for a, b in zip(after[g], before[g]))
        print(f"link {g:g} Gbit/s: {sent / 1e6:.0f} MB paced, {busy:.2f} s of link time; each block left the "
              f"relay {1e3 * late / max(blocks, 1):.2f} ms after the link would have sent it, on average (the relay's own delay)")
    base = labels[0]
    names = [r[0] for r in runs]
    head = " | ".join(f"`{n}`" for n in names)
    ratio_head = " | ".join(f"`{lb}` / `{base}`" for lb in labels[1:]) + " | " + " | ".join(
        f"`{lb}` / fetched first" for lb in labels[1:])
    n_cols = len(names) + 2 * (len(labels) - 1) + 1
    print(f"\n| context tokens | link | {head} | {ratio_head} | full prefill |")
    print("|---:|---|" + "---:|" * n_cols)
    for size in sizes:
        pre = statistics.median(prefill[size])
        for name, _ in links:
            med = {n: statistics.median(times[size, name, n]) for n in names if (size, name, n) in times}
            cells = " | ".join(f"{med[n]:.3f}" if n in med else "-" for n in names)
            ratios = " | ".join(f"{med[lb] / med[base]:.2f}" for lb in labels[1:]) + " | " + " | ".join(
                f"{med[lb] / med[f'{lb}, fetched first']:.2f}" if f"{lb}, fetched first" in med else "-"
                for lb in labels[1:])
            print(f"| {size} | {name} | {cells} | {ratios} | {pre:.2f} |")
    print("\nMB read per question: " + ", ".join(
        f"{size} tokens: " + " / ".join(f"`{lb}` {nbytes[size, lb] / 1e6:.1f}" for lb in labels) for size in sizes))


if __name__ == "__main__":
    main()
