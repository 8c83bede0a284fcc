"""Key bases: per-model principal axes that ``ec`` codes keys in (option ``key_basis=model``, format 1.7).

The channels of one head's keys are strongly correlated (a key is ``W_k`` times a hidden state),
so an entropy coder spends bits on redundancy that a rotation into principal axes removes:
energy piles into a few axes and the rest code to nearly all zeros. ``ec`` rotates each head's
keys in its step-normalised space ``u = (x - mean) / step`` (every channel one step wide, steps
``~ 1/sqrt(query energy)``), so an orthonormal basis leaves ec's attention-weighted error as it
is and changes only the rate. Measured on stored bytes (``research/probes/basis_probe.py``, the library's
own frames): axes calibrated on *other* documents cut the keys' code bytes by ~16%; a document's
or chunk's own axes cost more to store than they save, so a basis is a per-model asset, made
once from real text (``scripts/calibrate_key_basis.py``) and named by the sha256 of its file.

A basis file is safetensors with one float32 tensor ``basis [L, H, D, D]`` (columns are axes,
largest variance first). Bundles name it (``meta["quant"]["key_basis"]``); encoder and decoder
use the very same float32 matrix, read from the registry: ``kdnctl/bases/`` (shipped with the
package) and the directories in ``$KDNCTL_KEY_BASES`` (``os.pathsep``-separated). Each holds
``<sha256>.safetensors`` and ``index.json`` mapping model fingerprints to a basis.
"""

from __future__ import annotations

import torch

from kdnctl.errors import UsageError


def calibrate(samples) -> torch.Tensor:
    """Principal axes ``[L, H, D, D]`` (float32, columns by decreasing variance) of step-normalised
    keys: ``samples`` yields ``u [L, H, T, D]`` (any number of tokens per sample)."""
    cov = None
    for u in samples:
        u = u.double()
        c = u.transpose(-1, -2) @ u
        cov = c if cov is None else cov + c
    if cov is None:
        raise UsageError("calibrating a key basis needs at least one document")
    axes = torch.linalg.eigh(cov)[1].flip(-1)
    # one sign per axis (largest component positive): the same text gives the same file
    idx = axes.abs().argmax(-2, keepdim=True)
    axes = axes * torch.sign(torch.gather(axes, -2, idx))
    return axes.float().contiguous()


def key_samples(lm, token_lists, chunk_tokens: int = 256):
    """Step-normalised keys ``u [L, H, T, D]`` of each document (``token_lists``: token ids),
    what :func:`calibrate` takes: keys before RoPE (the key projection's output, what ``ec`` stores),
    each chunk's mean removed, divided by ec's relative steps from the document's own queries."""
    from kdnctl.allocate.rate import relative_steps
    from kdnctl.models import adapter_for
    from kdnctl.quant.sensitivity import key_weights

    adapter = adapter_for(lm.model)
    n_layers, h, d = adapter.n_layers, adapter.n_kv_heads, adapter.head_dim
    for ids in token_lists:
        keys: list = [None] * n_layers

        def grab(i, _role, k):
            keys[i] = k.float().cpu().transpose(0, 1)

        with adapter.capture(("k",), on=grab), torch.no_grad():
            adapter.decoder(torch.tensor([list(ids)], device=lm.model.device), use_cache=False)
        w = key_weights(lm, list(ids), n_layers, h, d)
        u = []
        for i, x in enumerate(keys):
            step = relative_steps(x, w[i]).clamp_min(1e-6)
            centred = torch.cat([c - c.mean(1, keepdim=True) for c in x.split(chunk_tokens, 1)], 1)
            u.append(centred / step[:, None, :])
        yield torch.stack(u)
