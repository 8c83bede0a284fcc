"""ec's device load: a whole version decoded into a cache on a GPU in one launch per role.

The host inflates (ISA-L, on every core, ``kdnctl.kernels.ec.cpu_jit.inflate_blobs``): every
frame of every chunk, layer and role lands, as stored, in one byte buffer, beside each channel's
place in it. One copy takes that buffer to the device (the inflated codes: about a quarter of
the float32 cache's bytes at the 0.25 default), and one kernel per role
(``kdnctl.kernels.ec_rows``) unpacks the digits, dequantizes, rotates out of the key basis and
RoPEs, writing each cache row once in the cache's own dtype. No float32 copy of the cache
exists on the host, and no code crosses the link as a float.

The bytes were checked against their digests before this runs; each frame is still parsed as
untrusted on the host (sizes, exact inflate, digits in range), so the kernel reads only what the
host has vouched for: a malformed frame raises BundleFormatError and nothing is launched.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kdnctl.errors import BundleFormatError

from . import ec_batch
from .entropy import ROLES


def eligible(bundles, n_layers: int, quant_meta: dict, out: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether :func:`decode_into` takes these chunks into ``out`` (a floating cache whose rows
    are contiguous; the dispatch of ``kdnctl.kernels.ec_rows`` picks the kernel for its device)."""
    if any(not o.is_floating_point() or o.stride(-1) != 1 for o in out):
        return False
    from kdnctl.kernels.ec import cpu

    return ec_batch.batch_layout(bundles, n_layers, quant_meta) and cpu.inflate_blobs() is not None


@dataclass
class _Job:
    """One role of one chunk, every layer: what the host parsed and where its bytes go."""
    chunk: int
    role: str
    t: int
    prefixes: list
    raw: np.ndarray
    c_off: np.ndarray
    c_len: np.ndarray
    bins: np.ndarray
    lsc: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    cs_idx: np.ndarray
    size: int = 0
    u_pos: int = 0


class _Host:
    """Per role: each channel's place in the buffer, steps and means, ``[chunks * L, H*D]``."""

    def __init__(self, n: int, hd: int):
        self.off = np.zeros((n, hd), np.int64)
        self.first = np.zeros((n, hd), np.int64)
        self.mode = np.zeros((n, hd), np.int32)
        self.step = np.zeros((n, hd), np.float32)
        self.mean = np.zeros((n, hd), np.float32)


_PINNED: dict[str, torch.Tensor] = {}  # the page-locked staging buffer, reused by the next load
_PINNED_LOCK = threading.Lock()


