"""Worker actors: load the model once, then turn tasks into objects in the shared object
directory. They never open the LMDB catalog: they return records for the driver to commit.

Plain classes, so they run (and are tested) without Ray; ``ray.remote`` wraps them at run time.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field


def _setup(env: dict[str, str]) -> None:
    os.environ.update(env)


class _Worker:
    """A domain error while starting (no model, no shared object directory) is kept and raised
    by every call instead of killing the actor: Ray would report only "actor died", and a
    restart would fail the same way."""

    _error: BaseException | None = None

    def _check(self) -> None:
        if self._error is not None:
            raise self._error


@dataclass
class IngestOutcome:
    doc_id: str
    segments: list = field(default_factory=list)  # SegmentResult, objects written, not committed
    unchanged: list[str] = field(default_factory=list)
    seconds: float = 0.0
    worker: str = ""

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.segments)


class IngestWorker(_Worker):
    def __init__(self, model: str | None, dtype: str | None, device: str | None, objects_dir: str, tmp_dir: str,
                 opts: dict, env: dict[str, str]):
        _setup(env)
        from ..errors import KdnError
        from ..ingest import IngestOptions
        from ..models.load import load_model
        from ..ingest.prompting import PromptFormat
        from ..store import ObjectDir

        try:
            self.objects = ObjectDir(objects_dir, tmp_dir)
            self.lm = load_model(model, dtype=dtype, device=device)
        except KdnError as e:
            self._error = e
            return
        self.fmt = PromptFormat.for_tokenizer(self.lm.tokenizer)
        self.opts = IngestOptions(**opts)

    def describe(self) -> dict:
        self._check()
        return {"fingerprint": self.lm.fingerprint, "header": self.fmt.header, "pid": os.getpid(),
                "host": socket.gethostname(), "device": str(self.lm.model.device)}

    def ingest(self, doc, skip: list[str]) -> IngestOutcome:
        """Prefill every segment of ``doc`` not in ``skip`` (already committed at this version)."""
        from ..ingest import document_segments, write_segment

        self._check()
        t0 = time.perf_counter()
        out = IngestOutcome(doc.doc_id, worker=f"{socket.gethostname()}:{os.getpid()}")
        for seg in document_segments(self.lm, self.fmt, doc, self.opts):
            if seg.seg_id in skip:
                out.unchanged.append(seg.seg_id)
            else:
                res = write_segment(self.objects, self.lm, doc, seg, self.opts)
                self.objects.stamp_blake3(res.version.chunks)
                out.segments.append(res)
        out.seconds = time.perf_counter() - t0
        return out


@dataclass
class CompressOutcome:
    doc_id: str
    version: object  # VersionRecord, objects written, not committed
    source_bytes: int
    bytes: int
    seconds: float
    score_seconds: float
    worker: str = ""


class CompressWorker(_Worker):
    def __init__(self, model: str | None, needs_model: bool, device: str | None, objects_dir: str, tmp_dir: str,
                 env: dict[str, str]):
        _setup(env)
        from ..errors import KdnError
        from ..models.load import load_model
        from ..store import ObjectDir

        try:
            self.objects = ObjectDir(objects_dir, tmp_dir)
            self.lm = load_model(model, device=device) if needs_model else None
        except KdnError as e:
            self._error = e

    def describe(self) -> dict:
        self._check()
        return {"fingerprint": self.lm.fingerprint if self.lm is not None else None, "pid": os.getpid(),
                "host": socket.gethostname()}

    def calibrate_basis(self, texts: list[str]) -> tuple[bytes, int, int]:
        """The model's key basis file calibrated on ``texts`` (kdnctl/quant/store_basis.py)."""
        from kdnctl.quant.store_basis import basis_file

        self._check()
        return basis_file(self.lm, texts)

    def measure_profile(self, versions) -> tuple[bytes | None, str]:
        """The model's Fisher profile file measured on ``versions``' caches (kdnctl/compress/layer_profile.py)."""
        from kdnctl.compress.layer_profile import measure

        self._check()
        return measure(self.objects, self.lm, versions)

    def compress(self, src, recipe, label: str, source: str, basis: bytes | None = None,
                 profile: bytes | None = None) -> CompressOutcome:
        from ..allocate.fisher_profile import decode, model_profile
        from ..compress.document import build_compressed_version

        self._check()
        from kdnctl.format.key_basis import model_basis, provide

        t0 = time.perf_counter()
        fingerprint = self.lm.fingerprint if self.lm is not None else None
        # the store's key basis and Fisher profile for this model come with every task (a restarted
        # worker has them too)
        with model_basis(fingerprint, provide(basis) if basis is not None and fingerprint else None), \
                model_profile(fingerprint, decode(profile, "the store's Fisher profile") if profile is not None else None):
            record, score_s = build_compressed_version(self.objects, src, recipe, label, source,
                                                       lm=self.lm, fingerprint=fingerprint)
        self.objects.stamp_blake3(record.chunks)
        return CompressOutcome(src.doc_id, record, src.nbytes, record.nbytes, time.perf_counter() - t0, score_s,
                               f"{socket.gethostname()}:{os.getpid()}")
