"""What a load hands to generation: a document's K/V in the cache's buffers (``LoadedContext``),
and a checked chunk's bundle (``bundle_of``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import StoreCorruptError
from ..format.bundle import KVBundle, decode_bundle
from ..store import bundle_mismatch
from .attention import AttentionState
from .overlap import LayersReady

CACHE_ROOM = 256  # spare tokens behind a loaded context: the question and the answer go there


@dataclass
class LoadedContext:
    keys: list[torch.Tensor]  # per layer [1, H_kv, T_l, D]
    values: list[torch.Tensor]
    next_position: int  # first position for new tokens (= original context length)
    token_ids: list[int]  # original context tokens (what a full prefill would run)
    bias: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_q, T_l]
    label: str = "full"
    doc_id: str | None = None
    load_s: float = 0.0
    nbytes: int = 0
    # Per layer (kbuf, vbuf) [1, H_kv, T_l + room, D] of which keys[l]/values[l] are the first
    # T_l tokens (set by the loader); the first cache built over them writes new tokens in place.
    buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)
    # sliding-window layers: original positions of the cached keys (int64 [T_l])
    positions: dict[int, torch.Tensor] = field(default_factory=dict)
    # a decode still writing the buffers (``load_document(..., overlap=True)``): the first cache
    # waits layer by layer, anything else calls ``settle`` first
    pending: LayersReady | None = field(default=None, repr=False)

    def settle(self) -> None:
        """Wait until every layer's K/V is written (raises the decode's error, if any)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait_all()

    def attention_state(self) -> AttentionState:
        return AttentionState(bias=dict(self.bias), layer_positions=dict(self.positions),
                              next_position=self.next_position)

    @property
    def n_tokens(self) -> int:
        return self.next_position

    @property
    def kept_tokens(self) -> float:
        return sum(k.shape[2] for k in self.keys) / len(self.keys)

    def make_cache(self, config, room: int = CACHE_ROOM):
        """A cache over this context. The first one built uses the loader's buffers directly
        (no copy); later ones (another question over the same context) copy once into fresh
        buffers, so two caches never write into the same memory."""
        from .kvcache import cache_over, prealloc_buffers

        layers = []
        claim = self.buffers is not None
        if not claim:
            self.settle()  # (copies below read the buffers)
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            own = self.buffers[i] if claim else None
            if own is not None and _is_prefix_view(own, k, v):
                layers.append((own[0], own[1], k.shape[2]))
            else:
                self.settle()
                kb, vb = prealloc_buffers(k, v, room)
                layers.append((kb, vb, k.shape[2]))
        self.buffers = None  # handed out: the next cache copies
        return cache_over(config, layers, None if self.pending is None else self.pending.wait)


def _is_prefix_view(own, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``k``/``v`` are exactly the first tokens of the buffers ``own`` (nobody replaced them)."""
    kb, vb = own
    return (k.data_ptr() == kb.data_ptr() and v.data_ptr() == vb.data_ptr() and k.shape[:2] == kb.shape[:2]
            and k.shape[3] == kb.shape[3] and k.stride() == kb.stride() and v.stride() == vb.stride()
            and k.shape == v.shape and k.shape[2] <= kb.shape[2])


def bundle_of(lm, version, ref, data) -> KVBundle:
    """The bundle in ``data`` (checked bytes of ``ref``'s object), refused where its own metadata
    does not match the record that points at it (a record aimed at another document's chunk)."""
    b = decode_bundle(data, expect_fingerprint=lm.fingerprint)
    why = bundle_mismatch(version, ref, b.meta)
    if why:
        raise StoreCorruptError(f"catalog record does not match its bundle: {why}",
                                hint="run `kdnctl verify`; the version record is damaged or was tampered with")
    return b
