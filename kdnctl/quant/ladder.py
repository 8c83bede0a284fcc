"""ladder: every token (per layer and KV head) has its own precision tier, chosen separately for
its key and its value from {fp16, int8, int4, int3, int2}.

Tensors per layer ``i`` (``role`` = ``keys`` / ``values``); everything needed to decode is in
them and in the scheme-level meta (``head_dim``, ``group_size``, ``layouts``, transforms):

- ``layers.i.tiers``  uint8 ``[H, T_i]``: key tier in the low nibble, value tier in the high one
  (index into :data:`TIERS`); one byte per kept token and head.
- ``layers.i.<role>.codes`` uint8 ``[n]``: for each tier in :data:`TIERS` order, the rows at that
  tier (flattened head-major, then token-ascending, into ``[1, N, D]``): fp16 rows as their raw
  bytes, int rows as the packed codes of the groupwise kernels (``kdnctl.kernels.quant``, KIVI
  layout: keys per channel over groups of ``group_size`` rows, values per token over groups of
  channels; int2/int3 packed; Triton on CUDA).
- ``layers.i.<role>.params`` float16 ``[m]``: for each int tier, its scales then its zeros.

Five tensors per layer, whatever the mix: the safetensors index costs ~90 bytes per tensor and
a chunk's header is part of what the size budget pays for. Every slice's size follows from the
tier counts, so a bundle whose tensors do not add up is refused (BundleFormatError).

With ``coding="zlib"`` each ``.codes`` blob is zlib-coded (lossless; ~20% smaller for int2
codes, ~7% for int3, measured by ``research/probes/tiers.py``); with ``coding="zlib+params"`` (the default
of a size budget) the ``.params`` blob too, stored as uint8 (fp16 scales and zeros: ~17% smaller,
which is 0.17 bits per element at groups of 32).

Transforms (measured by ``research/probes/tiers.py``, see docs/compression.md), recorded in the meta and
undone after decoding: keys are quantized before RoPE (``key_rope_theta``; the positions are in
the bundle) and values after an orthonormal Hadamard rotation of the head dimension
(``value_hadamard``). Both lower the reconstruction error at every bit width.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from kdnctl.errors import BundleFormatError, InputError

from . import transforms as tf
from .base import Quantizer, check_kv, encode_tensor, group_size_of, need

TIERS = ("fp16", "int8", "int4", "int3", "int2")
# stored/raw bytes of zlib-coded codes per 256-token chunk, measured on real K/V (research/probes/coding.py,
# stored bundles): the planner's first guess; compress measures the encoded bundles and corrects the plan
CODED = {"fp16": 0.93, "int8": 0.95, "int4": 0.95, "int3": 0.98, "int2": 0.85}
PARAMS_CODED = 0.88  # zlib-coded fp16 scales + zeros / raw (0.81 on a whole document, 0.85-0.90 per 256-token chunk)
CODINGS = (None, "zlib", "zlib+params")
TIER_BITS = {"fp16": 16, "int8": 8, "int4": 4, "int3": 3, "int2": 2}
ROLES = ("keys", "values")


def tier_ids(names) -> list[int]:
    bad = [n for n in names if n not in TIERS]
    if bad:
        raise InputError(f"unknown precision tier(s) {bad}", hint=f"tiers: {', '.join(TIERS)}")
    return [TIERS.index(n) for n in names]


def row_bytes(tier: str, head_dim: int, group_size: int, coded: bool | str | None = False) -> float:
    """Stored bytes of one row (one token of one head, K or V) at ``tier``, scale/zero amortised
    (keys: one fp16 scale+zero per channel per ``group_size`` rows; values: per group of
    channels of each row) plus half a byte of the tier map; ``coded``: zlib-coded codes (True or
    ``"zlib"``), codes and scales/zeros (``"zlib+params"``)."""
    codes = head_dim * TIER_BITS[tier] / 8
    if coded:
        codes *= CODED[tier]
    if tier == "fp16":
        return codes + 0.5
    params = 4.0 * head_dim / group_size
    if coded == "zlib+params":
        params *= PARAMS_CODED
    return codes + params + 0.5


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _zlib(blob: torch.Tensor) -> torch.Tensor:
    return _bytes_tensor(zlib.compress(blob.contiguous().view(torch.uint8).numpy().tobytes(), 9))


def _unzlib(blob: torch.Tensor, what: str) -> torch.Tensor:
    try:
        return _bytes_tensor(zlib.decompress(blob.numpy().tobytes()))
    except zlib.error:
        raise BundleFormatError(f"{what} is not a valid zlib stream") from None


def _positions(tensors: dict[str, torch.Tensor], layer: str, h: int) -> torch.Tensor:
    p = tensors.get(f"{layer}.positions")
    if p is None:
        p = need(tensors, "positions").unsqueeze(0).expand(h, -1)
    return p


@dataclass
class LadderQuantizer(Quantizer):
    name = "ladder"
    key_rope_theta: float | None = None  # set: keys are stored before RoPE
    value_hadamard: bool = True
    coding: str | None = None  # "zlib": the codes blob is zlib-coded (lossless)

    # -- transforms ------------------------------------------------------------------------
    def forward(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        k = tf.unrope(keys, positions, self.key_rope_theta) if self.key_rope_theta else keys.float()
        v = tf.rotate(values) if self.value_hadamard else values.float()
        return k, v

    # -- encode ----------------------------------------------------------------------------
    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     k_tiers: torch.Tensor, v_tiers: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors (relative names) for one layer; ``*_tiers`` int ``[H, T]`` indices into TIERS."""
        check_kv(keys, values, self.scale_dtype)
        h, t, d = keys.shape
        if tuple(k_tiers.shape) != (h, t) or tuple(v_tiers.shape) != (h, t):
            raise InputError(f"tier maps must be [{h}, {t}], got {tuple(k_tiers.shape)}, {tuple(v_tiers.shape)}")
        k, v = self.forward(keys, values, positions)
        out: dict[str, torch.Tensor] = {"tiers": (k_tiers.to(torch.uint8) | (v_tiers.to(torch.uint8) << 4))}
        for role, x, tiers in (("keys", k, k_tiers), ("values", v, v_tiers)):
            codes, params = [], []
            for tid, tier in enumerate(TIERS):
                mask = tiers == tid
                if not bool(mask.any()):
                    continue
                rows = x[mask][None]  # [1, N, D], head-major then token order
                if tier == "fp16":
                    codes.append(rows.to(torch.float16).reshape(-1).view(torch.uint8))
                else:
                    enc = encode_tensor(rows, "r", tier, self.group_size, self.layouts[role], self.scale_dtype)
                    codes.append(enc["r.q"].reshape(-1))
                    params += [enc["r.scale"].reshape(-1), enc["r.zero"].reshape(-1)]
            if self.coding not in CODINGS:
                raise InputError(f"unknown code coding {self.coding!r}", hint="zlib, zlib+params or none")
            blob = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.uint8)
            par = torch.cat(params).to(torch.float16) if params else torch.zeros(0, dtype=torch.float16)
            out[f"{role}.codes"] = _zlib(blob) if self.coding else blob
            out[f"{role}.params"] = _zlib(par) if self.coding == "zlib+params" else par
        return out

    def quantize_layer(self, keys, values, *, importance=None, positions=None, tier: str = "int4"):
        """Uniform-tier interface of the other quantizers (every row at ``tier``)."""
        h, t, d = keys.shape
        if positions is None:
            positions = torch.arange(t).expand(h, t)
        ids = torch.full((h, t), TIERS.index(tier), dtype=torch.long)
        return self.encode_layer(keys, values, positions, ids, ids), self.meta(d)

    def meta(self, d: int) -> dict:
        if self.scale_dtype != "float16":
            raise InputError("the ladder stores float16 scales only")
        m = self.base_meta(torch.empty(0, 0, d), torch.empty(0, 0, d))
        m.pop("shapes")
        m.update(tiers=list(TIERS), head_dim=d, key_rope_theta=self.key_rope_theta,
                 value_hadamard=self.value_hadamard, coding=self.coding)
        return m

    # -- decode ----------------------------------------------------------------------------
    @classmethod
    def dequantize(cls, tensors, prefix, quant_meta):
        from kdnctl.kernels import quant as kq

        layer, role = prefix.rsplit(".", 1)
        tiers = need(tensors, f"{layer}.tiers")
        # zlib runs on the host: a bundle placed on a GPU (engine.gpu_transfer) is decoded from
        # host copies of its (small, coded) tensors and the dense result goes back to its device
        device = tiers.device
        tiers = tiers.cpu()
        d = quant_meta.get("head_dim")
        if tiers.dtype != torch.uint8 or tiers.dim() != 2 or not isinstance(d, int) or d < 1:
            raise BundleFormatError(f"{layer}.tiers must be uint8 [H, T] and meta needs head_dim")
        h, t = tiers.shape
        ids = (tiers & 0x0F) if role == "keys" else (tiers >> 4)
        if ids.numel() and int(ids.max()) >= len(TIERS):
            raise BundleFormatError(f"{layer}.tiers holds an unknown tier {int(ids.max())}")
        layout = (quant_meta.get("layouts") or {}).get(role, "channel" if role == "keys" else "token")
        g = group_size_of(quant_meta)
        codes, params = need(tensors, f"{prefix}.codes").cpu(), need(tensors, f"{prefix}.params").cpu()
        coding = quant_meta.get("coding")
        if coding not in CODINGS:
            raise BundleFormatError(f"unknown code coding {coding!r} in bundle meta")
        p_dtype = torch.uint8 if coding == "zlib+params" else torch.float16
        if codes.dtype != torch.uint8 or params.dtype != p_dtype or codes.dim() != 1 or params.dim() != 1:
            raise BundleFormatError(f"{prefix}: codes must be uint8 [n] and params {p_dtype} [m]")
        if coding:
            codes = _unzlib(codes, f"{prefix}.codes")
        if coding == "zlib+params":
            params = _unzlib(params, f"{prefix}.params")
            if params.numel() % 2:
                raise BundleFormatError(f"{prefix}.params holds an odd number of bytes")
            params = params.view(torch.float16)
        out = torch.zeros(h, t, d, dtype=torch.float32)
        co = po = 0
        for tid, tier in enumerate(TIERS):
            mask = ids == tid
            n = int(mask.sum())
            if n == 0:
                continue
            if tier == "fp16":
                nb = 2 * n * d
                if co + nb > codes.numel():
                    raise BundleFormatError(f"{prefix}.codes is too short for its tier map")
                rows = codes[co:co + nb].clone().view(torch.float16).float().view(n, d)
                co += nb
            else:
                q_shape, s_shape = kq.out_shapes((1, n, d), tier, g, layout)
                nq, ns = math.prod(q_shape), math.prod(s_shape)
                if co + nq > codes.numel() or po + 2 * ns > params.numel():
                    raise BundleFormatError(f"{prefix}: codes/params are too short for its tier map")
                q = codes[co:co + nq].view(q_shape)
                sc = params[po:po + ns].view(s_shape)
                ze = params[po + ns:po + 2 * ns].view(s_shape)
                rows = kq.dequantize(q, sc, ze, tier, g, layout, (1, n, d), torch.float32)[0]
                co, po = co + nq, po + 2 * ns
            out[mask] = rows.to(out.device)
        if co != codes.numel() or po != params.numel():
            raise BundleFormatError(f"{prefix}: {codes.numel() - co} code bytes / {params.numel() - po} params left over")
        if role == "values" and quant_meta.get("value_hadamard"):
            out = tf.rotate(out)
        theta = quant_meta.get("key_rope_theta")
        if role == "keys" and theta:
            out = tf.rope(out, _positions(tensors, layer, h).cpu(), float(theta))
        return out.to(device)


def tier_errors(q: LadderQuantizer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                tiers: list[str]) -> torch.Tensor:
    """Relative squared reconstruction error of every row at every tier: ``[2, n_tiers, H, T]``
    (role, tier). Each tier quantizes the whole layer uniformly (its real groups), and a row's
    error is normalised by the mean squared norm of its head's rows of that role."""
    h, t, d = keys.shape
    out = torch.zeros(2, len(tiers), h, t)
    if t == 0:
        return out
    norms = [x.float().pow(2).sum(-1).mean(-1, keepdim=True).clamp_min(1e-12) for x in (keys, values)]
    for j, tier in enumerate(tiers):
        if tier == "fp16":
            rec = [keys.to(torch.float16).float(), values.to(torch.float16).float()]
        else:
            tensors, meta = q.quantize_layer(keys, values, positions=positions, tier=tier)
            full = {f"x.{n}": v for n, v in tensors.items()}
            full["x.positions"] = positions
            rec = [LadderQuantizer.dequantize(full, f"x.{r}", meta) for r in ROLES]
        for r, (x, y) in enumerate(zip((keys, values), rec)):
            out[r, j] = (y - x.float()).pow(2).sum(-1) / norms[r]
    return out
