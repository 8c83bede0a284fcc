"""SurprisalScorer (kdnctl/engine/prefill.py): the low-precision vocabulary projection is converted
once per weight, and the tiled logsumexp equals a whole-vocabulary one, on the host's fp32 path
and on torch's."""

from __future__ import annotations

import torch

from kdnctl.engine.prefill import SurprisalScorer
from kdnctl.kernels.vocab import cpu, reference


def _head(vocab=20000, d=64, bias=False):
    torch.manual_seed(0)
    head = torch.nn.Linear(d, vocab, bias=bias)
    head.weight.data.mul_(0.5)
    return head


def test_low_precision_weight_is_converted_once_and_refreshed_after_an_edit():
    head = _head()
    a, b = SurprisalScorer(head, torch.bfloat16), SurprisalScorer(head, torch.bfloat16)
    assert a.low is b.low and a.low.dtype == torch.bfloat16  # one conversion, shared
    with torch.no_grad():
        head.weight.add_(1.0)  # an in-place change of the weight (e.g. a fine-tune step)
    c = SurprisalScorer(head, torch.bfloat16)
    assert c.low is not a.low and torch.equal(c.low, head.weight.detach().to(torch.bfloat16))
    assert SurprisalScorer(head, torch.float32).low is head.weight  # no copy at the weight's dtype


def test_tiled_logsumexp_equals_the_whole_vocabulary_one():
    for bias in (False, True):
        head = _head(bias=bias)
        h = torch.randn(300, 64)  # more than one row tile of the torch path
        t = torch.randint(0, 20000, (300,))
        with torch.no_grad():
            logits = head(h)
            want = torch.logsumexp(logits, -1) - logits.gather(1, t[:, None])[:, 0]
            host = SurprisalScorer(head, torch.float32)
            assert host.host  # fp32 on the host: numpy's BLAS
            got = host(h, t)
            # the same fp32 logsumexp on torch's path (the reference, tiled by rows and vocabulary)
            host.host = False
            on_torch = host(h, t)
            target = (h * head.weight[t]).sum(-1) + (head.bias[t] if bias else 0)
            assert torch.equal(got, cpu.vocab_logsumexp(h, head.weight, head.bias if bias else None) - target)
        assert SurprisalScorer.HOST_VOCAB_TILE < 20000 and cpu.VOCAB_TILE < 20000  # more than one tile
        assert SurprisalScorer.ROW_TILE < 300
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(on_torch, want, atol=1e-4, rtol=0)


def test_empty_input():
    head = _head()
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            assert SurprisalScorer(head, dtype)(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long)).shape == (0,)
