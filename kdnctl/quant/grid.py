"""ec's grid: where a value's code puts it (``mean + k * step / 2**level``, optionally in a key
basis's axes), and what a stored role decodes to, without the lossless coding around it."""

from __future__ import annotations

import torch


def quantize_codes(x: torch.Tensor, step: torch.Tensor, mean: torch.Tensor, levels: torch.Tensor,
                   basis: torch.Tensor | None = None) -> torch.Tensor:
    """Integer codes (as float) of ``x [H, T, D]``: ``round((x - mean) / (step / 2**level))``;
    with ``basis [H, D, D]`` (``kdnctl.format.key_basis``) the step-normalised rows are first rotated
    into its axes: ``round(((x - mean) / step) @ basis * 2**level)``. Chunks of one length may
    come together: ``x [C, H, T, D]``, ``mean [C, H, D]``, ``levels [C, T]`` (the same arithmetic
    per element, so the same codes as one chunk at a time)."""
    return quantize_centred(x - mean[..., None, :], step, level_scales(levels), basis)


def level_scales(levels: torch.Tensor) -> torch.Tensor:
    """``2**level`` of every token, shaped to scale ``[..., T, D]`` rows (``levels [..., T]``)."""
    return torch.pow(2.0, levels.float())[..., None, :, None]


def quantize_centred(centred: torch.Tensor, step: torch.Tensor, scales: torch.Tensor,
                     basis: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`quantize_codes` of ``x - mean`` (``centred``) with ``level_scales(levels)``
    (``scales``): what does not move with the step is computed once where many steps are tried."""
    if basis is None:
        return torch.round(centred / (step[..., None, :] / scales))
    return torch.round(((centred / step[..., None, :]) @ basis) * scales)


def dequantize_codes(codes: torch.Tensor, step: torch.Tensor, mean: torch.Tensor, levels: torch.Tensor,
                     basis: torch.Tensor | None = None) -> torch.Tensor:
    """``codes [..., H, T, D]`` with ``step``/``mean`` ``[..., H, D]``, ``levels [..., T]`` and
    optionally ``basis [..., H, D, D]`` (the inverse of :func:`quantize_codes`)."""
    if basis is None:
        div = step[..., None, :] / torch.pow(2.0, levels.float())[..., None, :, None]
        return codes * div + mean[..., None, :]
    z = codes * torch.pow(2.0, -levels.float())[..., None, :, None]
    return (z @ basis.transpose(-1, -2)) * step[..., None, :] + mean[..., None, :]


def stored_step_mean(x: torch.Tensor, step: torch.Tensor, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step and the per-channel mean (``x [H, T, D]``'s own unless given) as
    ``kdnctl.quant.entropy.encode_role`` stores them (float16)."""
    step = step.to(torch.float16).float()
    if mean is None:
        mean = x.mean(1) if x.shape[1] else torch.zeros_like(step)
    return step, mean.to(torch.float16).float()


def roundtrip_role(x: torch.Tensor, step: torch.Tensor, levels: torch.Tensor,
                   basis: torch.Tensor | None = None) -> torch.Tensor:
    """What ``kdnctl.quant.entropy.decode_role`` gives back for ``encode_role(x, step, levels, basis=basis)``
    (the coding is lossless, so it is skipped): float32 ``[H, T, D]``."""
    step, mean = stored_step_mean(x, step)
    return dequantize_codes(quantize_codes(x, step, mean, levels, basis), step, mean, levels, basis)
