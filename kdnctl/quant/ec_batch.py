"""ec's fast CPU load: every chunk's layers of one role decoded in one compiled pass.

What :func:`kdnctl.quant.entropy.decode_role` does one layer at a time (the reference and the
spec), :func:`decode_into` does for a whole version: per chunk and role, the params frames of
every layer inflated in one call, converted with numpy, then one kernel
(``kdnctl.kernels.ec.cpu.decode_blobs``) inflates every code frame, unpacks its digits,
dequantizes and RoPEs, writing each element once into the cache (keys in a key basis: scaled
codes channel by channel, one batched matmul that reads them transposed, then one RoPE pass
into the cache). Two threads take (chunk, role)
jobs as they free up (the kernels hold no GIL). The bytes were checked against their
digests before this runs (the loader reads, checks, then decodes); each frame is still parsed
as untrusted: a malformed one raises BundleFormatError, never garbage in the cache.

The path takes what the shipped defaults write (deflate frames, every layer of a chunk as many
tokens, no narrowed heads, a float32 cache); anything else returns False and the caller decodes
with the reference.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kdnctl.format.names import role_levels, tensor_name
from kdnctl.errors import BundleFormatError

from . import transforms as tf
from .entropy import MAX_LEVEL, ROLES

MAX_WORKERS = 16  # threads over (chunk, role) jobs, at most: the kernels release the GIL


def default_workers() -> int:
    """Every core this process may run on, up to ``MAX_WORKERS`` (two on a 2-core machine; a
    GPU server's host decodes a version on all of its cores)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_WORKERS))


def enabled() -> bool:
    """The compiled path is present and not turned off (``KDNCTL_EC_REFERENCE=1`` forces the reference)."""
    if os.environ.get("KDNCTL_EC_REFERENCE", "") == "1":
        return False
    from kdnctl.kernels.ec import cpu

    return cpu.available()


def eligible(bundles, n_layers: int, quant_meta: dict, out: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether :func:`decode_into` takes these chunks (else the reference decodes them)."""
    if any(o.dtype != torch.float32 or o.device.type != "cpu" for o in out):
        return False
    return batch_layout(bundles, n_layers, quant_meta)


def batch_layout(bundles, n_layers: int, quant_meta: dict) -> bool:
    """The chunks are what the compiled host kernels parse (deflate frames, every layer of a chunk
    as many tokens, no narrowed heads, one head layout) and the kernels are present."""
    for b in bundles:
        q = b.meta.get("quant") or {}
        if q.get("scheme") != "ec" or q.get("coding", "zstd") != "deflate":
            return False
        if (q.get("n_heads"), q.get("head_dim"), q.get("key_rope_theta"), q.get("key_basis")) != (
                quant_meta.get("n_heads"), quant_meta.get("head_dim"), quant_meta.get("key_rope_theta"),
                quant_meta.get("key_basis")):
            return False
        if any(tensor_name(i, "narrow") in b.tensors for i in range(n_layers)):
            return False
        if len({b.layer_len(i) for i in range(n_layers)}) != 1:
            return False
    return enabled()


def decode_into(out: tuple[torch.Tensor, torch.Tensor], bundles, starts: list[int], quant_meta: dict,
                workers: int | None = None, groups: list[range] | None = None, on_group=None) -> None:
    """Chunk ``c`` of ``bundles`` into ``out[role][:, :, starts[c]:starts[c] + T_c]`` (``out``:
    keys and values ``[L, H, T_slot, D]`` float32); call :func:`eligible` first. With ``groups``
    (consecutive layer ranges covering every layer) the work goes group by group, in order, and
    ``on_group(g)`` is called once every chunk's keys and values of group ``g`` are written (a
    question's forward can start on the first layers while the last are decoded). ``workers``:
    threads (:func:`default_workers` where None)."""
    GroupedDecode(out, bundles, starts, quant_meta, groups, on_group).run(workers)


class GroupedDecode:
    """The (layer group, chunk, role) jobs of one decode, taken in order by whichever thread is
    free: the decode's own workers (:meth:`run`) and a thread that would otherwise wait for a group
    (:meth:`help`: a question's forward waiting for its first layers decodes some of them itself
    instead of idling). Each job writes its own part of the cache, so the K/V do not depend on
    which thread ran which job."""

    def __init__(self, out: tuple[torch.Tensor, torch.Tensor], bundles, starts: list[int], quant_meta: dict,
                 groups: list[range] | None = None, on_group=None):
        h, d = quant_meta.get("n_heads"), quant_meta.get("head_dim")
        if not all(isinstance(x, int) and x > 0 for x in (h, d)):
            raise BundleFormatError("ec meta needs n_heads and head_dim")
        n_layers = out[0].shape[0]
        if tuple(out[0].shape[1:2]) != (h,) or out[0].shape[3] != d:
            raise BundleFormatError(f"ec chunks of {h} heads of {d} do not fit the cache {list(out[0].shape)}")
        self.out, self.bundles, self.starts, self.quant_meta = out, bundles, starts, quant_meta
        self.h, self.d, self.n_layers = h, d, n_layers
        self.basis_t = key_basis_t(quant_meta.get("key_basis"), n_layers, h, d)
        self.groups = [range(n_layers)] if groups is None else groups
        self.on_group = on_group
        # group by group; in a group the costlier keys first (a basis matmul and RoPE), so the last
        # jobs left are short ones
        self.jobs = [(g, c, role) for g in range(len(self.groups)) for role in sorted(ROLES, key=lambda r: r != "keys")
                     for c in range(len(bundles))]
        self.next = 0  # the first job not yet taken
        self.taken = [False] * len(self.jobs)
        self.failed = False
        self.left = [2 * len(bundles)] * len(self.groups)  # jobs of each group not yet done
        # chunks whose bundle is here: all of them, or, in a load that decodes chunks as they
        # arrive (``kdnctl.engine.streamed``), those ``arrive`` has handed over so far
        self.arrived = [b is not None for b in bundles]
        self.lock = threading.Condition()
        self.buffers = threading.local()  # each thread's scratch
        # (chunk, role) -> (chunk_params, role_tables) of all its layers, made once for every layer
        # group: the params of all layers inflated in one call, the same positions and levels (made
        # by whichever thread gets there first; two threads make the same arrays). Once per chunk,
        # not per group: the numpy work around them holds the interpreter's lock, which the
        # question's forward beside the decode needs too.
        self.tables: dict[tuple[int, str], tuple] = {}

    def run(self, workers: int | None = None) -> None:
        """Decode every job not yet taken, on ``workers`` threads (this one alone where 1;
        :func:`default_workers` where None)."""
        workers = default_workers() if workers is None else workers
        if workers <= 1 or len(self.jobs) <= 1:
            self._run_all()
            return
        # the chunks are the parallel work: the key basis's matmuls run on one torch thread each. (Not
        # behind a forward, on_group set: torch's thread count is the process's, and the forward's.)
        threads = torch.get_num_threads()
        if self.on_group is None:
            torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(workers) as pool:
                for f in [pool.submit(self._run_all) for _ in range(workers)]:
                    f.result()
        finally:
            if self.on_group is None:
                torch.set_num_threads(threads)

    def help(self, group: int) -> bool:
        """Decode the next job if it belongs to ``group`` or an earlier one; False when none is left
        there (the rest are being decoded by other threads, or a later group's are next)."""
        job = self._take(group)
        if job is None:
            return False
        with torch.inference_mode():
            self._do(job)
        return True

    def arrive(self, c: int, bundle) -> None:
        """Chunk ``c``'s bundle is here (read and checked): its jobs may run."""
        with self.lock:
            self.bundles[c] = bundle
            self.arrived[c] = True
            self.lock.notify_all()

    def abort(self) -> None:
        """No thread takes another job (the load has failed or goes another way)."""
        with self.lock:
            self.failed = True
            self.lock.notify_all()

    def _run_all(self) -> None:
        with torch.inference_mode():  # (thread-local: a worker does not inherit the caller's)
            while (job := self._take(None, wait=True)) is not None:
                self._do(job)

    def _take(self, up_to: int | None, wait: bool = False):
        """The first job not yet taken, in order, of a chunk that is here (of ``up_to``'s group or
        an earlier one); None when there is none. ``wait``: while jobs remain whose chunks are
        still on their way, wait for them instead."""
        with self.lock:
            while not self.failed:
                waiting = False
                for i in range(self.next, len(self.jobs)):
                    g, c, _ = self.jobs[i]
                    if up_to is not None and g > up_to:
                        break
                    if self.taken[i]:
                        continue
                    if not self.arrived[c]:
                        waiting = True
                        continue
                    self.taken[i] = True
                    while self.next < len(self.jobs) and self.taken[self.next]:
                        self.next += 1
                    return self.jobs[i]
                if not (wait and waiting):
                    return None
                self.lock.wait()
            return None

    def _do(self, job) -> None:
        try:
            self._decode(job)
        except BaseException:
            self.abort()  # no thread takes another job: the load has failed
            raise

    def _decode(self, job) -> None:
        g, c, role = job
        h, d = self.h, self.d
        b, layers = self.bundles[c], self.groups[g]
        t = b.layer_len(0)
        buf = self.buffers
        if getattr(buf, "scratch", None) is None or buf.scratch.shape[0] < 2 * h * d * t:
            buf.scratch = np.empty(max(2 * h * d * t, 1), np.uint8)
            # codes in rows (+8: packed digits may run past a frame's end)
            buf.zs = (np.empty(h * d * t + 8, np.int8), np.empty(h * d * t + 8, np.int16))
            buf.state = _cpu_state()
        basis = None if role != "keys" or self.basis_t is None else self.basis_t[layers.start:layers.stop]
        if basis is not None and (getattr(buf, "zbuf", None) is None or buf.zbuf.numel() < basis_scratch(len(layers), h, t, d)):
            buf.zbuf = torch.empty(basis_scratch(self.n_layers, h, t, d))
        tables = self.tables.get((c, role))
        if tables is None:
            params = chunk_params(b, role, range(self.n_layers), h * d, buf.state)
            tables = self.tables[c, role] = (params, role_tables(b.tensors, role, params[0], t, self.quant_meta, h, d))
        _decode_chunk_role(b, role, t, self.starts[c], self.out[ROLES.index(role)], self.quant_meta, h, d, basis,
                           buf.scratch, buf.zs, buf.state, layers, getattr(buf, "zbuf", None), *tables)
        with self.lock:
            self.left[g] -= 1
            finished = self.left[g] == 0
        if finished and self.on_group is not None:
            self.on_group(g)


def basis_scratch(n_layers: int, h: int, t: int, d: int) -> int:
    """Elements of a thread's scratch for keys in a key basis: the scaled codes and the rotated
    keys, one buffer reused job after job."""
    return 2 * n_layers * h * d * t


def _cpu_state() -> np.ndarray:
    from kdnctl.kernels.ec import cpu

    return cpu.new_state()


def _decode_chunk_role(b, role: str, t: int, tok: int, out: torch.Tensor, quant_meta: dict, h: int, d: int,
                       basis_t: torch.Tensor | None, scratch: np.ndarray, zs: tuple[np.ndarray, np.ndarray], state: np.ndarray,
                       layers: range, zbuf: torch.Tensor | None = None, chunk_params_all=None, chunk_tables=None) -> None:
    """One role of chunk ``b`` into ``out[:, :, tok:tok + t]``, the ``layers`` (``basis_t``:
    theirs) in one kernel call that writes each token row once, dequantized and RoPE'd. In a key basis the kernel writes
    the scaled codes channel by channel (``[L, H, D, t]``) to the start of ``zbuf`` (flat, room for
    ``basis_scratch``); one batched matmul with the basis, reading them transposed, rotates them
    into token rows after them (a BLAS matmul: several times the speed of a loop in the kernel),
    and a last pass scales those by the steps, adds the means and RoPEs them into the cache (the
    steps and means there, where the pass is bound by its writes, rather than in the matmul: a
    scaled copy of the basis and a bias per job cost more). ``chunk_params_all`` and ``chunk_tables``: ``chunk_params`` and ``role_tables`` of
    every layer of the chunk's role, made once for all its layer groups (else made here for ``layers``)."""
    from kdnctl.kernels.ec import cpu

    _, decode_blobs, rope_blobs = cpu.kernels()
    tensors = b.tensors
    n_layers = len(layers)
    if chunk_params_all is None:
        prefixes, raw, c_off, c_len, step, mean, bins = chunk_params(b, role, layers, h * d, state)
    else:
        prefixes, raw, c_off, c_len, step, mean, bins = chunk_params_all
        ls = slice(layers.start, layers.stop)  # (rows of C-contiguous arrays: contiguous views)
        prefixes, c_off, c_len, step, mean, bins = prefixes[ls], c_off[ls], c_len[ls], step[ls], mean[ls], bins[ls]
    if chunk_tables is None:
        lsc, cos, sin, cs_idx = role_tables(tensors, role, prefixes, t, quant_meta, h, d)
    else:
        lsc, cos, sin, cs_idx = chunk_tables
        lsc, cs_idx = lsc[layers.start:layers.stop], cs_idx[layers.start:layers.stop]
    err = np.zeros(n_layers, np.int32)
    layer_idx = np.arange(layers.start, layers.stop, dtype=np.int64)
    tables = cpu.digit_tables()
    if basis_t is None:
        decode_blobs(raw, c_off, c_len, step, mean, bins, t, lsc, out.numpy(), layer_idx, tok, True,
                     cos, sin, cs_idx, tables, scratch, *zs, state, err)
    else:
        n = n_layers * h * t * d
        z, y = zbuf[:n].view(n_layers, h, d, t), zbuf[n:2 * n].view(n_layers, h, t, d)
        decode_blobs(raw, c_off, c_len, step, mean, bins, t, lsc, z.numpy(), layer_idx, 0, False,
                     cos, sin, cs_idx, tables, scratch, *zs, state, err)
    if err.any():
        i = int(np.flatnonzero(err)[0])
        raise BundleFormatError(f"{prefixes[i]}.{cpu.MESSAGES[int(err[i])]}")
    if basis_t is not None and t:
        # the codes lie channel by channel: the matmul reads them transposed (no gather into token rows)
        torch.bmm(z.reshape(n_layers * h, d, t).transpose(1, 2), basis_t.reshape(n_layers * h, d, d),
                  out=y.view(n_layers * h, t, d))
        rope_blobs(y.numpy(), out.numpy(), layer_idx, tok, t, step, mean, cos, sin, cs_idx)  # (the cache written once)


def chunk_params(b, role: str, layers: range, hd: int, state: np.ndarray):
    """``(prefixes, raw, c_off, c_len, step, mean, bins)`` of chunk ``b``'s ``role`` in ``layers``:
    every codes and params blob in one uint8 array (``raw``; the codes blobs at ``c_off``, ``c_len``
    bytes each), and each layer's params inflated in one call: ``step``/``mean`` float32 and
    ``bins`` uint8 ``[L, H*D]``."""
    from kdnctl.kernels.ec import cpu

    inflate_frames = cpu.kernels()[0]
    tensors = b.tensors
    n_layers = len(layers)
    prefixes = [tensor_name(i, role) for i in layers]
    codes, params = [], []
    for p in prefixes:
        c, pa = tensors.get(f"{p}.codes"), tensors.get(f"{p}.params")
        if c is None or pa is None:
            raise BundleFormatError(f"missing tensor {p}.codes/params")
        if c.dtype != torch.uint8 or pa.dtype != torch.uint8 or c.dim() != 1 or pa.dim() != 1 or c.numel() < 2:
            raise BundleFormatError(f"{p}: codes and params must be uint8 [n]")
        codes.append(c)
        params.append(pa)
    raw, offs = _span(codes + params)
    c_off, p_off = offs[:n_layers], offs[n_layers:]
    c_len = np.array([x.numel() for x in codes], np.int64)
    p_len = np.array([x.numel() for x in params], np.int64)
    pbuf = np.empty(n_layers * 5 * hd, np.uint8)
    ok = np.zeros(n_layers, np.bool_)
    inflate_frames(raw, p_off, p_len, pbuf, np.arange(n_layers, dtype=np.int64) * 5 * hd,
                   np.full(n_layers, 5 * hd, np.int64), state, ok)
    if not ok.all():
        bad = prefixes[int(np.argmin(ok))]
        raise BundleFormatError(f"{bad}.params is not a valid deflate stream of exactly {5 * hd} bytes")
    pv = pbuf.reshape(n_layers, 5 * hd)
    sm = pv[:, : 4 * hd].copy().view(np.float16).astype(np.float32).reshape(n_layers, 2, hd)
    step, mean = np.ascontiguousarray(sm[:, 0]), np.ascontiguousarray(sm[:, 1])
    return prefixes, raw, c_off, c_len, step, mean, np.ascontiguousarray(pv[:, 4 * hd:])


def role_tables(tensors, role: str, prefixes: list[str], t: int, quant_meta: dict, h: int, d: int):
    """(level scales ``[L, t]``, cos, sin, RoPE table index per layer) of ``prefixes``' layers:
    ``_level_scales`` and, for keys with RoPE, ``_rope_tables`` (no RoPE: index -1)."""
    lsc = _level_scales(tensors, prefixes, t)
    cos = sin = np.zeros((1, 1, 1, 1), np.float32)
    cs_idx = np.full(len(prefixes), -1, np.int64)
    theta = quant_meta.get("key_rope_theta")
    if role == "keys" and theta:
        cos, sin, cs_idx = _rope_tables(tensors, prefixes, t, h, d, float(theta))
    return lsc, cos, sin, cs_idx


def _span(blobs: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """One uint8 array holding every blob and each blob's offset in it: the bytes of the object
    the blobs are views of (no copy) where they lie close together, else a copy."""
    ptrs = np.array([x.data_ptr() for x in blobs], np.int64)
    lens = np.array([x.numel() for x in blobs], np.int64)
    lo, hi = int(ptrs.min()), int((ptrs + lens).max())
    if hi - lo <= 2 * int(lens.sum()) + (1 << 20):
        return np.asarray(_Memory(lo, hi - lo)), ptrs - lo
    raw = np.concatenate([x.numpy() for x in blobs])
    return raw, np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)


class _Memory:
    """``n`` bytes at ``address`` as a numpy array (no copy): the object the blobs are views of,
    which the bundle's tensors keep alive while the kernels read it. Flagged writable (the kernels
    only read it) so that it has the numba type of the copy ``_span`` makes of scattered blobs:
    one compiled kernel, found in numba's disk cache whichever way a process's heap lies."""

    def __init__(self, address: int, n: int):
        self.__array_interface__ = {"data": (address, False), "shape": (n,), "typestr": "|u1", "version": 3}


def _level_scales(tensors, prefixes: list[str], t: int) -> np.ndarray:
    """float32 ``[L, t]``, C-contiguous: ``2**-level`` of each layer's tokens (one row, copied
    per layer, where the layers share one levels tensor: a broadcast view would be a second
    numba type, so a second compiled kernel)."""
    levels = []
    for p in prefixes:
        layer, role = p.rsplit(".", 1)
        lv = role_levels(tensors, layer, role)
        if lv is None or lv.dtype != torch.uint8 or lv.dim() != 1:
            raise BundleFormatError(f"{layer}: token_levels must be uint8 [T]")
        if lv.numel() != t:
            raise BundleFormatError(f"{p}: {lv.numel()} token levels for {t} tokens")
        levels.append(lv)
    if all(lv is levels[0] for lv in levels):
        levels = levels[:1]
    lv = np.stack([x.numpy() for x in levels])
    if lv.size and int(lv.max()) > MAX_LEVEL:
        raise BundleFormatError(f"{prefixes[0].rsplit('.', 1)[0]}: a token level above {MAX_LEVEL}")
    sc = np.ldexp(np.float32(1.0), -lv.astype(np.int32)).astype(np.float32)
    return np.ascontiguousarray(np.broadcast_to(sc, (len(prefixes), t))) if sc.shape[0] == 1 else sc


def _rope_tables(tensors, prefixes: list[str], t: int, h: int, d: int, theta: float):
    """(cos, sin ``[K, Hc, t, D]``, table index per layer) of the keys' positions."""
    tables, idx, seen = [], [], []  # (positions, table index): layers with equal positions share a table
    for p in prefixes:
        layer = p.rsplit(".", 1)[0]
        pos = tensors.get(f"{layer}.positions")
        pos = tensors.get("positions") if pos is None else pos
        if pos is None:
            raise BundleFormatError("missing tensor positions")
        if tuple(pos.shape) not in ((t,), (h, t)) or pos.dtype.is_floating_point:
            raise BundleFormatError(f"{layer}: positions {list(pos.shape)} do not fit {t} tokens of {h} heads")
        for q, j in seen:
            if q is pos or (q.shape == pos.shape and q.dtype == pos.dtype and torch.equal(q, pos)):
                idx.append(j)
                break
        else:
            seen.append((pos, len(tables)))
            idx.append(len(tables))
            tables.append(tf._cos_sin(pos, d, theta))
    per_head = any(c.dim() == 3 for c, _ in tables)
    cos = np.stack([(c.expand(h, -1, -1) if per_head and c.dim() == 2 else c[None] if c.dim() == 2 else c).numpy()
                    for c, _ in tables])
    sin = np.stack([(s.expand(h, -1, -1) if per_head and s.dim() == 2 else s[None] if s.dim() == 2 else s).numpy()
                    for _, s in tables])
    return cos.astype(np.float32, copy=False), sin.astype(np.float32, copy=False), np.array(idx, np.int64)


_TRANSPOSED: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # sha -> (the basis read, its transpose)


def _basis_t_cached(sha: str) -> torch.Tensor:
    """The transposed basis, made again whenever ``load_basis`` reads the file again (its cache
    cleared: a basis registered or removed since), so a removed basis is refused here too."""
    from ..format.key_basis import load_basis

    basis = load_basis(sha)
    hit = _TRANSPOSED.get(sha)
    if hit is None or hit[0] is not basis:
        if len(_TRANSPOSED) >= 4:
            _TRANSPOSED.clear()
        hit = _TRANSPOSED[sha] = (basis, basis.transpose(-1, -2).contiguous())
    return hit[1]


def key_basis_t(sha: str | None, n_layers: int, h: int, d: int) -> torch.Tensor | None:
    """``[L, H, D, D]`` transposed key basis (``x = (z @ B^T) * step + mean``), or None."""
    if sha is None:
        return None
    bt = _basis_t_cached(sha)
    if tuple(bt.shape[1:]) != (h, d, d) or bt.shape[0] < n_layers:
        raise BundleFormatError(f"key basis {sha[:12]} is {list(bt.shape)}, the bundle needs [{n_layers}, {h}, {d}, {d}]")
    return bt


def made_up_version():
    """``(bundle, quant meta, the reference's K/V [L, H, T, D] per role)`` of a small made-up
    version (one-byte codes in one layer, two-byte codes in the other, levels, RoPE): what
    :func:`warm` compiles the kernels on."""
    from kdnctl.format.bundle import KVBundle

    from .entropy import EntropyQuantizer, encode_role

    h, t, d, n_layers = 2, 7, 8, 2
    g = torch.Generator().manual_seed(0)
    quant = {**EntropyQuantizer(key_rope_theta=10000.0).meta(h, d), "scheme": "ec"}
    levels = torch.tensor([0, 1, 2, 3, 0, 1, 2], dtype=torch.uint8)
    tensors = {"token_ids": torch.arange(t), "token_levels": levels, "positions": torch.arange(3, 3 + t)}
    for i in range(n_layers):
        for role in ROLES:
            x = torch.randn(h, t, d, generator=g)
            if i == 1:
                x[0, 3, 0] = 500.0  # two-byte codes in this layer, one-byte codes in the other
            tensors[f"{tensor_name(i, role)}.codes"], tensors[f"{tensor_name(i, role)}.params"] = encode_role(
                x, torch.full((h, d), 0.3), levels)
    want = [torch.stack([EntropyQuantizer.dequantize(tensors, tensor_name(i, role), quant) for i in range(n_layers)])
            for role in ROLES]
    return KVBundle(meta={"quant": quant}, tensors=tensors), quant, want


def warm() -> bool:
    """Compile every kernel the CPU load runs, on a small made-up version, so that a first load
    after installing pays no compile (numba keeps the machine code on disk; ``scripts/install.sh``
    calls this). True when the compiled decode of it, with and without a key basis, equals the
    reference decoder's; False where the compiled path is absent or off."""
    if not enabled():
        return False
    from kdnctl.kernels.ec import cpu

    b, quant, want = made_up_version()
    n_layers, h, t, d = want[0].shape
    out = tuple(torch.zeros(n_layers, h, t, d) for _ in ROLES)
    if not eligible([b], n_layers, quant, out):
        return False
    decode_into(out, [b], [0], quant, workers=1)
    # the key-basis path (scaled codes, the matmul, RoPE into the cache); the identity basis
    # gives the keys the reference decodes without one
    keys = torch.zeros(n_layers, h, t, d)
    _decode_chunk_role(b, "keys", t, 0, keys, quant, h, d, torch.eye(d).expand(n_layers, h, d, d).contiguous(),
                       np.empty(2 * h * d * t, np.uint8), (np.empty(h * d * t + 8, np.int8), np.empty(h * d * t + 8, np.int16)),
                       cpu.new_state(), range(n_layers), torch.empty(basis_scratch(n_layers, h, t, d)))
    return all(torch.allclose(got, w, rtol=1e-5, atol=1e-4) for got, w in zip((*out, keys), (*want, want[0])))
