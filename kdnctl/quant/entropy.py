"""ec: attention-weighted uniform quantization with entropy-coded codes (transform coding).

Fixed-rate groupwise codes (int4: 4 bits + 1 bit of fp16 scale/zero per element at groups of 32)
spend the same bits on every channel. What a stored K/V row must preserve is not its own
values but what attention does with them: a key error ``e`` moves a later query's logit by
``q . e``, a value error moves the head's output by ``W_o e``. So each channel gets its own step,
finer where queries (keys) or the output projection (values) are large (high-rate optimum for a
weighted squared error: step ~ 1 / sqrt(weight)), codes are unbounded integers (no clipping, no
per-group scale), and an entropy coder stores them: raw deflate with Huffman coding only
(zlib's ``Z_HUFFMAN_ONLY``, ``meta["quant"]["coding"] = "deflate"``, format 1.6): the codes are
noise to a string matcher, and zstd (the coder before 1.6, still read) spends more on the same
frames: whole objects are 3.6% smaller at the 0.25 default and 6.8% at 0.083, and decode as fast
(``research/probes/ec_coders.py``, ``research/results/ec-bits/coders.md``).
Channels the weights make irrelevant cost almost nothing (their codes are nearly all 0).
``research/probes/ec_probe.py`` measured on real K/V (zstd frames): at the query-weighted logit error of
int4, keys take ~3.0 bits per element instead of int4's 5.0; values at int4's W_o-weighted
output error ~3.9 instead of 5.0.

Tensors per layer ``i`` and role (``keys``/``values``):

- ``layers.i.<role>.codes`` uint8 ``[n]``: the code width (1: int8; 3: each frame int8 where
  its peak is at most 127, else int16, format 1.11; 2: every frame int16, before 1.11), the number of
  frames F, F int32 frame sizes, F int16 peaks (largest ``|code|`` of the frame), then F frames
  (deflate; zstd before 1.6): the channels (rows of ``T`` codes) of each spread bin in bin order,
  ``(head, channel)``-ascending within a bin. A frame whose codes lie in ``[-p, p]`` with
  ``(2p+1)**2 <= 256`` stores them as base-``2p+1`` digits, as many to a byte as fit (a Huffman
  coder spends at least a bit per symbol; grouped codes can cost less); peak 0 stores nothing.
- ``layers.i.<role>.params`` uint8 ``[n]``: one frame (deflate, default strategy; zstd before
  1.6) of float16 ``step [H, D]``, float16 ``mean [H, D]`` (the channel's mean over the chunk,
  subtracted before quantizing) and uint8 ``bin [H, D]``.

And per chunk ``token_levels`` uint8 ``[T]``: token ``t`` is quantized with ``step / 2**level``
(the prompt header and the last tokens get finer steps: they precede every question); where
layers keep different token sets (``--backfill``), each layer's own ``layers.i.levels``, and
where keys and values of a layer are shifted apart (``--backfill-key-shift``), each role's own
``layers.i.<role>.levels``.
Decoding: ``x[h, t, c] = code * step[h, c] / 2**level[t] + mean[h, c]``; keys are stored before
RoPE (``key_rope_theta``) and rotated back to their positions after decoding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kdnctl.format.names import role_levels, stored_rows
from kdnctl.errors import BundleFormatError, InputError

from . import transforms as tf
from .base import Quantizer, check_kv, need
from ..format.key_basis import basis_on
from .coders import CODERS
from .frames import codes_per_byte, frame_blob, frame_width  # noqa: F401 (codes_per_byte: re-exported)
from ..kernels.ec.digits import OWN_WIDTHS
from .grid import dequantize_codes, quantize_codes, roundtrip_role, stored_step_mean  # noqa: F401 (re-exported)

ROLES = ("keys", "values")
CODINGS = tuple(CODERS)  # "deflate" is written; "zstd" is read (bundles before format 1.6)
DEFAULT_CODING = "deflate"
MAX_LEVEL = 6  # finest token level (step / 64)


def compress_frame(data: bytes, coding: str, codes: bool = True) -> bytes:
    if coding not in CODERS:
        raise InputError(f"unknown ec coding {coding!r}", hint=f"one of {', '.join(CODINGS)}")
    return CODERS[coding].compress(data, codes)


def decompress_frame(blob: bytes, size: int, what: str, coding: str) -> bytes:
    if coding not in CODERS:
        raise BundleFormatError(f"{what}: unknown coding {coding!r} (this kdnctl reads {', '.join(CODINGS)})")
    return CODERS[coding].decompress(blob, size, what)


def as_u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def pack_codes(codes: torch.Tensor, peak: int, per: int) -> bytes:
    """Codes (flat) as base-``2 peak + 1`` digits, ``per`` to a byte, least significant first."""
    radix = 2 * peak + 1
    n = codes.numel()
    digits = torch.zeros(-(-n // per) * per, dtype=torch.int64)
    digits[:n] = codes.long() + peak
    digits = digits.view(-1, per) * (radix ** torch.arange(per, dtype=torch.int64))
    return digits.sum(1).to(torch.uint8).numpy().tobytes()


def unpack_codes(data, n: int, peak: int, per: int, what: str) -> np.ndarray:
    """int8 codes (flat, ``n``) of a frame of base-``2 peak + 1`` digits, ``per`` to a byte."""
    radix = 2 * peak + 1
    b = np.frombuffer(data, dtype=np.uint8)
    if b.size * per < n or (b.size and int(b.max()) >= radix ** per):
        raise BundleFormatError(f"{what}: packed codes out of range")
    return _digit_table(peak, per)[b].reshape(-1)[:n]


@functools.lru_cache(maxsize=64)
def _digit_table(peak: int, per: int) -> np.ndarray:
    """``[256, per]`` int8 codes of every byte value (a gather beats integer division per code;
    packing needs ``(2 peak + 1)**2 <= 256``, so every digit fits an int8)."""
    radix = 2 * peak + 1
    return ((np.arange(256)[:, None] // radix ** np.arange(per)) % radix - peak).astype(np.int8)


# Spread bins per octave of spread. One bin per octave stores what two did (within 0.1% of the
# bytes: the Huffman coder needs no finer grouping) in fewer frames, and a frame's inflate costs
# about as much for its tables as for its bytes (research/results/rans-frames-2026-12-02/). The
# decoder reads a bin as a label, so any bin width decodes.
SPREAD_BINS_PER_OCTAVE = 1


def spread_bins(codes: torch.Tensor, stored: torch.Tensor | None = None, per_octave: int | None = None) -> torch.Tensor:
    """``[H, D]`` uint8 bin of every channel of ``codes [H, T, D]``: ``per_octave`` times the
    log2 of its spread in steps, rounded (channels whose codes are alike share one entropy
    coder's table), over the ``stored`` rows (bool ``[H, T]``) where only those are coded.
    Without ``stored``, ``codes`` may have leading dimensions (chunks of one length:
    ``[C, H, T, D]`` -> ``[C, H, D]``, each channel's spread reduced as alone). ``per_octave``:
    ``SPREAD_BINS_PER_OCTAVE`` where None."""
    per_octave = SPREAD_BINS_PER_OCTAVE if per_octave is None else per_octave
    if codes.shape[-2] == 0:  # a chunk whose tokens were all evicted: one bin, no codes
        return torch.full(codes.shape[:-2] + codes.shape[-1:], 4, dtype=torch.uint8)
    if stored is not None:
        w, c = stored.unsqueeze(2).float(), codes.float()
        n = w.sum(1).clamp_min(1)
        spread = (((c - ((c * w).sum(1) / n).unsqueeze(1)) ** 2 * w).sum(1) / n).sqrt()
    else:
        spread = codes.float().std(-2, unbiased=False) if codes.shape[-2] > 1 else codes.float().abs().amax(-2)
    return torch.round(torch.log2(spread + 0.25) * per_octave).clamp(-4, 40).add(4).to(torch.uint8)


def encode_role(x: torch.Tensor, step: torch.Tensor, levels: torch.Tensor, coding: str = DEFAULT_CODING,
                compress: Callable[[bytes], bytes] | None = None, basis: torch.Tensor | None = None,
                stored: torch.Tensor | None = None, mean: torch.Tensor | None = None, own_widths: bool = True):
    """``(codes blob, params blob)`` of one role of one layer (``x [H, T, D]``, already
    transformed). ``step [H, D]`` is rounded to float16 first: what is stored is used.
    ``compress`` (bytes -> bytes) replaces the coder of the code frames, for measuring
    other coders on the same frames (``research/probes/rate_probe.py``); bundles use ``coding``.
    ``basis [H, D, D]``: code in these axes (:func:`quantize_codes`). ``stored`` (bool ``[H, T]``):
    only these rows are coded (the others decode to the mean). ``mean [H, D]``: the grid's
    centre, default ``x``'s mean (``kdnctl.compress.feedback`` rounds to a grid of its own first).
    ``own_widths``: see :func:`encode_codes`."""
    step, mean = stored_step_mean(x, step, mean)
    codes = quantize_codes(x, step, mean, levels, basis)
    lim = float(codes.abs().max()) if codes.numel() else 0.0
    if lim > 32767:
        raise InputError(f"a quantization step of {float(step.min()):.3g} is too fine for values up to "
                         f"{float(x.abs().max()):.3g}", hint="use a smaller --budget or --quant auto")
    blob, bins = encode_codes(codes, coding, compress, stored, own_widths=own_widths)
    return blob, encode_params(step, mean, bins, coding)


def encode_params(step: torch.Tensor, mean: torch.Tensor, bins: torch.Tensor, coding: str = DEFAULT_CODING) -> torch.Tensor:
    """The params blob: one frame of float16 ``step``, float16 ``mean`` (``[H, D]``), uint8 ``bins``."""
    raw = torch.cat([step.half().flatten(), mean.half().flatten()]).numpy().tobytes() + bins.numpy().tobytes()
    return as_u8(compress_frame(raw, coding, codes=False))


def encode_codes(codes: torch.Tensor, coding: str = DEFAULT_CODING, compress: Callable[[bytes], bytes] | None = None,
                 stored: torch.Tensor | None = None, reference: bool = False, own_widths: bool = True):
    """``(codes blob, bins [H, D])`` of integer ``codes [H, T, D]`` (as float, within int16), of
    the ``stored`` rows only (bool ``[H, T]``) where given. Every row stored: the frames are cut
    by :func:`frame_blob` (numpy, the same bytes); ``reference`` (or ``stored``) takes the plain
    loop below, the spec it is tested against. Where a code needs two bytes, each frame takes its
    own width (``OWN_WIDTHS``, format 1.11), or with ``own_widths`` False every frame two (the
    blob before 1.11: the same codes in more bytes).

    The channels are grouped by the spread of their codes (:func:`spread_bins`) and each group is
    one frame: one Huffman table over channels whose steps differ by orders of magnitude
    spends ~0.9 bits per element more than their entropy (``research/probes/ec_probe.py``)."""
    h, t, d = codes.shape
    lim = float(codes.abs().max()) if codes.numel() else 0.0
    width = 1 if lim <= 127 else OWN_WIDTHS if own_widths else 2
    bins = spread_bins(codes, stored)
    if stored is None and not reference:
        if compress is None and coding == "deflate":  # (zlib's Huffman-only bytes, compiled)
            return as_u8(frame_blob(codes, bins, width)), bins
        return as_u8(frame_blob(codes, bins, width, compress or (lambda data: compress_frame(data, coding)))), bins
    flat = codes.permute(0, 2, 1).reshape(h * d, t)  # channel-major rows
    keep = None if stored is None else stored.repeat_interleave(d, 0)  # [H * D, T]
    order = torch.argsort(bins.flatten(), stable=True)
    ids, counts = torch.unique_consecutive(bins.flatten()[order], return_counts=True)
    frames, peaks, o = [], [], 0
    for n in counts.tolist():
        idx = order[o:o + n]
        rows = flat[idx].reshape(-1) if keep is None else flat[idx][keep[idx]]
        peak = int(rows.abs().max()) if rows.numel() else 0
        per = codes_per_byte(peak)
        dtype = torch.int8 if frame_width(width, peak) == 1 else torch.int16
        data = b"" if per == 0 else pack_codes(rows, peak, per) if per > 1 else rows.to(dtype).numpy().tobytes()
        frames.append((compress(data) if compress else compress_frame(data, coding)) if data else b"")
        peaks.append(peak)
        o += n
    sizes = torch.tensor([len(f) for f in frames], dtype=torch.int32)
    blob = bytes([width, len(frames)]) + sizes.numpy().tobytes() + \
        torch.tensor(peaks, dtype=torch.int16).numpy().tobytes() + b"".join(frames)
    return as_u8(blob), bins


def decode_params(params: torch.Tensor, h: int, d: int, what: str, coding: str = DEFAULT_CODING):
    """``(step, mean)`` float32 ``[H, D]`` and ``bins`` uint8 ``[H * D]`` of a params blob."""
    par = decompress_frame(params.numpy(), 5 * h * d, f"{what}.params", coding)
    p = torch.from_numpy(np.frombuffer(par, dtype=np.float16, count=2 * h * d).astype(np.float32)).view(2, h, d)
    return p[0], p[1], torch.from_numpy(np.frombuffer(par, dtype=np.uint8, offset=4 * h * d).copy())


def decode_role_ints(codes: torch.Tensor, params: torch.Tensor, h: int, d: int, t: int, what: str,
                     coding: str = DEFAULT_CODING, stored: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The entropy-decoding half of :func:`decode_role` (host work: inflate, unpack, reorder):
    integer codes ``[H * D, T]`` (channel-major; int8 where the role's codes are one byte wide,
    else int16) and float32 ``step``, ``mean`` ``[H, D]``. Integers are what a GPU load ships:
    a half or a quarter of the float32 bytes, dequantized on the device. The bookkeeping is
    numpy (a load runs this 60 times per chunk; torch's per-call overhead was most of it).
    ``stored`` (bool ``[H, T]``): the frames hold these rows only, the others are 0."""
    if codes.dtype != torch.uint8 or params.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() < 2:
        raise BundleFormatError(f"{what}: codes and params must be uint8 [n]")
    raw = memoryview(codes.numpy())  # frames are sliced out without copies
    width, n_frames = raw[0], raw[1]
    if width not in (1, 2, OWN_WIDTHS):
        raise BundleFormatError(f"{what}.codes has an unknown code width {width}")
    step, mean, bins = decode_params(params, h, d, what, coding)
    order = np.argsort(bins.numpy(), kind="stable")
    counts = np.bincount(bins.numpy())
    counts = counts[counts > 0].tolist()
    head = 2 + 6 * n_frames
    if len(counts) != n_frames or len(raw) < head:
        raise BundleFormatError(f"{what}.codes holds {n_frames} frames, its bins need {len(counts)}")
    sizes = np.frombuffer(raw, dtype="<i4", count=n_frames, offset=2).tolist()
    peaks = np.frombuffer(raw, dtype="<i2", count=n_frames, offset=2 + 4 * n_frames).tolist()
    if any(s < 0 for s in sizes) or any(p < 0 for p in peaks) or head + sum(sizes) != len(raw):
        raise BundleFormatError(f"{what}.codes: its frame sizes do not add up")
    ints = np.zeros((h * d, t), dtype=np.int8 if width == 1 else np.int16)
    keep = None if stored is None else np.repeat(stored.numpy().astype(bool), d, axis=0)  # [H * D, T]
    o, pos = 0, head
    for n, size, peak in zip(counts, sizes, peaks):  # each bin's channels, in bin order
        per, rows = codes_per_byte(peak), order[o:o + n]
        m = n * t if keep is None else int(keep[rows].sum())  # the codes the frame holds
        if per:
            fw = frame_width(width, peak)
            n_bytes = -(-m // per) if per > 1 else fw * m
            frame = decompress_frame(raw[pos:pos + size], n_bytes, f"{what}.codes", coding) if m else b""
            vals = unpack_codes(frame, m, peak, per, what) if per > 1 else \
                np.frombuffer(frame, dtype=np.int8 if fw == 1 else np.dtype("<i2"))
            if keep is None:
                ints[rows] = vals.reshape(n, t)
            else:  # the stored rows of the frame's channels, in order
                r, c = np.nonzero(keep[rows])
                ints[rows[r], c] = vals
        elif size:
            raise BundleFormatError(f"{what}.codes: an all-zero frame holds bytes")
        o, pos = o + n, pos + size
    return torch.from_numpy(ints), step, mean


def dequantize_ints(ints: torch.Tensor, step: torch.Tensor, mean: torch.Tensor, levels: torch.Tensor,
                    h: int, d: int, basis: torch.Tensor | None = None) -> torch.Tensor:
    """Integer codes ``[L, H * D, T]`` -> float32 ``[L, H, T, D]`` (``step``/``mean`` ``[L, H, D]``,
    ``levels`` ``[L, T]``, ``basis`` None or ``[L, H, D, D]``), on whatever device the inputs
    are: :func:`dequantize_codes` for several layers at once."""
    n_layers, t = ints.shape[0], ints.shape[-1]
    return dequantize_codes(ints.view(n_layers, h, d, t).transpose(2, 3).float(), step, mean, levels, basis)


def decode_role(codes: torch.Tensor, params: torch.Tensor, h: int, d: int, levels: torch.Tensor, what: str,
                coding: str = DEFAULT_CODING, basis: torch.Tensor | None = None, stored: torch.Tensor | None = None):
    """Inverse of :func:`encode_role` (before the inverse transform): float32 ``[H, T, D]``."""
    ints, step, mean = decode_role_ints(codes, params, h, d, levels.numel(), what, coding, stored)
    return dequantize_ints(ints[None], step[None], mean[None], levels[None], h, d,
                           None if basis is None else basis[None])[0]


def integer_codes(codes: torch.Tensor, params: torch.Tensor, h: int, d: int, levels: torch.Tensor, what: str,
                  coding: str = DEFAULT_CODING, basis: torch.Tensor | None = None,
                  stored: torch.Tensor | None = None) -> torch.Tensor:
    """The integer codes ``[H, T, D]`` (as float) of one stored role, recovered from its decoded
    values (for re-framing the same codes: ``research/probes/ec_bits.py``, ``research/probes/ec_coders.py``)."""
    x = decode_role(codes, params, h, d, levels, what, coding, basis, stored)
    step, mean, _ = decode_params(params, h, d, what, coding)
    return quantize_codes(x, step, mean, levels, basis)


@dataclass
class EntropyQuantizer(Quantizer):
    """Per-channel steps in, entropy-coded codes out; the steps (the rate) come from the caller
    (``kdnctl.allocate.rate``), who weighs channels by attention and fits the byte budget."""

    name = "ec"
    key_rope_theta: float | None = None  # set: keys are quantized before RoPE
    coding: str = DEFAULT_CODING  # "zstd" only to measure against bundles before format 1.6
    key_basis: str | None = None  # sha256 of the per-model key basis (kdnctl.format.key_basis) the keys are coded in

    def forward(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        k = tf.unrope(keys, positions, self.key_rope_theta) if self.key_rope_theta else keys.float()
        return k, values.float()

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, steps: tuple[torch.Tensor, torch.Tensor],
                     levels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors (relative names) of one layer from transformed ``k``/``v`` (see :meth:`forward`)."""
        h, t, d = k.shape
        if levels.shape != (t,) or any(tuple(s.shape) != (h, d) for s in steps):
            raise InputError(f"steps must be [{h}, {d}] and levels [{t}]")
        out: dict[str, torch.Tensor] = {}
        for role, x, step in zip(ROLES, (k, v), steps):
            out[f"{role}.codes"], out[f"{role}.params"] = encode_role(x, step, levels, self.coding)
        return out

    def meta(self, n_heads: int, d: int) -> dict:
        m = self.base_meta(torch.empty(0, 0, d), torch.empty(0, 0, d))
        m.pop("shapes")
        m.update(head_dim=d, n_heads=n_heads, key_rope_theta=self.key_rope_theta, coding=self.coding)
        if self.key_basis:  # absent, not null: bundles before format 1.7 read the same
            m["key_basis"] = self.key_basis
        return m

    def quantize_layer(self, keys, values, *, importance=None, positions=None, steps=None, levels=None):
        """The common quantizer interface: ``steps`` default to a relative step of 0.25 of
        each channel's spread (no attention weights), ``levels`` to 0."""
        check_kv(keys, values, self.scale_dtype)
        h, t, d = keys.shape
        if positions is None:
            positions = torch.arange(t).expand(h, t)
        k, v = self.forward(keys, values, positions)
        if steps is None:
            steps = tuple((0.25 * x.std(1, unbiased=False)).clamp_min(1e-4) for x in (k, v))
        if levels is None:
            levels = torch.zeros(t, dtype=torch.uint8)
        return {**self.encode_layer(k, v, steps, levels), "levels": levels.to(torch.uint8)}, self.meta(h, d)

    @staticmethod
    def host_decode(tensors, prefix: str, quant_meta: dict):
        """Host half of decoding one role of one layer (``layers.i.keys``): its checked integer
        codes, step, mean and levels, and the positions RoPE needs (None: values, or keys
        stored after RoPE; a ``[T]`` tensor: the chunk's; ``[H, T]``: the layer's own)."""
        layer, role = prefix.rsplit(".", 1)
        h, d = quant_meta.get("n_heads"), quant_meta.get("head_dim")
        if not all(isinstance(x, int) and x > 0 for x in (h, d)):
            raise BundleFormatError("ec meta needs n_heads and head_dim")
        levels = role_levels(tensors, layer, role)
        if levels is None or levels.dtype != torch.uint8 or levels.dim() != 1:
            raise BundleFormatError(f"{layer}: token_levels must be uint8 [T]")
        levels = levels.cpu()
        if levels.numel() and int(levels.max()) > MAX_LEVEL:
            raise BundleFormatError(f"{layer}: a token level above {MAX_LEVEL}")
        coding = quant_meta.get("coding", "zstd")  # bundles before 1.6 may predate the key; the frames refuse others
        stored = stored_rows(tensors, layer)
        ints, step, mean = decode_role_ints(need(tensors, f"{prefix}.codes").cpu(), need(tensors, f"{prefix}.params").cpu(),
                                            h, d, levels.numel(), prefix, coding, None if stored is None else stored.cpu())
        pos = None
        if role == "keys" and quant_meta.get("key_rope_theta"):
            pos = tensors.get(f"{layer}.positions")
            pos = need(tensors, "positions") if pos is None else pos
        return ints, step, mean, levels, pos

    @classmethod
    def dequantize(cls, tensors, prefix, quant_meta):
        return cls._dense(tensors, [prefix], quant_meta, torch.device("cpu"))[0].contiguous()

    @classmethod
    def dequantize_into(cls, out: torch.Tensor, tensors, prefixes: list[str], quant_meta: dict,
                        block: int | None = None) -> None:
        """Several layers of one role (``prefixes``, e.g. ``layers.i.keys``) into ``out [L, H, T,
        D]`` (a cache slice, any float dtype, any device): the codes are entropy-decoded on the
        host, and the integers (1-2 bytes per element instead of float32's 4) go to ``out``'s
        device. On a GPU every layer is dequantized and RoPE'd in one stacked pass (a few
        launches per chunk); on a CPU one layer at a time, so its floats stay in the cache
        (``block``: layers per pass, to test either way on any device)."""
        block = block or (len(prefixes) if out.device.type != "cpu" else 1)
        for i in range(0, len(prefixes), block):
            x = cls._dense(tensors, prefixes[i:i + block], quant_meta, out.device)
            if tuple(x.shape) != tuple(out[i:i + block].shape):
                raise BundleFormatError(f"{prefixes[i]}: shape {list(x.shape[1:])} does not fit its cache slot "
                                        f"{list(out.shape[1:])}")
            out[i:i + block].copy_(x)

    @classmethod
    def _dense(cls, tensors, prefixes: list[str], quant_meta: dict, device: torch.device) -> torch.Tensor:
        """float32 ``[L, H, T, D]`` of ``prefixes`` (one role) on ``device``."""
        parts = [cls.host_decode(tensors, p, quant_meta) for p in prefixes]
        h, d = quant_meta["n_heads"], quant_meta["head_dim"]
        if len({p[0].shape for p in parts}) != 1:
            raise BundleFormatError(f"{prefixes[0]}..: layers hold different numbers of tokens; load them one by one")
        wide = len({p[0].dtype for p in parts}) > 1  # one-byte and two-byte layers: stack as int16
        ints = torch.stack([p[0].to(torch.int16) if wide else p[0] for p in parts])
        step, mean, levels = (torch.stack([p[i] for p in parts]) for i in (1, 2, 3))
        ints, step, mean, levels = (y.to(device, non_blocking=True) for y in (ints, step, mean, levels))
        x = dequantize_ints(ints, step, mean, levels, h, d, cls._basis(prefixes, quant_meta, h, d, device))
        positions = [p[4] for p in parts]
        if positions[0] is None:
            return x
        n_layers, t = x.shape[0], x.shape[2]
        if all(p.dim() == 1 for p in positions) and all(p is positions[0] for p in positions):
            pos = positions[0]  # the chunk's: one table for every layer and head
        else:
            pos = torch.stack([p if p.dim() == 2 else p.unsqueeze(0).expand(h, -1) for p in positions]).view(n_layers * h, t)
        theta = float(quant_meta["key_rope_theta"])
        return tf.rope(x.view(n_layers * h, t, d), pos.cpu(), theta).view(n_layers, h, t, d)

    @staticmethod
    def _basis(prefixes: list[str], quant_meta: dict, h: int, d: int, device: torch.device) -> torch.Tensor | None:
        """``[L, H, D, D]`` key axes of ``prefixes``' layers, or None (values; keys in channels)."""
        sha = quant_meta.get("key_basis")
        if sha is None or not prefixes[0].endswith(".keys"):
            return None
        basis = basis_on(sha, str(device))
        layers = [int(p.split(".")[1]) for p in prefixes]
        if tuple(basis.shape[1:]) != (h, d, d) or max(layers) >= basis.shape[0]:
            raise BundleFormatError(f"key basis {sha[:12]} is {list(basis.shape)}, the bundle needs "
                                    f"[>{max(layers)}, {h}, {d}, {d}]")
        return basis[layers[0]:layers[-1] + 1] if layers == list(range(layers[0], layers[-1] + 1)) else basis[layers]
