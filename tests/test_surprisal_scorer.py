"""SurprisalScorer (kdnctl/engine/prefill.py): the low-precision vocabulary projection is converted
once per weight, and the tiled logsumexp equals a whole-vocabulary one (issue 15)."""

from __future__ import annotations

import torch

from kdnctl.engine.prefill import SurprisalScorer


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
        h = torch.randn(7, 64)
        t = torch.randint(0, 20000, (7,))
        with torch.no_grad():
            logits = head(h)
            want = torch.logsumexp(logits, -1) - logits.gather(1, t[:, None])[:, 0]
            got = SurprisalScorer(head, torch.float32)(h, t)
        assert SurprisalScorer.VOCAB_TILE < 20000  # more than one tile
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
