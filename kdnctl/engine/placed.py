"""Reading dense chunk bundles straight into their slots in the cache.

The general local path reads an object into a buffer, checks it, decodes views into that
buffer and then copies every layer's K/V into the preallocated cache: the bytes cross memory
twice. Here, for a load whose chunks are all dense and stored in the cache's dtype, the bytes
cross it once:

1. ``plan``: read each object's header only (a few KB) and run every check ``decode_bundle``
   makes before it looks at tensor bytes (``bundle_layout.parse_head_cached``: a tensor index
   seen before is not parsed again; the placement derived from it is kept with it); the header
   gives each layer's token count, so the cache is allocated before any payload is read.
2. ``read_placed``: one ``preadv`` per layer scatters the object's bytes, in file order,
   straight into their final places: each head's keys/values into its slice of the cache
   buffer (a contiguous run of ``T * D`` elements), the small tensors (token ids, positions,
   statistics, bias) into one scratch buffer. Every slice is hashed right after it lands,
   while it is still in the CPU cache (kdnctl/store/fastread.py ``Verifier``: XXH3-128 when the
   catalog recorded it, else BLAKE3, else the sha256 name), so the check costs no extra
   pass over memory.
3. Only when every byte of the object matched is anything decoded: ``bundle.finish_decode``
   checks the header digest and the structure (the K/V entries as shape-and-dtype stand-ins,
   their bytes being in the cache already), and the catalog record must match the bundle, as
   on the general path. A failed check raises before
   the context exists: the partly written cache is never used.

A chunk whose header cannot be planned (malformed, quantized, another dtype) sends the whole
load down the general path, which reports corruption exactly as before (hash first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..format.bundle import finish_decode, header_size

from ..format.names import tensor_name
from ..format.layout import parse_head_cached
from ..errors import BundleFormatError, StoreCorruptError
from ..store.fastread import Verifier, new_buffer

HEAD_BYTES = 64 << 10  # one read covers a 30-layer bundle's header (a few KB) with room to spare
BATCH_BYTES = 1 << 20  # bytes per preadv: small enough that a batch is still cached when hashed
_MAX_IOV = 512


@dataclass
class Plan:
    """One object's header, read and checked, and each layer's token count."""

    hit: tuple
    path: str
    size: int
    head: bytes
    meta: dict
    meta_json: str
    digest: str | None
    n_header: int
    layout: object  # kdnctl/format/layout.py Layout: the tensor index, parsed and checked once
    recipe: _Recipe

    @property
    def lens(self) -> list[int]:
        return self.recipe.lens


@dataclass
class _Recipe:
    """How a tensor index is placed (derived once per index and model shape): each layer's
    token count, the entries in file order as ``("kv", layer, role, T)`` or ``("small", name,
    scratch offset, bytes)``, the scratch size, and the K/V entries' shape-and-dtype stand-ins."""

    lens: list[int]
    order: list[tuple]
    scratch: int
    small: list[tuple]  # (name, scratch offset, dtype, shape, numel)
    stand_ins: dict


def _read_head(path) -> tuple[bytes, int]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreCorruptError(f"object {os.path.basename(path)[:12]} is missing from "
                                f"{os.path.dirname(os.path.dirname(path))}") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, min(size, HEAD_BYTES), 0)
        try:
            need = header_size(head[:8])
        except BundleFormatError:
            return head, size  # the planner refuses it; the general path reports it
        if len(head) < need <= size:
            head = os.pread(fd, need, 0)
        return head, size
    finally:
        os.close(fd)


def plan(path, hit, *, dtype: torch.dtype, n_layers: int, h_kv: int, head_dim: int) -> Plan | None:
    """The placement plan of one object, or None when it cannot be placed directly (then the
    general path reads, checks and reports it)."""
    head, size = _read_head(path)
    try:
        parsed = parse_head_cached(head, size)
    except BundleFormatError:
        return None
    if parsed is None:
        return None
    meta, meta_json, digest, n, layout = parsed
    model = meta.get("model")
    if meta.get("quant") or not isinstance(model, dict) or model.get("n_layers") != n_layers \
            or model.get("n_kv_heads") != h_kv or model.get("head_dim") != head_dim:
        return None
    key = ("placed", dtype, n_layers, h_kv, head_dim)
    if key not in layout.memo:
        layout.memo[key] = _recipe(layout, dtype, n_layers, h_kv, head_dim)
    recipe = layout.memo[key]
    if recipe is None:
        return None
    return Plan(hit, str(path), size, head[: 8 + n], meta, meta_json, digest, n, layout, recipe)


def _recipe(layout, dtype, n_layers: int, h_kv: int, head_dim: int) -> _Recipe | None:
    shapes = layout.shapes
    kv = {name: lr for name in shapes if (lr := _is_kv(name)) is not None}
    if any(lr[0] >= n_layers for lr in kv.values()):
        return None
    lens = []
    for i in range(n_layers):
        k, v = shapes.get(tensor_name(i, "keys")), shapes.get(tensor_name(i, "values"))
        if k is None or v is None or k != v or k[0] != dtype or len(k[1]) != 3 \
                or k[1][0] != h_kv or k[1][2] != head_dim:
            return None
        lens.append(k[1][1])
    order, small, stand_ins, at = [], [], {}, 0
    for begin, end, name, dt, shape, numel in layout.entries:
        if name in kv:
            i, r = kv[name]
            stand_ins[name] = torch.empty(shape, dtype=dt, device="meta")
            order.append(("kv", i, r, shape[1]))
        else:
            small.append((name, at, dt, tuple(shape), numel))
            order.append(("small", name, at, end - begin))
            at += (end - begin + 7) // 8 * 8
    return _Recipe(lens, order, at, small, stand_ins)


