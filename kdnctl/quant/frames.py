"""ec's frames: how many codes a byte holds, and the frames of a role cut in numpy.

A frame holds the codes of one spread bin's channels (rows of ``T`` codes, ``(head, channel)``
ascending); where its codes lie in ``[-p, p]`` with ``(2p+1)**2 <= 256`` they are stored as
base-``2p+1`` digits, as many to a byte as fit (``kdnctl.quant.entropy`` has the layout).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kdnctl.kernels.ec.digits import codes_per_byte, frame_width  # noqa: F401  (re-exported: the encoder's names for them)


def frame_payloads(codes: torch.Tensor, bins: torch.Tensor, width: int) -> tuple[list[bytes], list[int]]:
    """(uncompressed frame bytes, peaks) of ``codes [H, T, D]`` (every row stored) grouped by
    ``bins [H, D]`` in a blob of ``width`` (``frame_width``): what :func:`encode_codes`
    compresses, in numpy over contiguous rows (one gather into bin order, then a slice per frame)."""
    h, t, d = codes.shape
    order = torch.argsort(bins.flatten(), stable=True)
    counts = torch.bincount(bins.flatten().long(), minlength=256)
    counts = counts[counts > 0].tolist()
    rows = codes.permute(0, 2, 1).reshape(h * d, t)[order]  # channel-major rows in bin order
    rows = rows.to(torch.int8 if width == 1 else torch.int16).numpy()
    row_peak = np.abs(rows.astype(np.int32)).max(1) if t else np.zeros(h * d, np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    peaks = np.maximum.reduceat(row_peak, starts).tolist() if len(counts) else []
    out = []
    for s, n, peak in zip(starts.tolist(), counts, peaks):
        per = codes_per_byte(peak)
        vals = rows[s:s + n].reshape(-1)
        if per == 0:
            out.append(b"")
        elif per == 1:
            out.append(vals.astype(np.int8 if frame_width(width, peak) == 1 else "<i2", copy=False).tobytes())
        else:
            out.append(pack_digits(vals, peak, per))
    return out, peaks


def pack_digits(vals: np.ndarray, peak: int, per: int) -> bytes:
    """:func:`pack_codes` in numpy: base-``2 peak + 1`` digits, ``per`` to a byte, least
    significant first (Horner's rule; every partial sum stays below the byte's value)."""
    radix, n = 2 * peak + 1, vals.size
    digits = np.zeros(-(-n // per) * per, np.uint8)
    digits[:n] = vals + peak
    digits = digits.reshape(-1, per)
    acc = digits[:, per - 1].copy()
    for k in range(per - 2, -1, -1):
        acc *= radix
        acc += digits[:, k]
    return acc.tobytes()


def frame_blob(codes: torch.Tensor, bins: torch.Tensor, width: int, compress: Callable[[bytes], bytes] | None = None) -> bytes:
    """The codes blob (header and frames) of :func:`encode_codes` where every row is stored: the
    frames cut by the compiled ``kdnctl.kernels.ec.frame_bytes`` (the bytes of
    :func:`frame_payloads`), each compressed from a view of its bytes by ``compress``, or where
    None deflated with Huffman coding only, every frame in one compiled call
    (``kdnctl.kernels.ec.huffman_only``: the bytes ``coders.deflate.deflate_compress`` writes)."""
    from kdnctl.kernels.ec.frame_bytes import frame_bytes

    buf, offsets, peaks = frame_bytes(codes.float().contiguous().numpy(), bins.flatten().to(torch.uint8).numpy(), width)
    if compress is None:
        from kdnctl.kernels.ec.huffman_only import deflate_frames

        data, ends = deflate_frames(buf, offsets)
        sizes, payload = np.diff(ends, prepend=0), data.tobytes()
    else:
        view, cuts = memoryview(buf), offsets.tolist()
        frames = [compress(view[a:b]) if b > a else b"" for a, b in zip(cuts, cuts[1:])]
        sizes, payload = [len(f) for f in frames], b"".join(frames)
    return bytes([width, len(sizes)]) + np.asarray(sizes, "<i4").tobytes() + np.asarray(peaks, "<i2").tobytes() + payload
