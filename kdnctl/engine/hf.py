"""Engine loader for transformers models: stored bundles -> cache -> generate.

Python API::

    lm = kdnctl.models.load.load_model()
    store = kdnctl.store.Store(".kdn", create=False)
    ctx = load_document(lm, store, "manual.md", label="full")   # or load_prefix(lm, store, ids)
    result = generate(lm, ctx, question_ids)

Stored keys already carry RoPE for their original positions, so a cache is rebuilt by
concatenating the chunks' K/V per layer. Pruned bundles hold fewer tokens than positions, and
layers may hold different counts (pyramid budgets): new tokens take positions that continue
from the ORIGINAL length, and kdnctl's attention function builds the causal mask per layer from
its own key length. A steering edit's bias follows the kept tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..format.bundle import KVBundle

from ..format.names import tensor_name
from ..errors import NotFoundError, StoreCorruptError
from ..models import adapter_for
from kdnctl.quant.store_basis import basis_shas, provide_store_bases
from ..store import LocalObjects, ReadStore, bundle_mismatch
from .dequant import INTO_SCHEMES, dequantize_into, dequantize_layers_into, ec_batch_into, ec_device_into, ec_staged_into
from .generate import GenerationResult, forward_suffix, full_prefill_generate, generate, stop_ids  # noqa: F401
from ..quant import layer_kv
from .context import CACHE_ROOM, LoadedContext, bundle_of
from .overlap import LayersReady, layer_groups
from . import streamed


@dataclass
class LoadProfile:
    """Seconds spent in each step of a load, summed over chunks (with ``workers=1`` the sum is
    the wall time; with more workers steps overlap and ``wall`` is what a user waits)."""

    read: float = 0.0
    hash: float = 0.0
    decode: float = 0.0
    dequantize: float = 0.0
    place: float = 0.0  # copy (and dtype cast) of each chunk into the preallocated cache
    wall: float = 0.0
    nbytes: int = 0

    def add(self, name: str, t0: float) -> float:
        now = time.perf_counter()
        setattr(self, name, getattr(self, name) + now - t0)
        return now


def _default_workers(n: int) -> int:
    return max(1, min(n, os.cpu_count() or 1, 8))


def _offsets(lens: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Per-layer totals and each chunk's first token per layer, from per-chunk layer lengths."""
    starts = [[0] * len(lens[0])]
    for lb in lens[:-1]:
        starts.append([s + t for s, t in zip(starts[-1], lb)])
    return [sum(lb[i] for lb in lens) for i in range(len(lens[0]))], starts


