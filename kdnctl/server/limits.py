"""Connection limits and timeouts for serve-files (uvicorn's h11 protocol, guarded).

uvicorn arms its keep-alive timer only after a response and cancels it on the first byte that
arrives, and its ``limit_concurrency`` answers 503 to REAL requests once idle sockets fill the
table. So a client that connects and sends nothing, or half a header, is never dropped, and a
few hundred of them lock everyone out. ``GuardedH11`` adds what is missing:

- a header timeout, armed when a connection opens and again after every response, cleared
  only when a complete request head has arrived (not on the first byte);
- a connection cap over open connections (one already being closed no longer counts, so a
  burst of timeouts or evictions does not evict again): at the cap, a new connection evicts
  the connection that has waited longest without sending a complete request head, taking
  one that never completed a request (idle from connect, or a slow header) before a
  keep-alive connection between a client's requests; if every connection is busy with a real
  request, the new one is closed instead.
Slow request bodies are bounded by the app (``Limits.body_timeout_s`` -> 408).
"""

from __future__ import annotations

import dataclasses

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclasses.dataclass(frozen=True)
class Limits:
    header_timeout_s: float = 10.0  # from connect (or the last response) to a complete request head
    body_timeout_s: float = 30.0  # to receive a whole request body
    keep_alive_s: float = 5.0  # idle keep-alive connections close after this
    max_connections: int = 512  # open sockets; keep well under the process's file descriptor limit

    def __post_init__(self):
        from ..errors import UsageError

        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise UsageError(f"max_connections must be >= 1, got {self.max_connections}")


def guarded_protocol(limits: Limits) -> type:
    class GuardedH11(H11Protocol):
        _limits = limits

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._timer = None
            self._served = False  # True once a response went out on this connection
            self._waiting_since = self.loop.time()
            self._arm()
            if sum(not p.transport.is_closing() for p in self.connections) > self._limits.max_connections:
                self._make_room()

        def _arm(self) -> None:
            self._disarm()
            self._waiting_since = self.loop.time()
            self._timer = self.loop.call_later(self._limits.header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
                self._timer = None

        @property
        def waiting_for_head(self) -> bool:
            return getattr(self, "_timer", None) is not None

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()  # no answer: a client that sends no request gets none

        def _make_room(self) -> None:
            idle = [p for p in self.connections if p is not self and getattr(p, "waiting_for_head", False)
                    and not p.transport.is_closing()]
            if idle:
                victim = min(idle, key=lambda p: (p._served, p._waiting_since))
                victim._disarm()
                victim.transport.close()
            else:  # every other connection is serving a real request
                self._disarm()
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.waiting_for_head and self.conn.their_state is not h11.IDLE:
                self._disarm()  # a complete request head arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._served = True
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's head must arrive in time too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11


def uvicorn_limits(limits: Limits | None = None) -> dict:
    """uvicorn.Config keyword arguments that apply ``limits``."""
    limits = limits or Limits()
    return {"http": guarded_protocol(limits), "timeout_keep_alive": limits.keep_alive_s}
