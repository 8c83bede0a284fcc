"""Dequantize stored KV straight into a preallocated cache slice.

The general decoder (``kdnctl.kernels.quant.reference.dequantize``) builds a per-element group
index and gathers scale/zero through it, then transposes and casts: several full-size
temporaries per tensor. For the single-format groupwise schemes (int8, int4, fp8) the same
numbers come from a broadcast: view the grouped axis as ``[groups, group_size]`` and compute
``code * scale + zero`` in place in the destination, the cache buffer itself. Every shape and
dtype is checked exactly as the general decoder checks it; other schemes (``mixed``) take the
general path. The result equals the reference decoder's (tests/test_load_path.py).
"""

from __future__ import annotations

import time

import torch

from kdnctl.errors import BundleFormatError
from kdnctl.kernels.quant import out_shapes, unpack_int4

FAST_SCHEMES = ("int8", "int4", "fp8")  # decoded wholly on the cache's device (a GPU load ships the object)
# ...and ec, whose frames are entropy-decoded on the host into integers that go to the cache's
# device to be dequantized there (EntropyQuantizer.dequantize_into)
INTO_SCHEMES = (*FAST_SCHEMES, "ec")


def _checked(tensors, name: str, fmt: str, group_size: int, layout: str):
    from kdnctl.quant.base import need, stored_shape

    q, s, z = (need(tensors, f"{name}.{part}") for part in ("q", "scale", "zero"))
    shape = stored_shape(tensors, name) if f"{name}.shape" in tensors or fmt == "int4" else tuple(q.shape)
    if q.dtype != torch.uint8 or s.dtype not in (torch.float16, torch.float32) or z.dtype != s.dtype:
        raise BundleFormatError(f"{name}: unexpected dtypes q={q.dtype} scale={s.dtype} zero={z.dtype}")
    q_shape, s_shape = out_shapes(shape, fmt, group_size, layout)
    if tuple(q.shape) != q_shape or tuple(s.shape) != s_shape or tuple(z.shape) != s_shape:
        raise BundleFormatError(
            f"{name}: q{tuple(q.shape)}/scale{tuple(s.shape)} do not fit shape {list(shape)} "
            f"({fmt}, {layout}, group {group_size})"
        )
    return q, s, z, shape


def _quant_params(name: str, quant_meta: dict) -> tuple[str, int, str]:
    from kdnctl.quant.base import group_size_of, layout_for

    fmt = quant_meta.get("format") or quant_meta.get("scheme")
    return fmt, group_size_of(quant_meta), layout_for(name, quant_meta)


def _entropy():
    from kdnctl.quant.entropy import EntropyQuantizer

    return EntropyQuantizer


def dequantize_into(out: torch.Tensor, tensors, name: str, quant_meta: dict) -> None:
    """Write the dense ``[H, T, D]`` tensor ``name`` (e.g. ``layers.3.keys``) into ``out``
    (a view of the same shape, any float dtype); BundleFormatError on malformed input."""
    if quant_meta.get("scheme") == "ec":
        return _entropy().dequantize_into(out[None], tensors, [name], quant_meta)
    fmt, g, layout = _quant_params(name, quant_meta)
    q, s, z, shape = _checked(tensors, name, fmt, g, layout)
    if tuple(out.shape) != tuple(shape):
        raise BundleFormatError(f"{name}: shape {list(shape)} does not fit its cache slot {list(out.shape)}")
    if out.numel() == 0:
        return
    if q.device != out.device:  # a GPU cache: ship the (small) codes, dequantize on the device
        q, s, z = (x.to(out.device, non_blocking=True) for x in (q, s, z))
    _decode_groups(out, q, s, z, fmt, g, layout)