def _alloc(lm: LoadedModel, totals: list[int], h_kv: int, d: int, room: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) cache buffers: on CPU from the pooled arena (memory already
    faulted in by an earlier load, kdnctl/store/arena.py)."""
    if lm.device.type == "cpu":
        from ..store.arena import kv_buffers

        return kv_buffers(totals, h_kv, d, room, lm.dtype)
    return [(torch.empty(1, h_kv, n + room, d, device=lm.device, dtype=lm.dtype),
             torch.empty(1, h_kv, n + room, d, device=lm.device, dtype=lm.dtype)) for n in totals]


def context_from_bundles(lm: LoadedModel, bundles: list[KVBundle], *, label: str = "full", doc_id: str | None = None,
                         room: int = CACHE_ROOM, workers: int = 1, profile: LoadProfile | None = None,
                         bufs: list | None = None, placed: bool = False, overlap: bool = False) -> LoadedContext:
    """Chunk bundles (in order) -> one context for ``lm``: each layer's K/V is allocated once
    (context length plus ``room`` spare tokens) and every chunk is copied (cast, dequantized)
    straight into its slice: no concatenation, no intermediate whole-context tensors. With
    ``bufs`` (from ``_alloc``) the buffers exist already, and layers a reader placed there
    directly (kdnctl/engine/placed.py) are not copied again (``placed``: none needs a copy).
    ``overlap``: where the compiled ec decode applies, it runs in the background layer group by
    layer group (kdnctl/engine/overlap.py) and the context comes back at once, ``pending``."""
    if not bundles:
        raise NotFoundError("no chunks to load")
    n_layers, device = bundles[0].n_layers, lm.device
    names = set().union(*(b.tensors.keys() for b in bundles))  # every tensor name of any chunk
    per_layer = any(tensor_name(i, "positions") in names for i in range(n_layers))
    lens = [[b.layer_len(i) for i in range(n_layers)] if per_layer else [b.n_tokens] * n_layers for b in bundles]
    h_kv, d = int(bundles[0].meta["model"]["n_kv_heads"]), int(bundles[0].meta["model"]["head_dim"])
    totals, offsets = _offsets(lens)
    stacked = None
    # one [L, H, T, D] tensor per role, layers as views, when every layer holds as many tokens:
    # a chunk's layers are then dequantized in one stacked operation (dequantize_layers_into)
    # instead of one per layer (kernel launches on a GPU, Python and dispatch on a CPU)
    if bufs is None and device.type == "cpu":
        from ..store.arena import kv_arena

        bufs, stacked = kv_arena(totals, h_kv, d, room, lm.dtype)
    elif bufs is None and len(set(totals)) == 1:
        stacked = tuple(torch.empty(n_layers, h_kv, totals[0] + room, d, device=device, dtype=lm.dtype)
                        for _ in "kv")
        bufs = [(stacked[0][i][None], stacked[1][i][None]) for i in range(n_layers)]
    elif bufs is None:
        bufs = _alloc(lm, totals, h_kv, d, room)

    def place(c: int) -> None:
        if placed:  # the reader wrote every layer straight into its slot (kdnctl/engine/placed.py)
            return
        b, prof = bundles[c], LoadProfile()
        quant = b.meta.get("quant") or {}
        fast = quant.get("scheme") in INTO_SCHEMES
        n_done, quantized = 0, [b.is_quantized(i) for i in range(n_layers)]
        if stacked is not None and len(set(offsets[c])) == 1 and len(set(lens[c])) == 1 and len(set(quantized)) == 1:
            t0, s, t = time.perf_counter(), offsets[c][0], lens[c][0]
            if quantized[0] and fast:
                for role, big in zip(("keys", "values"), stacked):
                    dequantize_layers_into(big[:, :, s : s + t], b.tensors,
                                           [tensor_name(i, role) for i in range(n_layers)], quant)
                prof.add("dequantize", t0)
                n_done = n_layers
            elif not quantized[0] and device.type != "cpu":  # (on a CPU: no gain from the stack's copy)
                kv = [layer_kv(b, i) for i in range(n_layers)]
                stacked[0][:, :, s : s + t].copy_(torch.stack([k for k, _ in kv]))
                stacked[1][:, :, s : s + t].copy_(torch.stack([v for _, v in kv]))
                prof.add("place", t0)
                n_done = n_layers
        for i in range(n_done, n_layers):
            t0 = time.perf_counter()
            s, t = offsets[c][i], lens[c][i]
            if fast and b.is_quantized(i):  # straight into the cache slice
                dequantize_into(bufs[i][0][0, :, s : s + t], b.tensors, tensor_name(i, "keys"), quant)
                dequantize_into(bufs[i][1][0, :, s : s + t], b.tensors, tensor_name(i, "values"), quant)
                prof.add("dequantize", t0)
                continue
            k, v = layer_kv(b, i)
            if b.is_quantized(i):
                t0 = prof.add("dequantize", t0)
            for dst, src in ((bufs[i][0][0, :, s : s + t], k), (bufs[i][1][0, :, s : s + t], v)):
                if not (src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride() and src.dtype == dst.dtype):
                    dst.copy_(src)  # else: already in place
            prof.add("place", t0)
        if profile is not None:
            with _PROFILE_LOCK:
                profile.dequantize += prof.dequantize
                profile.place += prof.place

    # ec: every chunk decoded in one compiled pass per role (kdnctl/quant/ec_batch.py), straight into
    # a float32 CPU cache; into a GPU's cache by the device decoder (kdnctl/quant/ec_device.py: the
    # host inflates, a kernel per role writes the cache), else (no Triton, a half-precision CPU
    # cache) through float32 host memory
    ready = LayersReady(layer_groups(n_layers)) if overlap and profile is None else None
    batched = False
    if stacked is not None and not placed:
        if stacked[0].device.type == "cpu" and stacked[0].dtype == torch.float32:
            batched = ec_batch_into(bundles, n_layers, stacked, offsets, lens, profile, ready)
        else:
            ready = None  # (decoded before this returns)
            batched = ec_device_into(bundles, n_layers, stacked, offsets, lens, profile) or \
                ec_staged_into(bundles, n_layers, stacked, offsets, lens, profile)
    if not batched:
        ready = None
        _run(place, range(len(bundles)), workers)
    keys = [bufs[i][0][:, :, : totals[i]] for i in range(n_layers)]
    values = [bufs[i][1][:, :, : totals[i]] for i in range(n_layers)]
    bias = {}
    for layer in range(n_layers):
        if tensor_name(layer, "bias") in names or tensor_name(layer, "narrow") in names:  # steering, masked heads
            bs = [b.layer_bias(layer) for b in bundles]
            bs = [x.float() if x is not None else torch.zeros(lm.summary["n_q_heads"], lens[c][layer]) for c, x in enumerate(bs)]
            bias[layer] = torch.cat(bs, dim=1).to(device=device, dtype=lm.dtype)
    token_ids: list[int] = []
    for b in bundles:
        token_ids.extend(b.token_ids.tolist())
    next_position = int(bundles[-1].meta["token_end"])
    ctx = LoadedContext(keys, values, next_position, token_ids, bias, label, doc_id)
    for layer, att in enumerate(adapter_for(lm.model).layer_attention()):
        if att.window:
            ctx.positions[layer] = torch.cat([b.layer_positions(layer)[0] for b in bundles])
    ctx.buffers = bufs
    ctx.pending = ready
    return ctx


_PROFILE_LOCK = threading.Lock()


def _run(fn, items, workers: int) -> list:
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


def _read_bundles(lm: LoadedModel, store: ReadStore, hits, *, workers: int = 1,
                  profile: LoadProfile | None = None) -> tuple[list[KVBundle], int]:
    """Read, check (every byte, before decoding) and decode the chunks of ``hits`` ((version,
    chunk) pairs) in parallel threads (file reads and hashing release the GIL); each bundle's own
    metadata must match the record that points at it (a record aimed at another document's
    chunk is refused)."""
    checked = isinstance(store, LocalObjects)  # files we can read and check ourselves
    hits = list(hits)
    device = lm.device  # (a property that walks the model's parameters: read it once)
    slots: list = [None] * len(hits)
    if checked and device.type != "cuda":  # pooled memory (faulted in by earlier loads), catalog sizes
        from ..store.arena import READ_POOL, byte_slices

        sizes = [max(0, int(ref.nbytes)) for _, ref in hits]
        if sum(sizes) <= READ_POOL.max_bytes:  # (a damaged size only costs a fresh buffer)
            slots = byte_slices(sizes)

    def one(item):
        slot, (version, ref) = item
        prof = LoadProfile()
        t0 = time.perf_counter()
        if checked:
            from ..store.fastread import check_bytes, read_into

            if device.type == "cuda":  # page-locked memory: the host-to-device copy runs async
                from .gpu_transfer import pinned_buffer as alloc
            else:
                alloc = lambda n: slot if slot is not None and n == len(slot) else None  # noqa: E731
            data = read_into(store.object_path(ref.object), alloc=alloc)
            t0 = prof.add("read", t0)
            check_bytes(data, ref.object, getattr(ref, "blake3", None), getattr(ref, "xxh3", None))
            t0 = prof.add("hash", t0)
        else:  # a remote store: its read_object verifies
            data = store.read_object(ref.object)
            t0 = prof.add("read", t0)
        b = bundle_of(lm, version, ref, data)
        t0 = prof.add("decode", t0)
        if device.type == "cuda":  # one transfer per object; placement is then on the device
            from .gpu_transfer import bundle_to_device

            b = bundle_to_device(b, data, device)
            prof.add("place", t0)
        if profile is not None:
            with _PROFILE_LOCK:
                profile.read += prof.read
                profile.hash += prof.hash
                profile.decode += prof.decode
                profile.place += prof.place
        return b, len(data)

    out = _run(one, list(zip(slots, hits)), workers)
    return [b for b, _ in out], sum(n for _, n in out)


def _load_placed(lm: LoadedModel, store: ReadStore, hits, profile: LoadProfile | None):
    """(bundles, buffers, bytes) read straight into a fresh cache (kdnctl/engine/placed.py), or
    None when some chunk cannot be placed directly (quantized, another dtype, unreadable header)."""
    from . import placed

    if not hits or lm.device.type != "cpu":
        return None
    s, dtype = lm.summary, lm.dtype
    t0 = time.perf_counter()
    plans = []
    for hit in hits:
        p = placed.plan(store.object_path(hit[1].object), hit, dtype=dtype, n_layers=s["n_layers"],
                        h_kv=s["n_kv_heads"], head_dim=s["head_dim"])
        if p is None:
            return None
        plans.append(p)
    totals, starts = _offsets([p.lens for p in plans])
    bufs = _alloc(lm, totals, s["n_kv_heads"], s["head_dim"], CACHE_ROOM)
    views = placed.byte_views(bufs)
    if profile is not None:
        profile.decode += time.perf_counter() - t0
    bundles = []
    for p, st in zip(plans, starts):
        b = placed.read_placed(p, bufs, views, st, expect_fingerprint=lm.fingerprint, profile=profile)
        why = bundle_mismatch(p.hit[0], p.hit[1], b.meta)
        if why:
            raise StoreCorruptError(f"catalog record does not match its bundle: {why}",
                                    hint="run `kdnctl verify`; the version record is damaged or was tampered with")
        bundles.append(b)
    return bundles, bufs, sum(p.size for p in plans)


def load_chunks(lm: LoadedModel, store: ReadStore, hits, *, label: str = "full", doc_id: str | None = None,
                workers: int | None = None, profile: LoadProfile | None = None, overlap: bool = False) -> LoadedContext:
    """(version, chunk) hits -> a context (read + check + decode, then placement). Local dense
    chunks in the model's dtype are read straight into the cache (one pass over the bytes);
    anything else is read whole, checked, decoded and copied (dequantized) into it. ``overlap``:
    see :func:`context_from_bundles`."""
    t = time.perf_counter()
    if workers is None:
        # Local objects come from the page cache at memory speed: extra threads only contend
        # with torch's own threads for the cores (measured on 2 cores at 4k tokens: fp32 load
        # 0.075 s with one thread vs 0.114 s with two; int8 0.091 vs 0.204). Remote objects
        # wait on the network: fetch those in parallel.
        workers = 1 if isinstance(store, LocalObjects) else _default_workers(len(hits))
    direct = _load_placed(lm, store, hits, profile) if isinstance(store, LocalObjects) else None
    fetched = None
    if direct is None and profile is None and hits and streamed.applies(lm, store):
        # a remote ec version that keeps every token: decoded as its chunks arrive
        fetched = streamed.load_streamed(lm, store, hits, label=label, doc_id=doc_id, workers=workers,
                                         overlap=overlap, room=CACHE_ROOM)
        if fetched.ctx is not None:
            fetched.ctx.load_s, fetched.ctx.nbytes = time.perf_counter() - t, fetched.nbytes
            return fetched.ctx
    if direct is not None:
        bundles, bufs, nbytes = direct
    elif fetched is not None:  # fetched already, not for the streamed decode: placed the usual way
        bufs, bundles, nbytes = None, fetched.bundles, fetched.nbytes
        provide_store_bases(store, basis_shas(b.meta for b in bundles))
    else:
        bufs = None
        bundles, nbytes = _read_bundles(lm, store, hits, workers=workers, profile=profile)
        provide_store_bases(store, basis_shas(b.meta for b in bundles))  # bases the store holds, not the package
    ctx = context_from_bundles(lm, bundles, label=label, doc_id=doc_id, workers=1, profile=profile, bufs=bufs,
                               placed=direct is not None, overlap=overlap)
    ctx.load_s = time.perf_counter() - t
    ctx.nbytes = nbytes
    if profile is not None:
        profile.wall += ctx.load_s
        profile.nbytes += nbytes
    return ctx


def load_document(lm: LoadedModel, store: ReadStore, doc_id: str, label: str = "full", doc_version: str | None = None, *,
                  workers: int | None = None, profile: LoadProfile | None = None, overlap: bool = False) -> LoadedContext:
    """Load every chunk of a stored document version into a context for ``lm``. ``overlap``:
    the context may come back while its last layers are still being decoded (``ctx.pending``:
    the first cache built over it waits layer by layer, ``ctx.settle()`` waits for all)."""
    t = time.perf_counter()
    return load_version(lm, store, store.get_version(doc_id, label, doc_version), t0=t, workers=workers,
                        profile=profile, overlap=overlap)


def load_version(lm: LoadedModel, store: ReadStore, version, *, t0: float | None = None, workers: int | None = None,
                 profile: LoadProfile | None = None, overlap: bool = False) -> LoadedContext:
    """Load a version record a caller already holds (``load_document`` looks it up)."""
    t = time.perf_counter() if t0 is None else t0
    doc_id, label = version.doc_id, version.label
    if version.fingerprint != lm.fingerprint:
        from ..errors import ModelMismatchError

        raise ModelMismatchError(
            f"{doc_id} [{label}] was made with model {version.fingerprint[:12]}, "
            f"the loaded model is {lm.fingerprint[:12]}"
        )
    try:
        ctx = load_chunks(lm, store, [(version, c) for c in version.chunks], label=label, doc_id=doc_id,
                          workers=workers, profile=profile, overlap=overlap)
    except StoreCorruptError as exc:
        # a missing object of a version that is no longer current was reclaimed by gc (after its
        # grace period): the store is healthy, the load was just slower than the grace period
        if "missing" in exc.message and not _still_stored(store, version):
            raise NotFoundError(f"{doc_id} [{label}] changed while it was being loaded (a newer version replaced "
                                "it and gc reclaimed the old one)", hint="retry the load") from None
        raise
    if lm.device.type == "cuda":  # host-to-device copies may still be queued: the clock waits for them
        torch.cuda.synchronize(lm.device)
    ctx.load_s = time.perf_counter() - t
    return ctx


def _still_stored(store: ReadStore, version) -> bool:
    try:
        now = store.get_version(version.doc_id, version.label)
    except NotFoundError:
        return False
    return now.doc_version == version.doc_version and now.chunks == version.chunks


def load_prefix(lm: LoadedModel, store: ReadStore, token_ids: list[int], label: str = "full", chunk_tokens: int | None = None):
    """Find the longest stored prefix of ``token_ids`` (prefix hash chain) and load it.

    Returns (context or None, number of matched tokens)."""
    from ..ingest.chunking import chain_hashes

    t = time.perf_counter()
    sizes = [chunk_tokens] if chunk_tokens else store.chunk_sizes()
    best: tuple[list, int] = ([], 0)
    for size in sizes:
        refs = []
        for h in chain_hashes(token_ids, size, lm.fingerprint):
            hit = store.lookup_chunk(lm.fingerprint, label, h)
            if hit is None:
                break
            refs.append(hit)
        matched = refs[-1][1].token_end if refs else 0
        if matched > best[1]:
            best = (refs, matched)
    refs, matched = best
    if not refs:
        return None, 0
    ctx = load_chunks(lm, store, refs, label=label)
    ctx.load_s = time.perf_counter() - t
    return ctx, matched
