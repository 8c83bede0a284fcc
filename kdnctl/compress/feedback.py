"""Value feedback: the refitted values quantized one token at a time, each token's rounding error
carried into the tokens of its chunk not yet rounded (``--refit-feedback``).

The value refit (``kdnctl.compress.refit``) minimises, per layer and KV head,

    f(V) = || A_S V - A V ||^2 + lam || V - V_S ||^2

whose minimum V* it returns; ec then rounds V* to its grid token by token. Since f is quadratic,
f(Q) = f(V*) + sum over channels of (q - v*)^T H (q - v*) with H = A_S^T A_S + lam I, so rounding
errors cost through H, and tokens the same queries read together can cancel each other's. On the
real model the values' rounding is most of what a stored 0.083 version's attention output misses
(research/history-2026-11.md), so the rounding is done as optimal brain quantization does for
weights: round one token, move the not-yet-rounded ones to the optimum given it (the
Cholesky-factor form of that update), within a chunk (the chunk is what is stored together and
shares one mean; it also bounds H to the chunk's kept tokens, so the cost stays linear in the
document). Held tokens (``--refit-hold``) are rounded first, so they never absorb others' errors.
The grid is ec's own: ``mean + k * step / 2**level``; ``kdnctl.quant.entropy.encode_role`` codes
the result exactly (given the same mean).
"""

from __future__ import annotations

import torch

from ..quant.grid import stored_step_mean
from .refit import read_together


def round_with_feedback(x: torch.Tensor, h: torch.Tensor, mean: torch.Tensor, div: torch.Tensor,
                        order: torch.Tensor, compiled: bool = True) -> torch.Tensor:
    """``x [S, D]`` rounded to ``mean + k * div`` (``mean [D]``, ``div [S, D]``), token by token in
    ``order``, each rounding error carried into the tokens after it through ``h [S, S]`` (positive
    definite): the result minimises ``(q - x)^T h (q - x)`` greedily, as the naive reference does.
    The token loop is compiled (``kdnctl.kernels.feedback``); ``compiled`` False runs its torch
    reference, equal bit for bit."""
    s = x.shape[0]
    if s == 0:
        return x.clone()
    w = x[order].double().clone()
    hp = h[order][:, order].double()
    dv = div[order].double()
    m = mean.double()
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hp)), upper=True)
    q = torch.empty_like(w)
    if compiled:
        from ..kernels.feedback import cpu

        cpu.round_tokens(w.numpy(), u.contiguous().numpy(), m.contiguous().numpy(), dv.contiguous().numpy(), q.numpy())
    else:
        from ..kernels.feedback import reference

        reference.round_tokens(w, u, m, dv, q)
    out = torch.empty_like(q)
    out[order] = q
    return out.to(x.dtype)


def naive_round_with_feedback(x: torch.Tensor, h: torch.Tensor, mean: torch.Tensor, div: torch.Tensor,
                              order: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`round_with_feedback`: after each rounding, the tokens not yet rounded
    are solved afresh for the optimum of ``(v - x)^T h (v - x)`` with the rounded ones fixed."""
    x, h, mean, div = x.double(), h.double(), mean.double(), div.double()
    cur = x.clone()
    done: list[int] = []
    for i in order.tolist():
        cur[i] = mean + torch.round((cur[i] - mean) / div[i]) * div[i]
        done.append(i)
        rest = [j for j in range(x.shape[0]) if j not in done]
        if rest:
            f, r = torch.tensor(done), torch.tensor(rest)
            cur[r] = x[r] - torch.linalg.solve(h[r][:, r], h[r][:, f] @ (cur[f] - x[f]))
    return cur.float()


def rounding_order(read: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The tokens' rounding order: ``held`` ones first (nothing moves them), then the most read
    (``read``: the normal matrix's diagonal; they have the most to give), ties to the earlier token."""
    order = torch.argsort(-read, stable=True)
    return order[torch.argsort((~held[order]).to(torch.uint8), stable=True)]


def feedback_values(queries: torch.Tensor, kept_keys: torch.Tensor, values: torch.Tensor, scale: float, rho: float,
                    step: torch.Tensor, levels: torch.Tensor, bounds, hold: torch.Tensor | None = None) -> torch.Tensor:
    """Refitted ``values [H, S, D]`` rounded to ec's grid (``step [H, D]`` before float16, token
    ``levels [S]``) with feedback, chunk by chunk (``bounds``: ``[start, end)`` of each chunk's kept
    tokens); ``queries [Hq, N, D]`` and ``kept_keys [H, S, D]`` as the refit read them."""
    n_heads = kept_keys.shape[0]
    group = queries.shape[0] // n_heads
    out = torch.empty(values.shape, dtype=torch.float32)
    pow2 = torch.pow(2.0, levels.float())
    first = torch.zeros(levels.numel(), dtype=torch.bool) if hold is None else hold
    for j in range(n_heads):
        a, lam = read_together(queries[j * group:(j + 1) * group], kept_keys[j], scale, rho)
        for lo, hi in bounds:
            x = values[j, lo:hi].float()
            st, mean = stored_step_mean(x[None], step[j:j + 1])
            ac = a[:, lo:hi].double()
            h = ac.T @ ac
            h.diagonal().add_(lam)
            div = st[0][None, :] / pow2[lo:hi, None]
            out[j, lo:hi] = round_with_feedback(x, h, mean[0], div, rounding_order(h.diagonal(), first[lo:hi]))
    return out