def dequantize_layers_into(out: torch.Tensor, tensors, names: list[str], quant_meta: dict) -> None:
    """Several same-shaped tensors at once: ``out [L, H, T, D]`` gets ``names[l]`` in row l.

    On a GPU the per-tensor path costs a handful of kernel launches per layer, which at 30
    layers x 2 roles x 32 chunks dominates a load; stacking the codes first makes it a
    handful per chunk. Every tensor is checked exactly as :func:`dequantize_into` checks it."""
    if quant_meta.get("scheme") == "ec":
        return _entropy().dequantize_into(out, tensors, names, quant_meta)
    fmt, g, layout = _quant_params(names[0], quant_meta)
    role = names[0].rsplit(".", 1)[-1]  # (the parameters depend on the name only through its role)
    if any(n.rsplit(".", 1)[-1] != role for n in names):
        raise BundleFormatError(f"{names[0]}..: layers differ in format; load them one by one")
    if _uniform(tensors, names):
        # every layer's tensors have one set of dtypes and shapes, and one stored shape: the
        # first layer's full check holds for all of them
        shapes = [_checked(tensors, names[0], fmt, g, layout)[3]] * len(names)
    else:
        shapes = [_checked(tensors, n, fmt, g, layout)[3] for n in names]
    if any(tuple(s) != tuple(shapes[0]) for s in shapes) or tuple(out.shape) != (len(names), *shapes[0]):
        raise BundleFormatError(f"{names[0]}..: shapes {[list(s) for s in shapes]} do not fit {list(out.shape)}")
    if out.numel() == 0:
        return
    q, s, z = (torch.stack([tensors[f"{n}.{part}"] for n in names]).to(out.device, non_blocking=True)
               for part in ("q", "scale", "zero"))
    _decode_groups(out, q, s, z, fmt, g, layout)


def _uniform(tensors, names: list[str]) -> bool:
    """All of ``names`` have q/scale/zero of one dtype and shape each, and one stored shape."""
    try:
        parts = [(tensors[f"{n}.q"], tensors[f"{n}.scale"], tensors[f"{n}.zero"]) for n in names]
    except KeyError:
        return False
    if len({(q.dtype, s.dtype, z.dtype, q.shape, s.shape, z.shape) for q, s, z in parts}) != 1:
        return False
    has_shape = {f"{n}.shape" in tensors for n in names}
    if len(has_shape) != 1:
        return False
    if has_shape.pop():
        shapes = [tensors[f"{n}.shape"] for n in names]
        if len({(t.dtype, tuple(t.shape)) for t in shapes}) != 1 or shapes[0].dim() != 1:
            return False
        if len({tuple(r) for r in torch.stack(shapes).tolist()}) != 1:
            return False
    return True


