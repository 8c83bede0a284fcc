"""How ``ec`` splits its bytes across layers and roles: a Fisher estimate of each one's damage.

``kdnctl.allocate.rate`` gives every head of every layer the same weighted error relative to its
own energy. What that error costs the model differs by orders of magnitude between layers
(``research/probes/layer_probe.py`` on SmolLM2: quantizing layer 18's keys alone moves the model's
predictions ~1000x more than layer 11's at the same relative error; the pattern correlates 0.96
between documents). Measured by a query-agnostic probe, KVzip's task: repeat the document's
first ``PROBE_TOKENS`` tokens after ``REPEAT_PROMPT`` over its cache.

For small independent noise of variance ``s_e^2`` on cache element ``e`` the expected KL of
the probe's next-token distributions is ``0.5 * sum_e F_e s_e^2`` with ``F_e`` the diagonal of
the Fisher information summed over probe positions, ``F_e = sum_p E_y[g_{p,e}^2]`` (``g_{p,e}``:
the gradient of ``log p_p(y)`` with respect to ``e``, ``y`` drawn from the model). One backward
pass estimates it without bias: draw ``y_p`` and a random sign ``r_p`` per position and
back-propagate ``sum_p r_p log p_p(y_p)``; the cross terms of its squared gradient vanish in
expectation over the signs. On real documents it matches the KL measured by quantizing each
layer and role alone (60 forward passes) with a log correlation of 0.94-0.96 in one backward.

The steps of layer ``l`` and role ``r`` are then scaled by ``(gmean(m) / m_lr) ** EXPONENT``,
clipped to ``[1 / CLIP, CLIP]``, where ``m_lr`` is the estimated KL of that layer and role at
the even allocation. ``EXPONENT = 0.5`` would be the high-rate optimum for the probe's KL; the
probe is a proxy for the questions, so half of that is taken (``research/results/layer-probe``, 4
documents at equal bytes: the probe's KL fell 3-18x with either exponent; the answer NLL of
every planted fact moved by +0.017 nats on average with 0.25 and +0.062 with 0.5, against
+0.073 for the even split: noise at 4 documents, which the 160-task run settles).
"""

from __future__ import annotations

import torch
from kdnctl.models.cache_args import cache_arg

PROBE_TOKENS = 192
EXPONENT, CLIP = 0.25, 4.0


def probe_ids(lm, token_ids: list[int], header: int) -> list[int]:
    """The probe: ``REPEAT_PROMPT`` + the document's first ``PROBE_TOKENS`` tokens after its header."""
    from ..scorers.reconstruct import REPEAT_PROMPT

    prompt = lm.tokenizer(REPEAT_PROMPT, add_special_tokens=False).input_ids
    return prompt + list(token_ids[header:header + PROBE_TOKENS])


def _log_probs(lm, keys, values, probe: list[int], start: int) -> torch.Tensor:
    """``[P, V]`` float32 log-probabilities of the probe's next tokens over the cache ``keys``/``values``
    (``[H, T, D]`` per layer, as RoPE'd and stored by transformers); the probe starts at position ``start``."""
    from transformers import DynamicCache

    model = lm.model
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[None].to(device, lm.dtype), v[None].to(device, lm.dtype), i)
    out = model(input_ids=torch.tensor([probe], device=device), **cache_arg(model, cache), use_cache=True,
                position_ids=torch.arange(start, start + len(probe), device=device)[None]).logits[0]
    return torch.log_softmax(out.float(), -1)


def _draws(lm, keys, values, probe: list[int], start: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled next tokens ``y [P]`` and the random signs ``r [P]`` of one estimate."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        probs = _log_probs(lm, keys, values, probe, start).exp().cpu()
    y = torch.multinomial(probs, 1, generator=g)[:, 0]
    return y, torch.randint(0, 2, (len(probe),), generator=g).float() * 2 - 1


def _cache_grads(objective: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]):
    """Gradients of ``objective`` with respect to the cache's keys and values only, on the host.
    ``autograd.grad`` with these inputs skips every weight's gradient (the backward's matmuls
    against the activations: about a quarter of its time) and leaves no ``.grad`` on the
    model's parameters, which ``backward()`` would fill (a second copy of the weights, kept
    for the life of the process)."""
    grads = torch.autograd.grad(objective, [*ks, *vs])
    return [g.cpu() for g in grads[:len(ks)]], [g.cpu() for g in grads[len(ks):]]


