"""Memory reused across loads: cache buffers, read buffers, downloads.

A load writes every K/V byte of a context into freshly allocated cache buffers. Fresh memory
from the OS costs a page fault (and the kernel zeroing the page) on first touch: measured here
at 4k tokens of SmolLM2 in fp32 (190 MB), reading into fresh buffers took several times longer
than reading into buffers already touched, and the allocator returns big freed blocks to the OS,
so every ask paid it again. A serving process asks over and over: this pool keeps the memory of
finished contexts and hands it to the next load.

One ``bytearray`` arena per load holds every layer's keys and values (``torch.frombuffer``
views). A view holds a reference to its arena, so an arena is free exactly when the pool's own
reference is the only one left (``sys.getrefcount``): a context, a cache over it or any tensor
still viewing it keeps it out of reuse. The pool keeps at most ``max_arenas`` arenas of at most
``max_bytes`` together; bigger requests are simply allocated and left to the allocator.
"""

from __future__ import annotations

import sys
import threading

import torch

from .fastread import new_buffer

ALIGN = 64


class ArenaPool:
    def __init__(self, max_arenas: int = 2, max_bytes: int = 2 << 30):
        self.max_arenas, self.max_bytes = max_arenas, max_bytes
        self._arenas: list[bytearray] = []
        self._lock = threading.Lock()

    @staticmethod
    def _counts(arenas: list) -> list[int]:
        return [sys.getrefcount(a) for a in arenas]

    def _states(self) -> list[tuple[bytearray, bool]]:
        """Each arena and whether it is free. The baseline is an object that only a list holds,
        counted by the same code: whatever references the interpreter itself adds while
        counting (loop variable, argument) cancel out."""
        base = self._counts([bytearray()])[0]
        return [(a, c <= base) for a, c in zip(self._arenas, self._counts(self._arenas))]

    def take(self, nbytes: int, *, exact: bool = False) -> bytearray:
        """A writable arena of at least ``nbytes`` (exactly ``nbytes`` with ``exact``; contents
        undefined) that nothing else references."""
        with self._lock:
            states = self._states()
            free = [a for a, ok in states if ok]
            busy = [a for a, ok in states if not ok]
            del states
            fits = [a for a in free if (len(a) == nbytes if exact else nbytes <= len(a) <= 2 * nbytes + (16 << 20))]
            if fits:
                return min(fits, key=len)
            fresh = new_buffer(nbytes)
            if nbytes <= self.max_bytes:
                room = self.max_arenas - len(busy) - 1
                budget = self.max_bytes - nbytes - sum(len(a) for a in busy)
                keep = busy
                for a in sorted(free, key=len, reverse=True):
                    if room > 0 and len(a) <= budget:
                        keep.append(a)
                        room, budget = room - 1, budget - len(a)
                self._arenas = keep + [fresh]
            return fresh

    def clear(self) -> None:
        with self._lock:
            self._arenas = []


POOL = ArenaPool()  # cache buffers
READ_POOL = ArenaPool()  # whole objects read for decoding (quantized chunks): dead once placed
STAGING_POOL = ArenaPool(max_arenas=1)  # float32 K/V decoded on the host for a half-precision cache: dead once cast
# downloaded objects (kdnctl/store/fetch.py), one exact-size bytearray each: a document's chunks
# mostly share one size, so the next load's downloads land in memory the last one faulted in
FETCH_POOL = ArenaPool(max_arenas=64, max_bytes=512 << 20)


def byte_slices(sizes: list[int], pool: ArenaPool | None = READ_POOL) -> list[memoryview]:
    """One writable, 64-byte aligned ``memoryview`` per size, all carved from one pooled arena."""
    step = [(n + ALIGN - 1) // ALIGN * ALIGN for n in sizes]
    need = sum(step) + ALIGN
    arena = pool.take(need) if pool is not None else new_buffer(need)
    mv, at = memoryview(arena), (-_address(arena)) % ALIGN
    out = []
    for n, st in zip(sizes, step):
        out.append(mv[at : at + n])
        at += st
    return out


def kv_buffers(totals: list[int], h_kv: int, head_dim: int, room: int, dtype: torch.dtype,
               pool: ArenaPool | None = POOL) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) CPU buffers ``[1, h_kv, total + room, head_dim]`` carved from
    one pooled arena (``pool=None``: a fresh one): every layer's keys, then every layer's values."""
    return kv_arena(totals, h_kv, head_dim, room, dtype, pool)[0]


def kv_arena(totals: list[int], h_kv: int, head_dim: int, room: int, dtype: torch.dtype,
             pool: ArenaPool | None = POOL):
    """``(per-layer buffers, stacked)`` where ``stacked`` is ``(keys, values)`` of shape
    ``[L, h_kv, total + room, head_dim]`` whose rows ARE the layer buffers, when every layer
    holds the same number of tokens (else None): a chunk's layers can then be written in one
    operation (``dequantize_layers_into``)."""
    esz = torch.empty(0, dtype=dtype).element_size()
    sizes = [h_kv * (n + room) * head_dim * esz for n in totals]
    step = [(s + ALIGN - 1) // ALIGN * ALIGN for s in sizes]
    need = 2 * sum(step) + ALIGN
    arena = pool.take(need) if pool is not None else new_buffer(need)
    at = (-_address(arena)) % ALIGN
    uniform = len(set(totals)) == 1 and step[0] == sizes[0] and sizes[0] > 0
    if uniform:
        n, count = totals[0], len(totals) * sizes[0] // esz
        stacked = tuple(torch.frombuffer(arena, dtype=dtype, count=count, offset=at + r * len(totals) * sizes[0])
                        .view(len(totals), h_kv, n + room, head_dim) for r in range(2))
        return [(stacked[0][i][None], stacked[1][i][None]) for i in range(len(totals))], stacked
    roles = []
    for _ in range(2):
        role = []
        for n, s, st in zip(totals, sizes, step):
            t = torch.frombuffer(arena, dtype=dtype, count=s // esz, offset=at) if s else torch.empty(0, dtype=dtype)
            role.append(t.view(1, h_kv, n + room, head_dim))
            at += st
        roles.append(role)
    return list(zip(roles[0], roles[1])), None


def _address(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if len(buf) else 0
