"""Plain-torch groupwise KV quantization (KIVI layout): the CPU path and the ground truth that
the Triton kernels in ``triton.py`` must match (codes bit-exact, floats within tolerance).

Layouts over a ``[H, T, D]`` tensor:

- ``"channel"`` (keys): one group = ``group_size`` consecutive tokens of one channel ``d``.
  Keys carry per-channel outliers, so grouping along T keeps an outlier channel from inflating
  the scale of normal channels. q ``[H, Nq, D]``, scale/zero ``[H, ceil(T/G), D]``.
- ``"token"`` (values): one group = ``group_size`` consecutive channels of one token.
  q ``[H, T, Nq]``, scale/zero ``[H, T, ceil(D/G)]``.

``Nq`` is the grouped-axis length ``n`` (int8, fp8) or ``ceil(n / 2)`` for int4, which packs two
codes per byte along the grouped axis, low nibble = even index. int2 packs four codes per byte
(code ``j`` of a quad in bits ``2j..2j+1``): ``Nq = ceil(n / 4)``. int3 is stored as two bit
planes along the grouped axis: the low two bits of every code packed as int2 (``ceil(n / 4)``
bytes), then the high bit of every code, eight per byte (bit ``j`` = code ``8m + j``,
``ceil(n / 8)`` bytes): ``Nq = ceil(n / 4) + ceil(n / 8)``, exactly 3 bits per code, and no code
straddles a byte. int2/int3 need a group size divisible by 8 so a group owns whole bytes. Codes are stored only for real
elements (the padding of the last group is not stored); a short last group is edge-padded with
its last real element, which leaves min/max - hence scale/zero - unchanged. For odd ``n`` the
unused high nibble of the last int4 byte is 0. The original shape must be passed to dequantize.

Formats (``x ~ code * scale + zero``):

- ``int8``/``int4``/``int3``/``int2``: asymmetric, ``code = floor((x - zero) / scale + 0.5)`` clamped to
  ``[0, 2**bits - 1]``. floor(v + 0.5) instead of torch.round so Triton (no round-half-even
  primitive) computes identical codes.
- ``fp8``: ``code = e4m3fn((x - zero) / scale)`` with ``zero`` the group's mid-range and
  ``scale = half-range / 448``; codes stored as the uint8 bit pattern (portable in safetensors).

scale/zero dtype: float16 by default (halves the per-group overhead vs float32). Plain rounding
to float16 would break the error bound when a group spans a narrow range far from 0 (a key
channel at 100 +- 0.5: float16 spacing there is 0.06, far above int8's step of 0.004), so for
int formats zero is rounded DOWN and scale UP to float16, and codes are computed from the
rounded values: every element then still maps into ``[0, qmax]`` and ``|x - x_hat| <= scale/2``
(+ float32 rounding) holds with the stored scale. float32 storage is available for inputs whose
range exceeds float16 (|x| > 65504).
"""

from __future__ import annotations

import math

import torch

