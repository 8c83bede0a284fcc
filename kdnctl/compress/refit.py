"""Value refit: what eviction takes from attention, given back through the kept tokens' values.

Offline the question is unknown but the document's own queries are not. Placed after the
document (RoPE at the position a question would take), they stand in for the queries that will
read the cache. Per layer and KV head the kept tokens' values are refitted by ridge least
squares so that attention over the kept keys alone gives those queries the full cache's
attention output:

    minimise  || A_S V' - A V ||^2 + lam || V' - V_S ||^2,   lam = rho * ||A_S||_F^2 / |S|

with ``A = softmax(Q K^T * scale)`` over every token and ``A_S`` the same over the kept tokens
(the group's query heads pooled). The keys, and so which tokens a query reads, are untouched;
the same solution holds for every value channel, so ec's channel weights do not change it. The
fit is solved in whichever of the kept tokens or the queries is the smaller space (the
push-through identity), so its cost grows linearly with the document beyond ``MAX_QUERY_TOKENS``.
Measured in docs/compression.md ("Values refitted to the full attention"): at 0.083 it lowers
continuation NLL but loses needles and facts; with the lifted tokens' values held (``hold``,
``--refit-hold``) it keeps them, and the auto recipe below 0.25 refits that way.
"""

from __future__ import annotations

import torch

from ..models import adapter_for
from ..quant.transforms import rotate_half

QUESTION_OFFSET = 16  # the queries' position: this many tokens after the document (a prompt's question)
MAX_QUERY_TOKENS = 1024  # document tokens whose queries are used (evenly spaced); x the group's query heads
_BLOCK = 1024  # query rows per block of the full attention (memory: block x document tokens)
SPD_MIN = 1024  # ridge systems of this many unknowns or more: the Gram's lower blocks, a Cholesky solve
SPD_BLOCK = 512  # columns per block of that Gram
# a head whose fit leaves the document's held-out queries worse off than no fit tries this many
# times the ridge weight (research/results/refit-long-2026-12-03/: at 8k tokens 7 of 90 heads
# were worse off; their best weight was 10-100x, and no fit was never better than 100x)
RIDGE_RETRY = 100.0


def query_rows(n_tokens: int, max_tokens: int = MAX_QUERY_TOKENS) -> torch.Tensor:
    """The ``max_tokens`` evenly spaced document tokens whose queries the refit reads."""
    return torch.linspace(0, n_tokens - 1, min(n_tokens, max_tokens)).round().long().unique()


def picked_queries(q: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """One layer's captured queries ``[T, Hq, D]`` (before RoPE) -> the picked rows ``[Hq, N, D]``."""
    return q[pick.to(q.device)].float().transpose(0, 1).cpu()


def cached_queries(lm, token_ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
                   pick: torch.Tensor) -> list[torch.Tensor]:
    """The ``pick`` rows' queries before RoPE per layer (``[Hq, N, D]``, as :func:`picked_queries`
    reads them from a forward over the whole document), from a pass over those rows alone that
    reads the document's stored K/V (``keys``/``values`` ``[H, T, D]`` per layer, as ingest's
    prefill stored them: after RoPE, every token): each row attends, by position, to the stored
    keys up to its own, its own stored key and value among them, as it did in that prefill. Its
    hidden states are the prefill's to float rounding, for ``N`` tokens' projections instead of
    ``T``'s. The rows' own keys, which the pass appends to the cache, are hidden from every row."""
    from ..engine.attention import AttentionState, kdn_attention
    from ..models.cache_args import cache_arg

    model = lm.model
    adapter = adapter_for(model)
    param = next(model.parameters())
    n = len(token_ids)
    pick = pick.to(torch.long)
    cache = adapter.full_cache([(k[None].to(param.device, param.dtype), v[None].to(param.device, param.dtype))
                                for k, v in zip(keys, values)])
    key_pos = torch.cat([torch.arange(n), torch.full((pick.numel(),), n)])  # n: after every row
    raw: list = [None] * adapter.n_layers

    def on(i, _role, q):  # [N, Hq, D], before RoPE
        raw[i] = q.float().transpose(0, 1).cpu()

    ids = torch.tensor(token_ids, dtype=torch.long)[pick]
    state = AttentionState(query_positions=pick.to(param.device), key_positions=key_pos.to(param.device))
    with adapter.capture(("q",), on=on), kdn_attention(model, state), torch.no_grad():
        adapter.decoder(input_ids=ids[None].to(param.device), position_ids=pick[None].to(param.device),
                        **cache_arg(adapter.decoder, cache), use_cache=True)
    return raw


def document_queries(lm, token_ids: list[int], n_layers: int, position: int,
                     max_tokens: int = MAX_QUERY_TOKENS, raw: list[torch.Tensor] | None = None
                     ) -> tuple[list[torch.Tensor], list[float]]:
    """(queries ``[Hq, N, D]`` per layer, RoPE'd at ``position``; the attention scale per layer)
    for ``max_tokens`` evenly spaced tokens of the document, from one forward pass; ``raw``: the
    picked queries before RoPE per layer (``picked_queries``), already read from such a pass."""
    model = lm.model
    adapter = adapter_for(model)
    if raw is None:
        pick = query_rows(len(token_ids), max_tokens)
        raw = [None] * n_layers

        def on(i, _role, q):  # [T, Hq, D], before RoPE
            raw[i] = picked_queries(q, pick)

        device = next(model.parameters()).device
        with adapter.capture(("q",), on=on), torch.no_grad():
            adapter.decoder(torch.tensor([token_ids], device=device), use_cache=False)
    out = []
    for i, q in enumerate(raw):
        # the model's own RoPE for this layer (any rope type, per layer type) at the question's position
        cos, sin = adapter.rope_cos_sin(i, torch.tensor([position]))
        cos, sin = cos.cpu(), sin.cpu()  # [1, rotary_dim]
        r = cos.shape[-1]
        if r == q.shape[-1]:
            out.append(q * cos + rotate_half(q) * sin)
        else:  # partial rotary: the first r channels rotate, the rest pass through
            out.append(torch.cat([q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]], -1))
    scales = [a.scaling for a in adapter.layer_attention()]
    return out, scales


