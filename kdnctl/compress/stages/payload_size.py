"""The bytes ``ec`` codes take at one scale, counted without deflating: the scale fit's probes.

The encode stage fits one scale of the steps to the byte cap by probing scales (``kdnctl.allocate.rate``).
What a probe needs is only the size: the codes are quantized as the encoder quantizes them
(the same arithmetic, chunks of one length together), binned as it bins them, and the code
frames' deflated bytes are counted from their byte histograms (``kdnctl.kernels.ec.deflate_size``,
exact for zlib's Huffman-only blocks); only the small params frame of each blob is deflated.
At the fitted scale
:meth:`PayloadSize.blobs` deflates those same codes into the blobs the version stores (each
frame at its own width, every frame of a blob in one compiled call that writes zlib's bytes,
``kdnctl.kernels.ec.huffman_only``) and checks every blob against its count.

It applies where the encode stage codes every kept row of every layer in full (no backfilled,
narrowed or window layers), with deflate frames and a zlib that writes what the counts
describe; elsewhere :meth:`PayloadSize.for_job` returns None and the probes encode.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ...format.names import tensor_name
from ...kernels.ec import deflate_size
from ...quant.coders.deflate import deflate_compress
from ...quant.entropy import OWN_WIDTHS, SPREAD_BINS_PER_OCTAVE, as_u8, spread_bins
from ...quant.frames import frame_blob
from ...quant.grid import level_scales, quantize_centred, stored_step_mean
from . import quantize as qz
from .base import Job

ROLES = ("keys", "values")


class PayloadSize:
    """``size(alpha)``: the summed bytes of every chunk's codes and params blobs at scale
    ``alpha``, as ``codes_at(job, alpha, own_widths=False)`` would write them (None where a code
    would overflow: the encoder's own error then comes from a real encode)."""

    def __init__(self, job: Job):
        self.job = job
        self._seen: dict[float, list[dict[str, int]] | None] = {}
        # per layer and role, each chunk's stored mean (float16, as the blob keeps it) and its
        # bytes, and the chunks in groups of one length (quantized and binned together)
        by_len: dict[int, list[int]] = {}
        for c, (a, b) in enumerate(job.kept_bounds):
            by_len.setdefault(b - a, []).append(c)
        self.mean_bytes, self.groups = [], []
        for i in range(job.n_layers):
            mean_bytes, groups = [], []
            for x, levels in zip(job.xs[i], job.levels_by_role):
                means = [stored_step_mean(x[:, a:b], torch.ones(x.shape[0], x.shape[2]))[1] for a, b in job.kept_bounds]
                mean_bytes.append([m.half().numpy().tobytes() for m in means])
                # each group's rows less their chunk's mean, and its tokens' level scales: what
                # every probe's quantization shares
                groups.append([(idx, torch.stack([x[:, job.kept_bounds[c][0]:job.kept_bounds[c][1]] for c in idx])
                                - torch.stack([means[c] for c in idx])[..., None, :],
                                level_scales(torch.stack([levels[job.kept_bounds[c][0]:job.kept_bounds[c][1]]
                                                          for c in idx])))
                               for idx in by_len.values()])
            self.mean_bytes.append(mean_bytes)
            self.groups.append(groups)

    @classmethod
    def for_job(cls, job: Job) -> "PayloadSize | None":
        if job.quantizer.coding != "deflate" or job.backfill or job.wins or job.narrow:
            return None
        if not deflate_size.matches_zlib():
            return None
        return cls(job)

    def __call__(self, alpha: float) -> int | None:
        sizes = self.blob_sizes(alpha)
        return None if sizes is None else sum(n for chunk in sizes for n in chunk.values())

    def blob_sizes(self, alpha: float) -> list[dict[str, int]] | None:
        """Each chunk's blobs (``layers.i.<role>.codes``/``.params``) and their bytes at ``alpha``,
        in ``codes_at``'s order (kept for every scale asked: the fitted scale is one the fit
        probed, often not the last, and its counts check the blobs :meth:`blobs` writes)."""
        if alpha not in self._seen:
            with qz.one_torch_thread(), ThreadPoolExecutor(qz.ENCODE_WORKERS) as pool:
                layers = list(pool.map(lambda i: self._layer(alpha, i), range(self.job.n_layers)))
            if any(x is None for x in layers):
                self._seen[alpha] = None
            else:
                self._seen[alpha] = [{name: n for layer in layers for name, n in layer[c]}
                                     for c in range(len(self.job.kept_bounds))]
        return self._seen[alpha]

    def blobs(self, alpha: float) -> list[dict[str, torch.Tensor]] | None:
        """Every chunk's blobs at ``alpha`` as ``codes_at(job, alpha)`` writes them (frames of their
        own widths), from the same codes the counts come from; None where a code would overflow
        or where a blob's bytes are not the bytes counted for it (the counts then describe
        another encoder: the caller fits again from encodes)."""
        counted = self.blob_sizes(alpha)
        if counted is None:
            return None
        with qz.one_torch_thread(), ThreadPoolExecutor(qz.ENCODE_WORKERS) as pool:
            layers = list(pool.map(lambda i: self._layer_blobs(alpha, i, counted), range(self.job.n_layers)))
        if any(x is None for x in layers):
            return None
        return [{name: t for layer in layers for name, t in layer[c]} for c in range(len(self.job.kept_bounds))]

    def _coded(self, alpha: float, i: int, count: bool = True):
        """Layer ``i``'s roles at ``alpha``, a group of chunks of one length at a time, in
        ``codes_at``'s order per chunk: (the group's chunks, the role's index in ``ROLES``, blob name
        stem, codes ``[G, H, T, D]``,
        bins ``[G, H * D]``, each row's largest ``|code|`` ``[G, H * D]``, each chunk's counted
        bytes (``own_widths`` False; -1: a code beyond int16; not counted where not ``count``),
        the step's bytes)."""
        job = self.job
        for r, (x, step) in enumerate(zip(job.xs[i], qz.steps_at(job, alpha, i))):
            name = tensor_name(i, ROLES[r])
            step16 = step.to(torch.float16).float()
            basis = job.basis[i] if job.basis is not None and ROLES[r] == "keys" else None
            step_bytes = step16.half().numpy().tobytes()
            for idx, centred, scales in self.groups[i][r]:
                codes = quantize_centred(centred, step16, scales, basis)
                g, hd = codes.shape[0], codes.shape[1] * codes.shape[3]
                bins, peaks, exact = np.empty((g, hd), np.uint8), np.empty((g, hd), np.int64), np.empty(g, np.bool_)
                sizes = deflate_size.group_blob_bytes(codes.numpy(), bins, peaks, exact, SPREAD_BINS_PER_OCTAVE, count)
                for c in np.flatnonzero(~exact).tolist():  # a spread at a bin's edge: torch's rounding
                    bins[c] = spread_bins(codes[c]).flatten().numpy()
                    if count:
                        sizes[c] = deflate_size.codes_blob_bytes(codes[c].numpy(), bins[c], peaks[c], False)
                yield idx, r, name, codes, bins, peaks, sizes, step_bytes

    def _params(self, i: int, r: int, chunk: int, step_bytes: bytes, bins: np.ndarray) -> bytes:
        """The params frame of layer ``i``'s role ``r`` in ``chunk`` (step, mean, bins), deflated."""
        return deflate_compress(step_bytes + self.mean_bytes[i][r][chunk] + bins.tobytes(), huffman_only=False)

    def _layer(self, alpha: float, i: int) -> list[list[tuple[str, int]]] | None:
        """Per chunk, layer ``i``'s (blob name, bytes) in ``codes_at``'s order."""
        out = [[] for _ in self.job.kept_bounds]
        for idx, r, name, codes, bins, peaks, sizes, step_bytes in self._coded(alpha, i):
            if (sizes < 0).any():
                return None
            for g, c in enumerate(idx):
                params = self._params(i, r, c, step_bytes, bins[g])
                out[c] += [(f"{name}.codes", int(sizes[g])), (f"{name}.params", len(params))]
        return out

    def _layer_blobs(self, alpha: float, i: int, counted: list[dict[str, int]]
                     ) -> list[list[tuple[str, torch.Tensor]]] | None:
        """Per chunk, layer ``i``'s (blob name, blob) in ``codes_at``'s order; each codes blob's
        bytes checked against its count (``counted``: the blobs whose frames all take two bytes
        where a code needs them; a blob of one-byte codes is the same either way, the others
        are counted again at their own widths)."""
        out = [[] for _ in self.job.kept_bounds]
        for idx, r, name, codes, bins, peaks, _, step_bytes in self._coded(alpha, i, count=False):
            for g, c in enumerate(idx):
                lim = int(peaks[g].max()) if peaks[g].size else 0
                width = 1 if lim <= 127 else OWN_WIDTHS
                h, _, d = codes[g].shape
                blob = frame_blob(codes[g], torch.from_numpy(bins[g]).view(h, d), width)
                want = counted[c][f"{name}.codes"] if width == 1 else \
                    deflate_size.codes_blob_bytes(codes[g].numpy(), bins[g], peaks[g], True)
                if len(blob) != want:
                    return None
                params = self._params(i, r, c, step_bytes, bins[g])
                out[c] += [(f"{name}.codes", as_u8(blob)), (f"{name}.params", as_u8(params))]
        return out
