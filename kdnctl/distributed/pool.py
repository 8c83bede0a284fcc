"""The driver loop shared by distributed jobs: keep every worker busy with a bounded number of
tasks in flight, collect results as they finish, and hand them to ``commit`` in batches.

Fault model: a worker process that dies is restarted by Ray (it reloads its model) and its
in-flight tasks are retried there (``max_restarts`` / ``max_task_retries`` on the actor), which
is safe because workers only write content-addressed objects. Only after the retries are spent
does the job stop, with the results already received committed first.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from ..errors import KdnError, UsageError, WorkerError


def _result(ray, ref, what: str) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, KdnError):
            raise cause from None  # a domain error in a worker reads as it would locally
        raise WorkerError(f"{what} failed in a worker: {cause or e}") from None
    except ray.exceptions.RayActorError as e:
        raise WorkerError(f"{what}: the worker died more often than its retries allow ({type(e).__name__})") from None


def start(ray, actors: list) -> list[dict]:
    """Wait until every worker has loaded its model; their ``describe()``."""
    return [_result(ray, a.describe.remote(), "starting a worker") for a in actors]


def drive(
    ray,
    actors: list,
    tasks: Iterable[tuple[str, tuple]],
    call: Callable[[Any, tuple], Any],
    commit: Callable[[list], None],
    *,
    in_flight: int = 2,
    batch_size: int = 16,
    batch_seconds: float = 5.0,
    on_dispatch: Callable[[str, int], None] | None = None,
    on_result: Callable[[Any], None] | None = None,
) -> None:
    """Run ``call(actor, args)`` for every ``(name, args)`` of ``tasks`` (consumed lazily) with at
    most ``in_flight`` tasks per actor, and ``commit`` results in batches of ``batch_size`` or
    every ``batch_seconds``, whichever comes first (and once more at the end, or on failure)."""
    if batch_size < 1:
        raise UsageError(f"--batch must be >= 1, got {batch_size}")
    queue = iter(tasks)
    load = [0] * len(actors)
    pending: dict[Any, tuple[str, int]] = {}
    batch: list = []
    last_commit = time.monotonic()
    exhausted = False
    try:
        while True:
            while not exhausted and min(load) < in_flight:
                nxt = next(queue, None)
                if nxt is None:
                    exhausted = True
                    break
                name, args = nxt
                i = load.index(min(load))
                pending[call(actors[i], args)] = (name, i)
                load[i] += 1
                if on_dispatch:
                    on_dispatch(name, i)
            if not pending:
                break
            wait = max(0.05, batch_seconds - (time.monotonic() - last_commit))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            for ref in ready:
                name, i = pending.pop(ref)
                load[i] -= 1
                res = _result(ray, ref, name)
                batch.append(res)
                if on_result:
                    on_result(res)
            if batch and (len(batch) >= batch_size or time.monotonic() - last_commit >= batch_seconds):
                done, batch = batch, []
                commit(done)
                last_commit = time.monotonic()
    finally:
        if batch:  # what finished before a failure (or an interrupt) is kept
            done, batch = batch, []
            commit(done)