def read_together(queries: torch.Tensor, kept_keys: torch.Tensor, scale: float, rho: float) -> tuple[torch.Tensor, float]:
    """``(A_S [N, S], lam)`` of one KV head: the attention of its group's ``queries [g, N, D]``
    over ``kept_keys [S, D]``, and the ridge weight ``lam`` of the fit (also the feedback's, ``kdnctl.compress.feedback``)."""
    a = torch.softmax(queries.reshape(-1, kept_keys.shape[-1]).float() @ kept_keys.float().T * scale, -1)
    return a, rho * float(a.pow(2).sum()) / max(kept_keys.shape[0], 1)


def ridge_solve(m: torch.Tensor, lam: float, rhs: torch.Tensor) -> torch.Tensor:
    """``x`` with ``(m^T m + lam I) x = rhs`` (``m [N, S]``, ``lam > 0``). A system of
    ``SPD_MIN`` unknowns or more (a document of two thousand tokens or more) computes only the
    lower block triangle of ``m^T m`` and solves by Cholesky, which reads only that triangle:
    0.56-0.60x the time of the full product and an LU solve at 1,700-3,400 unknowns, the same
    solution to float32 rounding (``tests/test_value_refit.py``). Where rounding leaves the
    matrix not positive definite, the full matrix goes to the LU solve. Smaller systems keep
    the full product and the LU solve."""
    s = m.shape[1]
    if s < SPD_MIN:
        g = m.T @ m
        g.diagonal().add_(lam)
        return torch.linalg.solve(g, rhs)
    g = torch.empty(s, s, dtype=m.dtype)
    cuts = list(range(0, s, SPD_BLOCK)) + [s]
    for i in range(len(cuts) - 1):
        rows = m[:, cuts[i]:cuts[i + 1]]
        torch.mm(rows.T, m[:, :cuts[i + 1]], out=g[cuts[i]:cuts[i + 1], :cuts[i + 1]])
    g.diagonal().add_(lam)
    low, info = torch.linalg.cholesky_ex(g)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, low)
    g = g.tril() + g.tril(-1).T
    return torch.linalg.solve(g, rhs)


