"""A load from a remote store whose decode starts while later chunks are still on the wire.

Over a link the chunks of a version arrive over a while, and a load that fetches every chunk
before decoding any adds the two times. A remote load of an ``ec`` version whose chunks keep
every token (the 0.25 default) knows its cache's shape from the version record alone (each
chunk's token range), so it allocates the cache first, fetches the chunks in parallel, and hands
each one, read and checked, to the compiled batch decoder (``kdnctl.quant.ec_batch``) as it
comes: a chunk's layers are decoded while the next chunks download. Once every chunk is here
the context comes back with its last layer groups still decoding behind the question's forward,
as a local load's does (``kdnctl.engine.overlap``). The K/V are those of a load that fetches
first (``tests/test_streamed_load.py``).

A chunk that turns out otherwise (tokens evicted, a steering bias, narrowed heads, another
layout) ends the decode; the load then places every chunk the usual way, from the chunks
already fetched (nothing is fetched twice).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..format.names import tensor_name
from ..quant import ec_batch
from ..quant.store_basis import basis_shas, provide_store_bases
from ..store import LocalObjects
from .context import LoadedContext, bundle_of
from .overlap import LayersReady, layer_groups


def applies(lm, store) -> bool:
    """A remote store, a float32 cache on the host, and the compiled decoder present."""
    return (not isinstance(store, LocalObjects) and lm.device.type == "cpu" and lm.dtype == torch.float32
            and ec_batch.enabled())


@dataclass
class Streamed:
    """What a streamed load fetched: every bundle and their bytes; ``ctx`` the context, or None
    where a chunk did not fit the streamed decode (the caller places ``bundles`` the usual way)."""

    bundles: list
    nbytes: int
    ctx: LoadedContext | None


def _fits(b, n_layers: int, n_tokens: int, quant: dict) -> bool:
    """Chunk ``b`` is what the streamed decode writes: ``ec`` in every layer, each layer holding
    its record's ``n_tokens``, the version's quant layout, no steering bias."""
    q = b.meta.get("quant") or {}
    if b.n_layers != n_layers or q.get("scheme") != "ec":
        return False
    if not all(b.is_quantized(i) and b.layer_len(i) == n_tokens for i in range(n_layers)):
        return False
    if any(tensor_name(i, "bias") in b.tensors for i in range(n_layers)):
        return False
    return ec_batch.batch_layout([b], n_layers, quant)


def load_streamed(lm, store, hits, *, label: str, doc_id: str | None, workers: int, overlap: bool,
                  room: int) -> Streamed:
    """Fetch ``hits`` ((version, chunk) pairs, in order) from ``store`` on ``workers`` threads,
    decoding each chunk into a cache allocated from the records' token ranges as it arrives."""
    from ..store.arena import kv_arena

    n_layers, h_kv, d = (int(lm.summary[k]) for k in ("n_layers", "n_kv_heads", "head_dim"))
    lens = [int(ref.token_end) - int(ref.token_start) for _, ref in hits]
    starts = [sum(lens[:c]) for c in range(len(hits))]
    total = sum(lens)
    ready = LayersReady(layer_groups(n_layers))
    bundles: list = [None] * len(hits)
    sizes = [0] * len(hits)
    # the decode and the cache's buffers (made at the first chunk that fits), the decode given up
    state = {"decoder": None, "bufs": None, "off": False}
    lock = threading.Lock()

    def give_up() -> None:
        state["off"] = True
        if state["decoder"] is not None:
            state["decoder"].abort()

    def one(c: int) -> None:
        version, ref = hits[c]
        data = store.read_object(ref.object)  # (checked against its digest by the remote store)
        b = bundle_of(lm, version, ref, data)
        bundles[c], sizes[c] = b, len(data)
        with lock:
            if state["off"]:
                return
            quant = b.meta.get("quant") or {}
            if state["decoder"] is None:
                bufs, stacked = kv_arena([total] * n_layers, h_kv, d, room, lm.dtype) if _fits(
                    b, n_layers, lens[c], quant) else (None, None)
                if stacked is None:
                    give_up()
                    return
                state["bufs"] = bufs
                provide_store_bases(store, basis_shas([b.meta]))  # a key basis the store holds, not the package
                decoder = ec_batch.GroupedDecode(stacked, [None] * len(hits), starts, quant, groups=ready.groups,
                                                 on_group=ready.done)
                state["decoder"] = decoder
                # one worker: the fetch threads, and then the question's forward, keep the other core
                ready.start(lambda r: decoder.run(workers=1), helper=decoder.help)
            elif not _fits(b, n_layers, lens[c], state["decoder"].quant_meta):
                give_up()
                return
            state["decoder"].arrive(c, b)

    pool = ThreadPoolExecutor(max(1, min(workers, len(hits))))
    try:
        for f in [pool.submit(one, c) for c in range(len(hits))]:
            f.result()
    except BaseException:
        # the first failure ends the load: the downloads not started are dropped, the decode stops
        with lock:
            give_up()
        pool.shutdown(wait=True, cancel_futures=True)
        ready.join()
        raise
    finally:
        pool.shutdown(wait=True)
    if state["off"]:
        ready.join()  # (a decode given up: its thread stops at its next job)
        return Streamed(bundles, sum(sizes), None)
    bufs = state["bufs"]
    keys = [bufs[i][0][:, :, :total] for i in range(n_layers)]
    values = [bufs[i][1][:, :, :total] for i in range(n_layers)]
    token_ids: list[int] = []
    for b in bundles:
        token_ids.extend(b.token_ids.tolist())
    ctx = LoadedContext(keys, values, int(bundles[-1].meta["token_end"]), token_ids, {}, label, doc_id)
    from ..models import adapter_for

    for layer, att in enumerate(adapter_for(lm.model).layer_attention()):
        if att.window:
            ctx.positions[layer] = torch.cat([b.layer_positions(layer)[0] for b in bundles])
    ctx.buffers = bufs
    ctx.pending = ready
    if not overlap:
        ctx.settle()
    return Streamed(bundles, sum(sizes), ctx)
