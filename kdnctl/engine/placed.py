"""Reading dense chunk bundles straight into their slots in the cache (issue 15).

The general local path reads an object into a buffer, checks it, decodes views into that
buffer and then copies every layer's K/V into the preallocated cache: the bytes cross memory
twice. Here, for a load whose chunks are all dense and stored in the cache's dtype, the bytes
cross it once:

1. ``plan``: read each object's header only (a few KB) and run every check ``decode_bundle``
   makes before it looks at tensor bytes (``bundle.parse_head``); the header gives each
   layer's token count, so the cache is allocated before any payload is read.
2. ``read_placed``: one ``preadv`` per layer scatters the object's bytes, in file order,
   straight into their final places: each head's keys/values into its slice of the cache
   buffer (a contiguous run of ``T * D`` elements), the small tensors (token ids, positions,
   statistics, bias) into one scratch buffer. Every slice is hashed right after it lands,
   while it is still in the CPU cache (kdnctl/fastread.py ``Verifier``: XXH3-128 when the
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

from ..bundle import finish_decode, header_size, parse_head, tensor_name
from ..errors import BundleFormatError, StoreCorruptError
from ..fastread import Verifier, new_buffer

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
    entries: list[tuple]
    lens: list[int]
    kv: dict  # tensor name -> (layer, 0 keys / 1 values) for every layer's dense K/V


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
        meta, meta_json, digest, n, entries = parse_head(head, size)
    except BundleFormatError:
        return None
    model = meta.get("model")
    if meta.get("quant") or not isinstance(model, dict) or model.get("n_layers") != n_layers \
            or model.get("n_kv_heads") != h_kv or model.get("head_dim") != head_dim:
        return None
    shapes = {name: (dt, shape) for _b, _e, name, dt, shape, _n in entries}
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
    return Plan(hit, str(path), size, head[: 8 + n], meta, meta_json, digest, n, entries, lens, kv)


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
    small = [e for e in p.entries if e[2] not in p.kv]
    offs, at = {}, 0
    for e in small:
        offs[e[2]] = at
        at += (e[1] - e[0] + 7) // 8 * 8
    scratch = new_buffer(at)
    smv = memoryview(scratch)
    tensors: dict[str, torch.Tensor] = {}
    segs: list[memoryview] = []
    stand_in: dict[tuple, torch.Tensor] = {}
    for begin, end, name, dtype, shape, numel in p.entries:
        layer_role = p.kv.get(name)
        if layer_role:
            # the bytes go straight into the cache; the decoder's checks (header digest, shapes,
            # dtypes) see a stand-in of the same shape and dtype that holds no memory
            i, r = layer_role
            key = (dtype, *shape)
            if key not in stand_in:
                stand_in[key] = torch.empty(shape, dtype=dtype, device="meta")
            tensors[name] = stand_in[key]
            s, t = starts[i], shape[1]
            if t:
                row = t * shape[2] * dtype.itemsize
                step = bufs[i][r].shape[2] * shape[2] * dtype.itemsize
                first = s * shape[2] * dtype.itemsize
                mv = views[i][r]
                segs.extend(mv[h * step + first : h * step + first + row] for h in range(shape[0]))
        else:
            o = offs[name]
            tensors[name] = (torch.frombuffer(scratch, dtype=dtype, count=numel, offset=o).view(tuple(shape))
                             if numel else torch.empty(shape, dtype=dtype))
            if end > begin:
                segs.append(smv[o : o + end - begin])
    t_read = t_hash = 0.0
    pos, i = base, 0
    fd = os.open(p.path, os.O_RDONLY)
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
    bundle = finish_decode(p.meta, p.meta_json, p.digest, tensors, expect_fingerprint)
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
