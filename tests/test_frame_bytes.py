"""The compiled frame cutter (kdnctl/kernels/ec/frame_bytes.py) against the numpy reference
(kdnctl.quant.frames.frame_payloads): the same bytes and peaks for every packing and width."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdnctl.kernels.ec.digits import OWN_WIDTHS, codes_per_byte
from kdnctl.kernels.ec.frame_bytes import frame_bytes
from kdnctl.quant.entropy import encode_codes, spread_bins
from kdnctl.quant.frames import frame_payloads


def _codes(seed: int, h: int, t: int, d: int, wide: bool) -> torch.Tensor:
    """Integer codes whose channels range from all zero through small peaks (packed digits) to
    int8 and, where ``wide``, codes that need two bytes."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.0, 0.2, 0.6, 1.5, 3.0, 20.0, 60.0] + ([900.0] if wide else []))
    per_channel = scale[torch.randint(0, len(scale), (h, 1, d), generator=g)]
    codes = torch.round(torch.randn(h, t, d, generator=g) * per_channel)
    return codes.clamp(-32767, 32767) if wide else codes.clamp(-127, 127)


def _reference(codes, bins, width):
    datas, peaks = frame_payloads(codes, bins, width)
    return b"".join(datas), [len(x) for x in datas], peaks


@pytest.mark.parametrize("h,t,d,wide,width", [
    (3, 37, 16, False, 1), (2, 1, 8, False, 1), (1, 61, 5, True, OWN_WIDTHS), (3, 40, 24, True, 2),
    (2, 256, 64, True, OWN_WIDTHS), (4, 13, 7, False, 1), (2, 0, 8, False, 1)])
def test_frame_bytes_equal_the_reference(h, t, d, wide, width):
    for seed in range(3):
        codes = _codes(seed, h, t, d, wide)
        bins = spread_bins(codes)
        buf, offsets, peaks = frame_bytes(codes.numpy(), bins.flatten().numpy(), width)
        data, lens, ref_peaks = _reference(codes, bins, width)
        assert buf.tobytes() == data
        assert np.diff(offsets).tolist() == lens
        assert peaks.tolist() == ref_peaks


def test_every_packing_appears():
    codes = _codes(5, 3, 61, 32, True)
    _, _, peaks = frame_bytes(codes.numpy(), spread_bins(codes).flatten().numpy(), OWN_WIDTHS)
    assert {codes_per_byte(int(p)) for p in peaks} >= {0, 1, 2, 3, 5}, peaks.tolist()


@pytest.mark.parametrize("own_widths", [True, False])
def test_blob_equals_the_plain_loop(own_widths):
    """``encode_codes`` (frames cut by the compiled cutter) writes the blob of its plain loop."""
    for seed in range(4):
        codes = _codes(seed, 3, 45, 16, seed % 2 == 0)
        fast, bins = encode_codes(codes, "deflate", own_widths=own_widths)
        ref, ref_bins = encode_codes(codes, "deflate", reference=True, own_widths=own_widths)
        assert torch.equal(bins, ref_bins) and torch.equal(fast, ref)