def byte_views(bufs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[memoryview, memoryview]]:
    """Flat writable byte views of each layer's (keys, values) cache buffers."""
    return [tuple(memoryview(b.reshape(-1).view(torch.uint8).numpy()) for b in kv) for kv in bufs]


def read_placed(p: Plan, bufs, views, starts: list[int], *, expect_fingerprint: str, profile=None):
    """Read ``p``'s object into the cache buffers ``bufs`` (layer i's tokens from ``starts[i]``)
    and a scratch buffer, hashing every byte as it lands; then decode. Returns the KVBundle:
    its small tensors (token ids, positions, statistics, bias) are real, its layer K/V tensors
    are shape-and-dtype stand-ins (``meta`` tensors): their bytes are in the cache slots."""
    import time

    version, ref = p.hit
    check = Verifier(ref.object, getattr(ref, "blake3", None), getattr(ref, "xxh3", None))
    t0 = time.perf_counter()
    check.update(p.head)
    base = 8 + p.n_header
    rc = p.recipe
    scratch = new_buffer(rc.scratch)
    smv = memoryview(scratch)
    # the bytes of K/V go straight into the cache; the decoder's checks (header digest, shapes,
    # dtypes) see stand-ins of the same shape and dtype that hold no memory
    tensors: dict[str, torch.Tensor] = dict(rc.stand_ins)
    for name, o, dtype, shape, numel in rc.small:
        tensors[name] = (torch.frombuffer(scratch, dtype=dtype, count=numel, offset=o).view(shape)
                         if numel else torch.empty(shape, dtype=dtype))
    segs: list[memoryview] = []
    for item in rc.order:
        if item[0] == "kv":
            _, i, r, t = item
            if t:
                buf = bufs[i][r]
                h_kv, cap, d, esz = buf.shape[1], buf.shape[2], buf.shape[3], buf.element_size()
                row, step, first = t * d * esz, cap * d * esz, starts[i] * d * esz
                mv = views[i][r]
                segs.extend(mv[h * step + first : h * step + first + row] for h in range(h_kv))
        elif item[3]:
            segs.append(smv[item[2] : item[2] + item[3]])
    t_read = t_hash = 0.0
    pos, i = base, 0
    try:  # planned earlier: gc may have removed it since (the loader turns that into "retry")
        fd = os.open(p.path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreCorruptError(f"object {ref.object[:12]} is missing from "
                                f"{os.path.dirname(os.path.dirname(p.path))}") from None
    try:
        while i < len(segs):
            j, nbytes = i, 0
            while j < len(segs) and (j == i or (nbytes + segs[j].nbytes <= BATCH_BYTES and j - i < _MAX_IOV)):
                nbytes += segs[j].nbytes
                j += 1
            t1 = time.perf_counter()
            _preadv_all(fd, segs[i:j], pos, nbytes, ref.object)
            t2 = time.perf_counter()
            for seg in segs[i:j]:
                check.update(seg)
            t_read += t2 - t1
            t_hash += time.perf_counter() - t2
            pos, i = pos + nbytes, j
    finally:
        os.close(fd)
    if pos != p.size:  # the tensor index covered the file at plan time; nothing may differ now
        raise StoreCorruptError(f"object {ref.object[:12]} changed size while being read")
    t1 = time.perf_counter()
    check.finish()
    t_hash += time.perf_counter() - t1
    t1 = time.perf_counter()
    bundle = finish_decode(p.meta, p.meta_json, p.digest, tensors, expect_fingerprint, p.layout)
    if profile is not None:
        profile.read += t_read
        profile.hash += t_hash
        profile.decode += time.perf_counter() - t1 + (t1 - t0 - t_read - t_hash)
    return bundle


def _is_kv(name: str) -> tuple[int, int] | None:
    if name.startswith("layers.") and (name.endswith(".keys") or name.endswith(".values")):
        mid = name[7:].split(".")
        if len(mid) == 2 and mid[0].isdigit():
            return int(mid[0]), 0 if mid[1] == "keys" else 1
    return None


def _preadv_all(fd: int, segs: list[memoryview], pos: int, nbytes: int, sha: str) -> None:
    got = os.preadv(fd, segs, pos)
    while got < nbytes:  # a short read of a regular file: finish it segment by segment
        done, rest = 0, []
        for seg in segs:
            if done + seg.nbytes <= got:
                done += seg.nbytes
                continue
            rest.append(seg[max(0, got - done):])
            done += seg.nbytes
        n = os.preadv(fd, rest, pos + got)
        if n == 0:
            raise StoreCorruptError(f"object {sha[:12]} shrank while being read")
        got += n
