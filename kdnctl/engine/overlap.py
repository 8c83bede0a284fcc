"""A load whose decode runs behind the question's forward, layer group by layer group.

The question's forward needs layer ``i``'s K/V only when it reaches layer ``i``. A CPU load of
entropy-coded chunks decodes every chunk of the first layers first, in a background thread, and
the forward waits at each layer until that layer's group is written (``LayersReady.wait``, from
the cache layer's first update): the decode of the last layers overlaps the forward of the first
ones. The K/V, hence the logits, are those of a load that decodes first and answers after
(``tests/test_overlap.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

GROUPS = 6  # layer groups: the forward waits for the first ~1/6 of the decode, not all of it


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

    def done(self, g: int) -> None:
        self._events[g].set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        for e in self._events:
            e.set()

    def start(self, decode: Callable[["LayersReady"], None]) -> None:
        """Run ``decode(self)`` in a background thread; whatever it raises reaches every waiter."""
        def run():
            try:
                decode(self)
            except BaseException as exc:  # noqa: BLE001 (handed to the waiting forward, raised there)
                self.fail(exc)
            else:
                for e in self._events:  # (a decode that wrote everything without reporting a group)
                    e.set()

        self._thread = threading.Thread(target=run, name="kdnctl-decode", daemon=True)
        self._thread.start()

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s group is written; raise the decode's error if it failed."""
        self._events[self._group_of.get(layer, len(self.groups) - 1)].wait()
        if self._error is not None:
            raise self._error

    def wait_all(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
