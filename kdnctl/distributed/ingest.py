"""``kdnctl ingest --ray``: documents go to model-holding actors; the driver commits.

The catalog ends up exactly as a single-process ingest leaves it (same documents, versions,
chunks and object hashes): workers run the same ``write_segment`` and the driver the same
"already current?" test, only the commits are batched (one LMDB txn per batch).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

from ..ingest.corpus import Document
from ..errors import UsageError
from ..ingest import IngestOptions, IngestReport, doc_version_for, is_current
from ..store import Store
from .cluster import connect, placement, shared_env
from .pool import drive, start
from .workers import IngestOutcome, IngestWorker

RETRIES = 3  # worker restarts (and task retries) before a job gives up


def _committed_segments(store: Store, doc_id: str, version: str) -> list[str]:
    """Segment ids of ``doc_id`` already current at ``version`` (the whole id, or doc#1, doc#2 ...)."""
    if is_current(store, doc_id, version):
        return [doc_id]
    done, k = [], 1
    while store.document_history(f"{doc_id}#{k}"):
        if is_current(store, f"{doc_id}#{k}", version):
            done.append(f"{doc_id}#{k}")
        k += 1
    return done


def ingest_on_ray(
    store: Store,
    docs: list[Document],
    opts: IngestOptions,
    *,
    address: str = "local",
    workers: int | None = None,
    model: str | None = None,
    dtype: str | None = None,
    batch_size: int = 16,
    batch_seconds: float = 5.0,
    retries: int = RETRIES,
    on_start: Callable[[list[dict]], None] | None = None,
    on_dispatch: Callable[[str, int], None] | None = None,
    on_progress: Callable[[int, float], None] | None = None,
) -> IngestReport:
    """Ingest ``docs`` on Ray workers; returns the same report as ``ingest_documents``.

    ``on_start`` gets each worker's ``describe()`` once all have loaded the model; ``on_dispatch``
    gets (doc id, worker index) as a document is handed out; ``on_progress`` gets (documents just
    finished or found unchanged, tokens/s across all workers since the first dispatch)."""
    report = IngestReport()
    with connect(address, workers) as ray, store.writer():
        place, n = placement(ray, workers)
        actor_cls = ray.remote(max_restarts=retries, max_task_retries=retries, **place.options)(IngestWorker)
        args = (model, dtype, place.device, str(store.objects_dir.resolve()), str(store.tmp_dir.resolve()),
                dataclasses.asdict(opts), shared_env())
        actors = [actor_cls.remote(*args) for _ in range(n)]
        try:
            infos = start(ray, actors)
            if len({i["fingerprint"] for i in infos}) != 1:
                raise UsageError("workers loaded different models", hint="install the same model on every node")
            if on_start:
                on_start(infos)
            fingerprint, header = infos[0]["fingerprint"], infos[0]["header"]
            t0 = time.perf_counter()
            tokens = [0]  # prefilled so far, across workers

            def on_doc(outcome: IngestOutcome) -> None:
                tokens[0] += outcome.tokens
                if on_progress:
                    on_progress(1, tokens[0] / max(time.perf_counter() - t0, 1e-9))

            def tasks() -> Iterator[tuple[str, tuple]]:
                for doc in docs:
                    version = doc_version_for(doc, fingerprint, opts, header)
                    done = _committed_segments(store, doc.doc_id, version)
                    if done == [doc.doc_id]:
                        report.unchanged.append(doc.doc_id)
                        if on_progress:
                            on_progress(1, tokens[0] / max(time.perf_counter() - t0, 1e-9))
                        continue
                    yield doc.doc_id, (doc, done)

            def commit(batch: list[IngestOutcome]) -> None:
                store.commit_documents([(s.record, s.version) for o in batch for s in o.segments])
                for o in batch:
                    report.unchanged.extend(o.unchanged)
                    for s in o.segments:
                        report.add(s)

            drive(ray, actors, tasks(), lambda a, task: a.ingest.remote(*task), commit,
                  batch_size=batch_size, batch_seconds=batch_seconds, on_dispatch=on_dispatch, on_result=on_doc)
            report.seconds = time.perf_counter() - t0
        finally:
            for a in actors:
                ray.kill(a)
    return report