def _decode_groups(out: torch.Tensor, q, s, z, fmt: str, g: int, layout: str) -> None:
    """``out[..., H, T, D] = code * scale + zero`` by broadcast over the groups (any leading dims)."""
    axis = -2 if layout == "channel" else -1  # the grouped axis of [..., H, T, D]
    n = out.shape[axis]
    if fmt == "int4":
        q = unpack_int4(q, n, dim=axis)
    elif fmt == "fp8":
        q = q.view(torch.float8_e4m3fn)
    full = (n // g) * g
    for lo, hi, glen in ((0, full, g), (full, n, n - full)):
        if hi <= lo:
            continue
        ng = (hi - lo) // glen
        gs = slice(lo // g, lo // g + ng)
        if axis == -2:
            dst = out[..., lo:hi, :].unflatten(-2, (ng, glen))
            codes = q[..., lo:hi, :].unflatten(-2, (ng, glen))
            sc, ze = s[..., gs, None, :], z[..., gs, None, :]
        else:
            dst = out[..., lo:hi].unflatten(-1, (ng, glen))
            codes = q[..., lo:hi].unflatten(-1, (ng, glen))
            sc, ze = s[..., gs, None], z[..., gs, None]
        # same arithmetic as the reference: float32 code * float32 scale + float32 zero
        if out.dtype == torch.float32 and out.device.type == "cpu" and axis == -2:
            # in place in the cache, two passes: the codes, then zero + code * scale in one
            # (the CPU addcmul rounds the product, then the sum, like the reference:
            # tests/test_load_path.py checks the results are equal bit for bit). Measured per
            # 256-token chunk of 30 layers: 0.25 ms against 0.5 for three passes when groups run
            # along tokens (keys); with groups along the head dimension (values) the broadcast is
            # innermost and addcmul is slower (1.0 ms against 0.25): three passes there.
            dst.copy_(codes)
            torch.addcmul(ze.float(), dst, sc.float(), out=dst)
        elif out.dtype == torch.float32:  # in place in the cache: no temporaries
            dst.copy_(codes)
            dst.mul_(sc)
            dst.add_(ze)
        else:
            dst.copy_(codes.to(torch.float32).mul_(sc.float()).add_(ze.float()))


def _ec_quant(bundles, n_layers: int, offsets, lens) -> dict | None:
    """The chunks' quant meta where they are ec with every layer of a chunk as many tokens, coded
    in every layer (what the compiled batch decoder takes), else None."""
    quant = bundles[0].meta.get("quant") or {}
    if quant.get("scheme") != "ec" or any(len(set(o)) != 1 for o in offsets) or any(len(set(n)) != 1 for n in lens):
        return None
    if not all(b.is_quantized(i) for b in bundles for i in range(n_layers)):
        return None
    return quant


def ec_batch_into(bundles, n_layers: int, stacked, offsets, lens, profile=None, ready=None) -> bool:
    """Decode ec chunks (every layer of a chunk as many tokens) into the stacked CPU cache with
    the compiled batch decoder; False where it does not apply (the caller then places chunk by chunk).
    With ``ready`` (``kdnctl.engine.overlap.LayersReady``) the decode runs in the background, layer
    group by layer group, and this returns at once."""
    quant = _ec_quant(bundles, n_layers, offsets, lens)
    if quant is None:
        return False
    from ..quant import ec_batch

    if not ec_batch.eligible(bundles, n_layers, quant, stacked):
        return False
    starts = [o[0] for o in offsets]
    if ready is not None:  # one worker: the forward keeps a core, and decodes itself while it waits
        job = ec_batch.GroupedDecode(stacked, bundles, starts, quant, groups=ready.groups, on_group=ready.done)
        ready.start(lambda r: job.run(workers=1), helper=job.help)
        return True
    t0 = time.perf_counter()
    ec_batch.decode_into(stacked, bundles, starts, quant)
    if profile is not None:
        profile.dequantize += time.perf_counter() - t0
    return True


def ec_device_into(bundles, n_layers: int, stacked, offsets, lens, profile=None) -> bool:
    """Decode ec chunks into a stacked cache on a GPU with the device decoder
    (``kdnctl.quant.ec_device``: the host inflates, one kernel per role writes the cache); False
    where it does not apply (no Triton, or chunks it does not take: the caller stages them)."""
    from ..kernels.dispatch import use_triton

    if not use_triton(stacked[0]):
        return False
    quant = _ec_quant(bundles, n_layers, offsets, lens)
    if quant is None:
        return False
    from ..quant import ec_device

    if not ec_device.eligible(bundles, n_layers, quant, stacked):
        return False
    t0 = time.perf_counter()
    ec_device.decode_into(stacked, bundles, [o[0] for o in offsets], quant)
    if profile is not None:
        if stacked[0].is_cuda:
            torch.cuda.synchronize(stacked[0].device)  # (the launches are asynchronous)
        profile.dequantize += time.perf_counter() - t0
    return True


def ec_staged_into(bundles, n_layers: int, stacked, offsets, lens, profile=None) -> bool:
    """ec chunks into a stacked cache the compiled decoder does not write (a GPU's, or a CPU
    cache in float16 or bfloat16): decoded whole into float32 host memory (page-locked where the
    cache is on a GPU) by the compiled batch decoder on every host core, then copied, cast, into
    the cache in one copy per role: the batch decoder's float32 results, cast once. False where the batch decoder does not apply (the caller
    then places chunk by chunk)."""
    quant = _ec_quant(bundles, n_layers, offsets, lens)
    if quant is None:
        return False
    from ..quant import ec_batch

    if not ec_batch.eligible(bundles, n_layers, quant, (torch.empty(0), torch.empty(0))):  # (a float32 CPU cache)
        return False
    total = offsets[-1][0] + lens[-1][0]
    _, h, _, d = stacked[0].shape
    pin = stacked[0].device.type == "cuda"
    t0 = time.perf_counter()
    staging = None
    if pin:
        try:
            staging = tuple(torch.empty(n_layers, h, total, d, dtype=torch.float32, pin_memory=True) for _ in range(2))
        except RuntimeError:  # no page-locked memory to be had: pageable memory copies slower, but copies
            pass
    if staging is None:  # pooled memory, faulted in by an earlier load
        from ..store.arena import STAGING_POOL, kv_arena

        staging = kv_arena([total] * n_layers, h, d, 0, torch.float32, STAGING_POOL)[1] or \
            tuple(torch.empty(n_layers, h, total, d) for _ in range(2))  # (no tokens: nothing to pool)
    ec_batch.decode_into(staging, bundles, [o[0] for o in offsets], quant)
    for big, host in zip(stacked, staging):
        big[:, :, :total].copy_(host)  # (to a GPU: from page-locked memory at the link's speed)
    if profile is not None:
        profile.dequantize += time.perf_counter() - t0
    return True