FORMATS = ("int8", "int4", "int3", "int2", "fp8")
LAYOUTS = ("channel", "token")
SCALE_DTYPES = (torch.float16, torch.float32)
QMAX = {"int8": 255, "int4": 15, "int3": 7, "int2": 3}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_args(fmt: str, group_size: int, layout: str, scale_dtype: torch.dtype) -> None:
    """Shared argument validation (reference and Triton take the same arguments)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quant format {fmt!r}; expected one of {FORMATS}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    # int4 pairs never straddle a group only if groups hold an even count.
    if fmt == "int4" and group_size % 2:
        raise ValueError(f"int4 needs an even group_size, got {group_size}")
    if fmt in ("int3", "int2") and group_size % 8:
        raise ValueError(f"{fmt} needs a group_size divisible by 8, got {group_size}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be float16 or float32, got {scale_dtype}")


def grouped_len(shape: tuple[int, ...] | torch.Size, layout: str) -> int:
    """Length of the grouped axis: T for per-channel keys, D for per-token values."""
    return int(shape[1] if layout == "channel" else shape[2])


def packed_len(n: int, fmt: str) -> int:
    if fmt == "int4":
        return (n + 1) // 2
    if fmt == "int2":
        return (n + 3) // 4
    if fmt == "int3":
        return (n + 3) // 4 + (n + 7) // 8
    return n


def out_shapes(shape, fmt: str, group_size: int, layout: str):
    """(q shape, scale/zero shape) for an ``[H, T, D]`` input."""
    h, t, d = (int(s) for s in shape)
    n = grouped_len(shape, layout)
    nq, ng = packed_len(n, fmt), math.ceil(n / group_size)
    if layout == "channel":
        return (h, nq, d), (h, ng, d)
    return (h, t, nq), (h, t, ng)


# ---- int4 packing --------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack uint8 codes in [0, 15] two per byte along ``dim`` (low nibble = even index)."""
    c = codes.to(torch.uint8).movedim(dim, -1)
    if c.shape[-1] % 2:
        c = torch.cat([c, c.new_zeros(*c.shape[:-1], 1)], dim=-1)
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_int4`; ``n`` is the unpacked length along ``dim``."""
    p = packed.movedim(dim, -1)
    c = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return c[..., :n].movedim(-1, dim).contiguous()


def _pad_last(c: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -c.shape[-1] % multiple
    return torch.cat([c, c.new_zeros(*c.shape[:-1], pad)], dim=-1) if pad else c


def pack_int2(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack uint8 codes in [0, 3] four per byte along ``dim`` (code j of a quad in bits 2j)."""
    c = _pad_last(codes.to(torch.uint8).movedim(dim, -1), 4)
    c = c.reshape(*c.shape[:-1], -1, 4)
    packed = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    return packed.movedim(-1, dim).contiguous()


def unpack_int2(packed: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    p = packed.movedim(dim, -1)
    c = torch.stack([(p >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).reshape(*p.shape[:-1], 4 * p.shape[-1])
    return c[..., :n].movedim(-1, dim).contiguous()


def pack_bits(bits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack 0/1 values eight per byte along ``dim`` (bit j = element 8m + j)."""
    c = _pad_last(bits.to(torch.uint8).movedim(dim, -1), 8)
    c = c.reshape(*c.shape[:-1], -1, 8)
    packed = sum(c[..., j] << j for j in range(8)).to(torch.uint8)
    return packed.movedim(-1, dim).contiguous()


def unpack_bits(packed: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    p = packed.movedim(dim, -1)
    c = torch.stack([(p >> j) & 1 for j in range(8)], dim=-1).reshape(*p.shape[:-1], 8 * p.shape[-1])
    return c[..., :n].movedim(-1, dim).contiguous()


def pack_codes(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes along the last axis -> the stored bytes of ``fmt`` (see the module doc)."""
    if fmt == "int4":
        return pack_int4(codes, dim=-1)
    if fmt == "int2":
        return pack_int2(codes, dim=-1)
    if fmt == "int3":
        return torch.cat([pack_int2(codes & 3, dim=-1), pack_bits(codes >> 2, dim=-1)], dim=-1)
    return codes


def unpack_codes(packed: torch.Tensor, n: int, fmt: str) -> torch.Tensor:
    if fmt == "int4":
        return unpack_int4(packed, n, dim=-1)
    if fmt == "int2":
        return unpack_int2(packed, n, dim=-1)
    if fmt == "int3":
        n4 = (n + 3) // 4
        return unpack_int2(packed[..., :n4], n, dim=-1) | (unpack_bits(packed[..., n4:], n, dim=-1) << 2)
    return packed


# ---- float16 directed rounding ---------------------------------------------------------------


def _f16_round_down(v: torch.Tensor) -> torch.Tensor:
    """Largest float16 value <= v (v float32, finite, |v| <= 65504), returned as float32."""
    h = v.to(torch.float16)
    bits = h.view(torch.int16)
    # Round-to-nearest went above v: step one ulp toward -inf. As int16, positive halves step
    # down by -1; negative ones (sign bit set, incl. -0) grow in magnitude by +1.
    above = h.to(torch.float32) > v
    step = torch.where(h.to(torch.float32) > 0, -1, 1).to(torch.int16)
    bits = torch.where(above, bits + step, bits)
    return bits.view(torch.float16).to(torch.float32)


def _f16_round_up(v: torch.Tensor) -> torch.Tensor:
    """Smallest float16 value >= v for v >= 0, returned as float32."""
    h = v.to(torch.float16)
    bits = h.view(torch.int16)
    below = h.to(torch.float32) < v
    bits = torch.where(below, bits + 1, bits).to(torch.int16)
    return bits.view(torch.float16).to(torch.float32)


def group_params(mn: torch.Tensor, mx: torch.Tensor, fmt: str, scale_dtype: torch.dtype):
    """(scale, zero) as float32 tensors holding values exactly representable in scale_dtype."""
    f16 = scale_dtype == torch.float16
    if fmt == "fp8":
        # Centre the group so e4m3's relative precision is spent on the spread, not the offset.
        zero = (mn + mx) * 0.5
        if f16:
            zero = zero.to(torch.float16).to(torch.float32)
        scale = torch.maximum(mx - zero, zero - mn) / FP8_MAX
    else:
        zero = _f16_round_down(mn) if f16 else mn
        scale = (mx - zero) / QMAX[fmt]
    if f16:
        scale = _f16_round_up(scale)
    # Constant group (range 0): any scale reproduces zero exactly; 1 avoids 0/0.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale, zero


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes (uint8) for float32 ``x`` with broadcastable float32 scale/zero."""
    v = (x - zero) / scale
    if fmt == "fp8":
        v = v.clamp(-FP8_MAX, FP8_MAX)
        return v.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.floor(v + 0.5).clamp(0, QMAX[fmt]).to(torch.uint8)


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: str) -> torch.Tensor:
    c = codes.view(torch.float8_e4m3fn) if fmt == "fp8" else codes
    return c.to(torch.float32) * scale + zero


# ---- layout helpers --------------------------------------------------------------------------


def _grouped_last(x: torch.Tensor, layout: str) -> torch.Tensor:
    """View ``[H, T, D]`` with the grouped axis last: ``[H, B, N]``."""
    return x.transpose(1, 2) if layout == "channel" else x


def _natural(y: torch.Tensor, layout: str) -> torch.Tensor:
    return (y.transpose(1, 2) if layout == "channel" else y).contiguous()


def quantize(x: torch.Tensor, fmt: str, group_size: int, layout: str,
             scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize float ``x [H, T, D]`` -> (codes uint8, scale, zero) in ``layout``."""
    check_args(fmt, group_size, layout, scale_dtype)
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"expected a float [H, T, D] tensor, got {tuple(x.shape)} {x.dtype}")
    q_shape, s_shape = out_shapes(x.shape, fmt, group_size, layout)
    if x.numel() == 0:
        return (
            x.new_zeros(q_shape, dtype=torch.uint8),
            x.new_zeros(s_shape, dtype=scale_dtype),
            x.new_zeros(s_shape, dtype=scale_dtype),
        )
    y = _grouped_last(x.to(torch.float32), layout)  # [H, B, N]
    h, b, n = y.shape
    ng = math.ceil(n / group_size)
    pad = ng * group_size - n
    if pad:  # edge padding: duplicates of the last element leave min/max unchanged
        y = torch.cat([y, y[..., -1:].expand(h, b, pad)], dim=-1)
    g = y.reshape(h, b, ng, group_size)
    scale, zero = group_params(g.amin(-1), g.amax(-1), fmt, scale_dtype)
    codes = encode(g, scale[..., None], zero[..., None], fmt).reshape(h, b, ng * group_size)
    codes = pack_codes(codes[..., :n], fmt)
    return (
        _natural(codes, layout),
        _natural(scale.to(scale_dtype), layout),
        _natural(zero.to(scale_dtype), layout),
    )


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: str, group_size: int, layout: str,
               shape: tuple[int, int, int], out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rebuild the dense ``shape`` tensor from (codes, scale, zero)."""
    check_args(fmt, group_size, layout, scale.dtype)
    shape = tuple(int(s) for s in shape)
    q_shape, s_shape = out_shapes(shape, fmt, group_size, layout)
    if tuple(q.shape) != q_shape or tuple(scale.shape) != s_shape or zero.shape != scale.shape:
        raise ValueError(
            f"quantized shapes q{tuple(q.shape)} scale{tuple(scale.shape)} do not match "
            f"{fmt}/{layout}/G={group_size} for {shape}: expected q{q_shape} scale{s_shape}"
        )
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=out_dtype, device=q.device)
    n = grouped_len(shape, layout)
    c = unpack_codes(_grouped_last(q, layout), n, fmt)
    s = _grouped_last(scale, layout).to(torch.float32)
    z = _grouped_last(zero, layout).to(torch.float32)
    idx = torch.arange(n, device=q.device) // group_size  # group of each element
    out = decode(c, s[..., idx], z[..., idx], fmt)
    return _natural(out, layout).to(out_dtype)