def _staging(n: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """A host uint8 buffer of ``n`` bytes: page-locked and kept for the next load where the
    cache is on a GPU and no other load holds it (the second value: held, release it), else plain."""
    if device.type == "cuda" and _PINNED_LOCK.acquire(blocking=False):
        buf = _PINNED.get("u")
        if buf is None or buf.numel() < n:
            try:
                buf = _PINNED["u"] = torch.empty(max(n, 1 << 20) * 5 // 4, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no page-locked memory to be had: pageable memory copies slower, but copies
                _PINNED.pop("u", None)
                _PINNED_LOCK.release()
                return torch.empty(n, dtype=torch.uint8), False
        return buf[:n], True
    return torch.empty(n, dtype=torch.uint8), False


def decode_into(out: tuple[torch.Tensor, torch.Tensor], bundles, starts: list[int], quant_meta: dict,
                workers: int | None = None) -> None:
    """Chunk ``c`` of ``bundles`` into ``out[role][:, :, starts[c]:starts[c] + T_c]`` (``out``:
    keys and values ``[L, H, T_slot, D]``, any float dtype, on any device); call :func:`eligible`
    first. ``workers``: host threads (``ec_batch.default_workers`` where None)."""
    from kdnctl.kernels.ec import cpu
    from kdnctl.kernels.ec_rows import decode_rows

    h, d = quant_meta.get("n_heads"), quant_meta.get("head_dim")
    if not all(isinstance(x, int) and x > 0 for x in (h, d)):
        raise BundleFormatError("ec meta needs n_heads and head_dim")
    n_layers, hd, device = out[0].shape[0], h * d, out[0].device
    if tuple(out[0].shape[1:2]) != (h,) or out[0].shape[3] != d:
        raise BundleFormatError(f"ec chunks of {h} heads of {d} do not fit the cache {list(out[0].shape)}")
    basis_t = ec_batch.key_basis_t(quant_meta.get("key_basis"), n_layers, h, d)
    inflate_blobs = cpu.inflate_blobs()
    layers = range(n_layers)
    hosts = {role: _Host(len(bundles) * n_layers, hd) for role in ROLES}
    jobs = [(c, role) for role in ROLES for c in range(len(bundles))]
    local = threading.local()

    def state() -> np.ndarray:
        if getattr(local, "state", None) is None:
            local.state = cpu.new_state()
        return local.state

    def run(job: _Job, u: np.ndarray, dry: bool) -> int:
        host, rows = hosts[job.role], slice(job.chunk * n_layers, (job.chunk + 1) * n_layers)
        err = np.zeros(n_layers, np.int32)
        n = inflate_blobs(job.raw, job.c_off, job.c_len, job.bins, job.t, u, job.u_pos, dry,
                          host.off[rows], host.first[rows], host.mode[rows], state(), err)
        if err.any():
            i = int(np.flatnonzero(err)[0])
            raise BundleFormatError(f"{job.prefixes[i]}.{cpu.MESSAGES[int(err[i])]}")
        return n

    def prepare(cr) -> _Job:  # params inflated, tables made, headers checked, bytes counted
        c, role = cr
        b = bundles[c]
        t = b.layer_len(0)
        prefixes, raw, c_off, c_len, step, mean, bins = ec_batch.chunk_params(b, role, layers, hd, state())
        lsc, cos, sin, cs_idx = ec_batch.role_tables(b.tensors, role, prefixes, t, quant_meta, h, d)
        host = hosts[role]
        host.step[c * n_layers:(c + 1) * n_layers] = step
        host.mean[c * n_layers:(c + 1) * n_layers] = mean
        job = _Job(c, role, t, prefixes, raw, c_off, c_len, bins, lsc, cos, sin, cs_idx)
        job.size = run(job, np.empty(0, np.uint8), True)
        return job

    workers = ec_batch.default_workers() if workers is None else workers
    with ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
        parsed = list(pool.map(prepare, jobs))
        pos = 0
        for job in parsed:
            job.u_pos, pos = pos, pos + job.size
        staging, held = _staging(pos + 8, device)
        try:
            u = staging.numpy()
            list(pool.map(lambda j: run(j, u, False), parsed))
            u_dev = staging.to(device, non_blocking=held)
            for r, role in enumerate(ROLES):
                _launch(out[r], role, [j for j in parsed if j.role == role], hosts[role], starts, u_dev, n_layers,
                        basis_t if role == "keys" else None, device, decode_rows)
            if held and device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # (the staging buffer is free again)
        finally:
            if held:
                _PINNED_LOCK.release()


def _launch(out, role, jobs, host, starts, u_dev, n_layers, basis_t, device, decode_rows) -> None:
    """One role's tables to the device and its one launch."""
    blobs = np.zeros((len(jobs) * n_layers, 6), np.int64)
    lsc, cos, sin = [], [], []
    lsc_n = cs_n = 0
    for job in jobs:
        rows = blobs[job.chunk * n_layers:(job.chunk + 1) * n_layers]
        rows[:, 0] = np.arange(n_layers)
        rows[:, 1] = starts[job.chunk]
        rows[:, 2] = job.t
        rows[:, 3] = lsc_n + np.arange(n_layers) * job.t
        lsc.append(job.lsc.reshape(-1))
        lsc_n += job.lsc.size
        if (job.cs_idx >= 0).any():
            k, hc, t, d = job.cos.shape
            rows[:, 4] = np.where(job.cs_idx >= 0, cs_n + job.cs_idx * hc * t, -1)
            rows[:, 5] = t if hc > 1 else 0
            cos.append(job.cos.reshape(-1, d))
            sin.append(job.sin.reshape(-1, d))
            cs_n += k * hc * t
        else:
            rows[:, 4] = -1
    d = out.shape[3]

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    cos_t = dev(np.concatenate(cos)) if cos else torch.zeros(1, d, device=device)
    sin_t = dev(np.concatenate(sin)) if sin else torch.zeros(1, d, device=device)
    lsc_t = dev(np.concatenate(lsc)) if lsc else torch.zeros(1, device=device)
    decode_rows(u_dev, dev(blobs), dev(host.off), dev(host.first), dev(host.mode), dev(host.step), dev(host.mean),
                lsc_t, cos_t, sin_t, None if basis_t is None else _on(basis_t, device), out)


_ON_DEVICE: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # (id of the host basis, device) -> (it, its copy)


def _on(basis_t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The transposed key basis on ``device``, copied there once per basis read."""
    if device.type == "cpu":
        return basis_t
    key = (id(basis_t), str(device))
    hit = _ON_DEVICE.get(key)
    if hit is None or hit[0] is not basis_t:
        if len(_ON_DEVICE) >= 4:
            _ON_DEVICE.clear()
        hit = _ON_DEVICE[key] = (basis_t, basis_t.to(device, torch.float32).contiguous())
    return hit[1]


def warm() -> bool:
    """Compile the host part of a device load (numba keeps it on disk; ``scripts/install.sh``
    calls this) on :func:`ec_batch.made_up_version`, the rows by the torch reference on the CPU:
    True when they equal the reference decoder's; False where the compiled path is absent or off."""
    if not ec_batch.enabled():
        return False
    b, quant, want = ec_batch.made_up_version()
    out = tuple(torch.zeros_like(w) for w in want)
    if not eligible([b], want[0].shape[0], quant, out):
        return False
    decode_into(out, [b], [0], quant, workers=1)
    return all(torch.allclose(got, w, rtol=1e-5, atol=1e-4) for got, w in zip(out, want))
