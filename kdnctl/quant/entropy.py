"""ec: attention-weighted uniform quantization with entropy-coded codes (transform coding).

Fixed-rate groupwise codes (int4: 4 bits + 1 bit of fp16 scale/zero per element at groups of 32)
spend the same bits on every channel. What a stored K/V row must preserve is not its own
values but what attention does with them: a key error ``e`` moves a later query's logit by
``q . e``, a value error moves the head's output by ``W_o e``. So each channel gets its own step,
finer where queries (keys) or the output projection (values) are large (high-rate optimum for a
weighted squared error: step ~ 1 / sqrt(weight)), codes are unbounded integers (no clipping, no
per-group scale), and an entropy coder (zstd, whose literal Huffman stage reaches the codes'
order-0 entropy within a few percent) stores them. Channels the weights make irrelevant cost
almost nothing (their codes are nearly all 0). ``bench/ec_probe.py`` measured on real K/V: at
the query-weighted logit error of int4, keys take ~3.0 bits per element instead of int4's 5.0;
values at int4's W_o-weighted output error ~3.9 instead of 5.0.

Tensors per layer ``i`` and role (``keys``/``values``):

- ``layers.i.<role>.codes`` uint8 ``[n]``: one byte giving the code width (1: int8, 2: int16),
  then one zstd frame of the codes, channel-major (``[H, D, T]``: each channel's tokens adjacent).
- ``layers.i.<role>.params`` uint8 ``[n]``: one zstd frame of float16 ``step [H, D]`` then
  ``mean [H, D]`` (the channel's mean over the chunk, subtracted before quantizing).

And per chunk ``token_levels`` uint8 ``[T]``: token ``t`` is quantized with ``step / 2**level``
(the prompt header and the last tokens get finer steps: they precede every question).
Decoding: ``x[h, t, c] = code * step[h, c] / 2**level[t] + mean[h, c]``; keys are stored before
RoPE (``key_rope_theta``) and rotated back to their positions after decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdnctl.errors import BundleFormatError, InputError

from . import transforms as tf
from .base import Quantizer, check_kv, need

ROLES = ("keys", "values")
ZSTD_LEVEL = 3  # measured: higher levels gain < 1% on these codes at several times the time
MAX_LEVEL = 6  # finest token level (step / 64)


def _zstd():
    try:
        import zstandard
    except ImportError as exc:  # a core dependency; a broken install should say so plainly
        raise InputError("the 'zstandard' package is missing", hint="pip install zstandard") from exc
    return zstandard


def zstd_compress(data: bytes, level: int = ZSTD_LEVEL) -> bytes:
    return _zstd().ZstdCompressor(level=level).compress(data)


def zstd_decompress(blob: bytes, size: int, what: str) -> bytes:
    z = _zstd()
    try:
        out = z.ZstdDecompressor().decompress(blob, max_output_size=size)
    except z.ZstdError:
        raise BundleFormatError(f"{what} is not a valid zstd frame") from None
    if len(out) != size:
        raise BundleFormatError(f"{what} decodes to {len(out)} bytes, expected {size}")
    return out


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def quantize_codes(x: torch.Tensor, step: torch.Tensor, mean: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Integer codes (as float) of ``x [H, T, D]``: ``round((x - mean) / (step / 2**level))``."""
    div = step[:, None, :] / torch.pow(2.0, levels.float())[None, :, None]
    return torch.round((x - mean[:, None, :]) / div)


