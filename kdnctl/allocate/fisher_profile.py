"""A model's Fisher profile: the per-channel Fisher estimate of :mod:`kdnctl.allocate.layer_fisher`,
measured once per model on a few documents instead of once per compressed document.

The layer multipliers need only how much each layer's and role's error costs relative to the
others, a pattern that belongs mostly to the model (``research/probes/fisher_profile.py``): the
profile saves every later compress the probe's forward and backward, most of a compress at the
0.25 default, and moves the answers about as much as another seed of a document's own estimate
(``research/results/quality-fisher-profile-2026-11-30/``). It weights every token the same, where
a document's own estimate counts tokens stored 4x finer 16x less.

A profile is float32 ``[L, 2, H, D]`` (layer, keys/values, KV head, channel): each calibration
document's channel Fisher with every token weighted the same, divided by its own total so that
each document counts the same, then averaged. ``layer_damage`` takes it as it takes one
document's estimate; the multipliers do not depend on its scale.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterable

import torch

from kdnctl.format.fisher_profile import check, decode, encode  # noqa: F401 (the profile's file, re-exported)

from . import layer_fisher as lf

CAL_DOCS = 4  # documents a profile is measured on at most
CAL_TOKENS = 1536  # tokens of each (the cache the probe reads)

# while a compress runs (``model_profile``): model fingerprint -> its profile
_PROFILE_FOR_MODEL: contextvars.ContextVar[dict[str, torch.Tensor]] = contextvars.ContextVar("profile_for_model",
                                                                                              default={})


Sample = tuple[list[int], int, list[torch.Tensor], list[torch.Tensor], int]


def calibrate(lm, samples: Iterable[Sample], seed: int = 0) -> tuple[torch.Tensor | None, int]:
    """(the profile of ``samples``, how many documents it is measured on): per document, its token
    ids, its header's length, its cache's keys and values per layer ``[H, T, D]`` as stored, and
    the position after the cache (where the probe of ``layer_fisher`` starts). None where no
    document is longer than its header."""
    total, n = None, 0
    for ids, header, keys, values, start in samples:
        if len(ids) <= header:
            continue
        probe = lf.probe_ids(lm, ids, header)
        fisher = lf.channel_fisher(lm, keys, values, probe, start, torch.ones(len(ids)), seed)
        x = torch.stack([torch.stack([k, v]) for k, v in fisher]).double()
        if not float(x.sum()) > 0:
            continue
        x = x / x.sum()
        total, n = (x if total is None else total + x), n + 1
    return (None if total is None else (total / n).float()), n


def as_layers(profile: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``profile`` in the per-layer ``(keys, values)`` form ``layer_fisher.layer_damage`` takes."""
    return [(p[0], p[1]) for p in profile]


def profile_for(fingerprint: str | None) -> torch.Tensor | None:
    """The profile a compress running now uses for model ``fingerprint``, or None (the document's own estimate)."""
    return None if fingerprint is None else _PROFILE_FOR_MODEL.get().get(fingerprint)


@contextlib.contextmanager
def model_profile(fingerprint: str | None, profile: torch.Tensor | None):
    """Within the block, :func:`profile_for` ``(fingerprint)`` is ``profile`` (nothing changes with None)."""
    if profile is None or fingerprint is None:
        yield
        return
    token = _PROFILE_FOR_MODEL.set({**_PROFILE_FOR_MODEL.get(), fingerprint: profile})
    try:
        yield
    finally:
        _PROFILE_FOR_MODEL.reset(token)

