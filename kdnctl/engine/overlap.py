"""A load whose decode runs behind the question's forward, layer group by layer group.

The question's forward needs layer ``i``'s K/V only when it reaches layer ``i``. A CPU load of
entropy-coded chunks decodes every chunk of the first layers first, in a background thread, and
the forward waits at each layer until that layer's group is written (``LayersReady.wait``, from
the cache layer's first update): the decode of the last layers overlaps the forward of the first
ones. A thread that waits does not idle: it decodes jobs of the group it waits for beside the
background thread (``helper``), so the forward's wait for the first group is cut by about 40% on two
cores; and while the decode runs, the forward's torch threads leave it a core
(``LayersReady.sharing_cores``). The K/V, hence the logits, are those of a load that decodes
first and answers after (``tests/test_overlap.py``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch

GROUPS = 6  # layer groups: the forward waits for the first ~1/6 of the decode, not all of it
SHARE_CORES = True  # the forward leaves the decode's core to it while the decode runs (``sharing_cores``)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def layer_groups(n_layers: int, n_groups: int = GROUPS) -> list[range]:
    """``n_layers`` cut into at most ``n_groups`` consecutive ranges of near-equal size."""
    n = max(1, min(n_groups, n_layers))
    cuts = [round(k * n_layers / n) for k in range(n + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


class LayersReady:
    """Which layer groups a background decode has written, and the error that stopped it."""

    def __init__(self, groups: list[range]):
        self.groups = groups
        self._events = [threading.Event() for _ in groups]
        self._group_of = {i: g for g, r in enumerate(groups) for i in r}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # helper(g): decode one more job of group g or an earlier one in the calling thread; False
        # when none is left to take there
        self._helper: Callable[[int], bool] | None = None
        self._sharing = False  # this decode's forward runs on fewer torch threads (``sharing_cores``)

    def done(self, g: int) -> None:
        self._events[g].set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        for e in self._events:
            e.set()

    def start(self, decode: Callable[["LayersReady"], None], helper: Callable[[int], bool] | None = None) -> None:
        """Run ``decode(self)`` in a background thread; whatever it raises reaches every waiter.
        ``helper(g)``: a waiter's share of the same work (see ``_help``)."""
        self._helper = helper
        def run():
            try:
                decode(self)
            except BaseException as exc:  # noqa: BLE001 (handed to the waiting forward, raised there)
                self.fail(exc)
            else:
                for e in self._events:  # (a decode that wrote everything without reporting a group)
                    e.set()
            finally:
                # the decode (and through it the cache's buffers) no longer hangs off this object:
                # the two referenced each other, which kept a context's pooled memory from reuse
                # until the garbage collector's next full pass, and the next load allocated afresh
                self._helper = None

        self._thread = threading.Thread(target=run, name="kdnctl-decode", daemon=True)
        self._thread.start()

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s group is written, decoding jobs of it meanwhile; raise the
        decode's error if it failed."""
        g = self._group_of.get(layer, len(self.groups) - 1)
        self._help(g)
        self._events[g].wait()
        if self._sharing and all(e.is_set() for e in self._events):
            self._give_back_cores()
        if self._error is not None:
            raise self._error

    @contextmanager
    def sharing_cores(self, decode_threads: int = 1):
        """Around the forward that waits on this decode: while the decode runs, the forward's torch
        threads leave ``decode_threads`` of the process's cores to it, and take them back at the
        first layer after the decode is done (or when the block ends). A forward whose threads
        already leave that room is not touched. On two cores, a two-thread forward beside the
        decode thread stalls at every parallel region the decode preempts. torch's thread count
        is the process's: other torch work of the process runs on the fewer threads meanwhile,
        and forwards that share at the same time (threads of one process asking at once) leave
        it lowered once and restore it when the last of them is done."""
        if self._take_cores(decode_threads):
            try:
                yield
            finally:
                self._give_back_cores()
        else:
            yield

    def _take_cores(self, decode_threads: int) -> bool:
        """Lower torch's threads for this forward (or count it beside a forward that already did);
        False where nothing is to be shared."""
        with _SHARED_LOCK:
            if not SHARE_CORES or all(e.is_set() for e in self._events):
                return False
            if _SHARED["users"] == 0:
                n = torch.get_num_threads()
                fewer = max(1, min(n, usable_cores() - decode_threads))
                if fewer >= n:
                    return False
                _SHARED["threads"] = n
                torch.set_num_threads(fewer)
            _SHARED["users"] += 1
            self._sharing = True
            return True

    def _give_back_cores(self) -> None:
        with _SHARED_LOCK:
            if not self._sharing:
                return
            self._sharing = False
            _SHARED["users"] -= 1
            if _SHARED["users"] == 0:
                torch.set_num_threads(_SHARED["threads"])

    def wait_all(self) -> None:
        self._help(len(self.groups) - 1)
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    def join(self) -> None:
        """Wait for the background decode's thread to end, without its error (a load that gave
        the decode up, or failed for another reason, raises its own)."""
        if self._thread is not None:
            self._thread.join()

    def _help(self, g: int) -> None:
        """Take jobs of group ``g`` or earlier while any is left and the group is not written; an
        error in one is the decode's error (every waiter gets it)."""
        while (helper := self._helper) is not None and self._error is None and not self._events[g].is_set():
            try:
                if not helper(g):
                    return
            except BaseException as exc:  # noqa: BLE001 (raised to this waiter and every other)
                self.fail(exc)


# the torch threads the first of the forwards sharing their cores found, restored by the last
_SHARED_LOCK = threading.Lock()
_SHARED = {"users": 0, "threads": 0}