def dequantize_codes(codes: torch.Tensor, step: torch.Tensor, mean: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    div = step[:, None, :] / torch.pow(2.0, levels.float())[None, :, None]
    return codes * div + mean[:, None, :]


def encode_role(x: torch.Tensor, step: torch.Tensor, levels: torch.Tensor, zstd_level: int = ZSTD_LEVEL):
    """``(codes blob, params blob)`` of one role of one layer (``x [H, T, D]``, already
    transformed). ``step [H, D]`` is rounded to float16 first: what is stored is used."""
    step = step.to(torch.float16).float()
    mean = x.mean(1).to(torch.float16).float() if x.shape[1] else torch.zeros_like(step)
    codes = quantize_codes(x, step, mean, levels)
    lim = float(codes.abs().max()) if codes.numel() else 0.0
    if lim > 32767:
        raise InputError(f"a quantization step of {float(step.min()):.3g} is too fine for values up to "
                         f"{float(x.abs().max()):.3g}", hint="raise --budget's step floor (a larger budget)")
    width, dtype = (1, torch.int8) if lim <= 127 else (2, torch.int16)
    raw = codes.permute(0, 2, 1).contiguous().to(dtype).numpy().tobytes()
    blob = bytes([width]) + zstd_compress(raw, zstd_level)
    params = zstd_compress(torch.cat([step.half().flatten(), mean.half().flatten()]).numpy().tobytes(), zstd_level)
    return _u8(blob), _u8(params)


@dataclass
class EntropyQuantizer(Quantizer):
    """Per-channel steps in, entropy-coded codes out; the steps (the rate) come from the caller
    (``kdnctl.allocate.rate``), who weighs channels by attention and fits the byte budget."""

    name = "ec"
    key_rope_theta: float | None = None  # set: keys are quantized before RoPE
    zstd_level: int = ZSTD_LEVEL

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
            out[f"{role}.codes"], out[f"{role}.params"] = encode_role(x, step, levels, self.zstd_level)
        return out

    def meta(self, n_heads: int, d: int) -> dict:
        m = self.base_meta(torch.empty(0, 0, d), torch.empty(0, 0, d))
        m.pop("shapes")
        m.update(head_dim=d, n_heads=n_heads, key_rope_theta=self.key_rope_theta, coding="zstd")
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

    @classmethod
    def dequantize(cls, tensors, prefix, quant_meta):
        layer, role = prefix.rsplit(".", 1)
        h, d = quant_meta.get("n_heads"), quant_meta.get("head_dim")
        if not all(isinstance(x, int) and x > 0 for x in (h, d)):
            raise BundleFormatError("ec meta needs n_heads and head_dim")
        levels = tensors.get("token_levels", tensors.get(f"{layer}.levels"))
        if levels is None or levels.dtype != torch.uint8 or levels.dim() != 1:
            raise BundleFormatError(f"{layer}: token_levels must be uint8 [T]")
        levels = levels.cpu()
        if levels.numel() and int(levels.max()) > MAX_LEVEL:
            raise BundleFormatError(f"{layer}: a token level above {MAX_LEVEL}")
        t = levels.numel()
        codes, params = need(tensors, f"{prefix}.codes").cpu(), need(tensors, f"{prefix}.params").cpu()
        if codes.dtype != torch.uint8 or params.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() < 1:
            raise BundleFormatError(f"{prefix}: codes and params must be uint8 [n]")
        width = int(codes[0])
        if width not in (1, 2):
            raise BundleFormatError(f"{prefix}.codes has an unknown code width {width}")
        raw = zstd_decompress(codes[1:].numpy().tobytes(), width * h * d * t, f"{prefix}.codes")
        par = zstd_decompress(params.numpy().tobytes(), 4 * h * d, f"{prefix}.params")
        q = torch.frombuffer(bytearray(raw), dtype=torch.int8 if width == 1 else torch.int16) if raw \
            else torch.zeros(0, dtype=torch.int8)
        p = torch.frombuffer(bytearray(par), dtype=torch.float16).float().view(2, h, d)
        x = dequantize_codes(q.view(h, d, t).transpose(1, 2).float(), p[0], p[1], levels)
        theta = quant_meta.get("key_rope_theta")
        if role == "keys" and theta:
            pos = tensors.get(f"{layer}.positions")
            if pos is None:
                pos = need(tensors, "positions").unsqueeze(0).expand(h, -1)
            x = tf.rope(x, pos.cpu(), float(theta))
        return x.contiguous()
