"""Connect to a Ray cluster (or start a local one) and decide where workers run."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import MissingExtraError, UsageError, WorkerError

# Environment a worker must share with the driver for byte-identical output (bundle `created`).
SHARED_ENV = ("SOURCE_DATE_EPOCH",)


def require_ray():
    """The ray module, or a domain error that says how to install it."""
    try:
        import ray
    except ImportError:
        raise MissingExtraError(
            "--ray needs the `ray` package, which is not installed",
            hint="pip install 'kdnctl[ray]' (or: pip install ray), on the driver and on every worker node",
        ) from None
    return ray


@contextlib.contextmanager
def connect(address: str, workers: int | None) -> Iterator[object]:
    """Yield the ray module connected to ``address`` ("local" starts a Ray in this process with
    ``workers`` CPU slots, default all cores). A Ray this process already joined is reused."""
    ray = require_ray()
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    if ray.is_initialized():
        yield ray
        return
    kw = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        if address == "local":
            ray.init(address="local", num_cpus=workers or os.cpu_count(), **kw)
        else:
            ray.init(address=address, **kw)
    except ConnectionError as e:
        raise WorkerError(f"cannot reach the Ray cluster at {address}: {e}",
                          hint="start it with `ray start --head` and pass the address it prints, or use --ray local") from None
    try:
        yield ray
    finally:
        ray.shutdown()


@dataclass
class Placement:
    device: str  # what each worker loads the model on
    options: dict = field(default_factory=dict)  # ray.remote resource options per actor


def placement(ray, workers: int | None) -> tuple[Placement, int]:
    """One GPU per worker when the cluster has GPUs, else one CPU slot per worker; and the
    number of workers (default: one per GPU, or one on a CPU-only cluster)."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    if workers is None:
        workers = gpus or 1
    if gpus >= 1:
        if workers > gpus:
            raise UsageError(f"--workers {workers} exceeds the cluster's {gpus} GPU(s)",
                             hint="each worker holds the model on one GPU; pass --workers <= the GPU count")
        return Placement("cuda", {"num_gpus": 1, "num_cpus": 1}), workers
    if workers > cpus:
        raise UsageError(f"--workers {workers} exceeds the cluster's {cpus} CPU slot(s)",
                         hint="pass fewer --workers, or start Ray with more CPUs (ray start --num-cpus N)")
    return Placement("cpu", {"num_cpus": 1}), workers


def shared_env() -> dict[str, str]:
    return {k: os.environ[k] for k in SHARED_ENV if k in os.environ}