def _grads(lm, keys, values, probe: list[int], start: int, y: torch.Tensor, weight: torch.Tensor):
    """Gradients of ``sum_p weight_p log p_p(y_p)`` with respect to every layer's keys and values."""
    with torch.inference_mode(False), torch.enable_grad():  # compress may run under inference mode
        ks = [k.detach().float().clone().requires_grad_(True) for k in keys]
        vs = [v.detach().float().clone().requires_grad_(True) for v in values]
        lp = _log_probs(lm, ks, vs, probe, start)
        return _cache_grads((lp.gather(1, y.to(lp.device)[:, None])[:, 0] * weight.to(lp.device)).sum(), ks, vs)


def channel_fisher(lm, keys, values, probe: list[int], start: int, token_weight: torch.Tensor, seed: int = 0):
    """Per layer ``(F_keys, F_values)``, each ``[H, D]``, from one seeded draw of ``y`` and the
    signs: :func:`signed_fisher` after :func:`_draws`, in one forward pass (the draw is taken
    from the log-probabilities the backward then runs through: the same values the separate
    no-grad pass computes, tested)."""
    with torch.inference_mode(False), torch.enable_grad():  # compress may run under inference mode
        ks = [k.detach().float().clone().requires_grad_(True) for k in keys]
        vs = [v.detach().float().clone().requires_grad_(True) for v in values]
        lp = _log_probs(lm, ks, vs, probe, start)
        g = torch.Generator().manual_seed(seed)
        y = torch.multinomial(lp.detach().exp().cpu(), 1, generator=g)[:, 0]
        sign = torch.randint(0, 2, (len(probe),), generator=g).float() * 2 - 1
        gk, gv = _cache_grads((lp.gather(1, y.to(lp.device)[:, None])[:, 0] * sign.to(lp.device)).sum(), ks, vs)
    w = token_weight.float()[None, :, None]
    return [((a.pow(2) * w).sum(1), (b.pow(2) * w).sum(1)) for a, b in zip(gk, gv)]


def signed_fisher(lm, keys, values, probe: list[int], start: int, token_weight: torch.Tensor,
                  y: torch.Tensor, sign: torch.Tensor):
    """``sum_t token_weight_t G_{h,t,c}^2`` per layer and role, ``G`` the gradient of
    ``sum_p sign_p log p_p(y_p)``. Its mean over all sign patterns is :func:`naive_channel_fisher`."""
    gk, gv = _grads(lm, keys, values, probe, start, y, sign)
    w = token_weight.float()[None, :, None]
    return [((a.pow(2) * w).sum(1), (b.pow(2) * w).sum(1)) for a, b in zip(gk, gv)]


def naive_channel_fisher(lm, keys, values, probe: list[int], start: int, token_weight: torch.Tensor,
                         y: torch.Tensor):
    """Reference: one backward per probe position, ``sum_p sum_t token_weight_t g_{p,h,t,c}^2``."""
    out = None
    w = token_weight.float()[None, :, None]
    for p in range(len(probe)):
        one = torch.zeros(len(probe))
        one[p] = 1.0
        gk, gv = _grads(lm, keys, values, probe, start, y, one)
        terms = [((a.pow(2) * w).sum(1), (b.pow(2) * w).sum(1)) for a, b in zip(gk, gv)]
        out = terms if out is None else [(a + c, b + d) for (a, b), (c, d) in zip(out, terms)]
    return out


def layer_damage(fisher, steps) -> torch.Tensor:
    """``[L, 2]`` expected KL of each layer's keys and values quantized alone with ``steps``
    (per layer ``(step_keys, step_values)``, ``[H, D]``): ``0.5 * sum F * step^2 / 12``."""
    return torch.tensor([[float(0.5 * (f * s.float().pow(2) / 12).sum()) for f, s in zip(fs, ss)]
                         for fs, ss in zip(fisher, steps)])


def layer_multipliers(damage: torch.Tensor) -> torch.Tensor:
    """``[L, 2]`` step multipliers: ``(gmean(m) / m) ** EXPONENT`` clipped to ``[1 / CLIP, CLIP]``
    (a layer and role without measurable damage gets the coarsest)."""
    m = damage.double().clamp_min(1e-30)
    g = m.log().mean().exp()
    return (g / m).pow(EXPONENT).clamp(1 / CLIP, CLIP).float()