def refit_values(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor,
                 scale: float, rho: float, hold: torch.Tensor | None = None,
                 kept_keys: torch.Tensor | None = None, check: torch.Tensor | None = None) -> torch.Tensor:
    """Refitted values ``[H, |S|, D]`` of the ``kept`` tokens (float32).

    queries ``[Hq, N, D]`` (RoPE'd), keys ``[H, T, D]`` (RoPE'd, as stored), values ``[H, T, D]``;
    ``hold`` (bool ``[|S|]``): kept tokens whose values stay as they are, the others absorb the fit
    (a planted number the document's own queries rarely read would otherwise move almost freely);
    ``kept_keys`` ``[H, |S|, D]``: the keys the kept tokens are read with (e.g. as the loader
    decodes them), default ``keys[:, kept]``; the target is always the full, exact attention.

    ``check`` ``[Hq, M, D]``: other queries of the document, placed as ``queries`` are, that the
    fit does not read. Where a head's fit leaves them a larger attention error than the kept
    values as they are (the fit has more free values than it has queries to pin them: a long
    document), the head takes the better for them of the fit at ``RIDGE_RETRY`` times the ridge
    weight and no fit."""
    H, _, D = keys.shape
    group = queries.shape[0] // H
    out = []
    for h in range(H):
        q = queries[h * group:(h + 1) * group].reshape(-1, D).float()
        k, v = keys[h].float(), values[h].float()
        kk = k[kept] if kept_keys is None else kept_keys[h]
        target = full_attention(q, k, v, scale)
        a, lam = read_together(q, kk, scale, rho)  # [N, S]
        vs = v[kept]
        resid = target - a @ vs
        moves = slice(None) if hold is None else ~hold
        free = a[:, moves]  # the held columns' values are fixed: part of the target
        fitted = vs.clone()
        fitted[moves] += _ridge_move(free, resid, lam)
        if check is not None:
            qc = check[h * group:(h + 1) * group].reshape(-1, D).float()
            want, read = full_attention(qc, k, v, scale), torch.softmax(qc @ kk.float().T * scale, -1)

            def error(x: torch.Tensor) -> float:
                return float((read @ x - want).pow(2).sum())

            if error(fitted) > error(vs):
                heavier = vs.clone()
                heavier[moves] += _ridge_move(free, resid, lam * RIDGE_RETRY)
                fitted = min((heavier, vs), key=error)
        out.append(fitted)
    return torch.stack(out)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` of one head (``q [N, D]``), in blocks of query rows."""
    return torch.cat([torch.softmax(b @ k.T * scale, -1) @ v for b in q.split(_BLOCK)])


def _ridge_move(free: torch.Tensor, resid: torch.Tensor, lam: float) -> torch.Tensor:
    """``dV`` minimising ``||A dV - r||^2 + lam ||dV||^2`` (``free`` = ``A [N, S]``), solved in
    whichever of the kept tokens or the queries is the smaller space."""
    if free.shape[1] <= free.shape[0]:  # (A^T A + lam I) dV = A^T r
        return ridge_solve(free, lam, free.T @ resid)
    # the same, through A^T (A A^T + lam I)^-1 r: the queries' space is the smaller
    return free.T @ ridge_solve(free.T, lam, resid)


def naive_refit_values(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor,
                       scale: float, rho: float, hold: torch.Tensor | None = None,
                       kept_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`refit_values`: the normal equations summed one query at a time (held
    tokens: their values subtracted from the target, then the free tokens' system solved)."""
    H, _, D = keys.shape
    group = queries.shape[0] // H
    S = kept.numel()
    hold = torch.zeros(S, dtype=torch.bool) if hold is None else hold
    free = ~hold
    out = []
    for h in range(H):
        lhs, rhs, norm = torch.zeros(S, S, dtype=torch.float64), torch.zeros(S, D, dtype=torch.float64), 0.0
        k, v = keys[h].double(), values[h].double()
        vs = v[kept]
        ks = k[kept] if kept_keys is None else kept_keys[h].double()
        for q in queries[h * group:(h + 1) * group].reshape(-1, D).double():
            w = torch.softmax(k @ q * scale, 0)
            ws = torch.softmax(ks @ q * scale, 0)
            lhs += torch.outer(ws, ws)
            rhs += torch.outer(ws, w @ v - ws[hold] @ vs[hold])
            norm += float(ws.pow(2).sum())
        lam = rho * norm / S
        sub = lhs[free][:, free] + lam * torch.eye(int(free.sum()), dtype=torch.float64)
        fitted = vs.clone()
        fitted[free] = torch.linalg.solve(sub, rhs[free] + lam * vs[free])
        out.append(fitted)
    return torch.stack(out).float()
