"""The compiled channel variance (kdnctl/kernels/channel_stats/cpu.py) against torch's
(reference.py): bit for bit, on odd sizes, large means over small spreads, constant channels."""

from __future__ import annotations

import pytest
import torch

from kdnctl.kernels.channel_stats import channel_var, cpu, reference


@pytest.mark.parametrize("h,t,d", [(3, 1018, 64), (1, 1, 5), (2, 37, 7), (4, 256, 128), (3, 7994, 64), (2, 3, 1)])
def test_channel_var_equals_torch(h, t, d):
    g = torch.Generator().manual_seed(h * 1000 + t + d)
    for mean, spread in ((0.0, 1.0), (1e4, 1e-2), (-3.0, 1e3), (0.5, 0.0)):
        x = (torch.randn(h, t, d, generator=g) * spread + mean).float()
        got = torch.from_numpy(cpu.channel_var(x.numpy()))
        assert torch.equal(got, reference.channel_var(x)), (mean, spread)


def test_dispatch():
    x = torch.randn(2, 9, 4)
    assert torch.equal(channel_var(x), x.var(1, unbiased=False))
    assert torch.equal(channel_var(x.transpose(0, 1).transpose(0, 1)), x.var(1, unbiased=False))
    xd = x.double()
    assert torch.equal(channel_var(xd), xd.var(1, unbiased=False))  # (not float32: the reference)
