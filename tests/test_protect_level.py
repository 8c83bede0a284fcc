"""``--protect-level`` (ec): how much finer the prompt header and the forced tail are stored."""

from __future__ import annotations

import pytest
import torch

from kdnctl.errors import UsageError


def test_token_levels_take_the_protect_level():
    from kdnctl.compress.options import PROTECT_LEVEL
    from kdnctl.compress.stages.precision import token_levels

    assert token_levels(10, header=2, protect=3).tolist() == [PROTECT_LEVEL] * 2 + [0] * 5 + [PROTECT_LEVEL] * 3
    for level in (0, 1):
        assert token_levels(10, header=2, protect=3, protect_level=level).tolist() == [level] * 2 + [0] * 5 + [level] * 3


def test_recipe_protect_level_is_checked_recorded_and_labelled():
    from kdnctl.compress.document import CompressRecipe
    from kdnctl.recipes import Recipe

    auto = CompressRecipe(budget=0.083)
    assert auto.protect_level is None and "protect_level" not in auto.as_dict()
    one = CompressRecipe(budget=0.083, protect_level=1)  # --quant auto resolves to ec below 0.25
    assert one.as_dict()["protect_level"] == 1
    assert one.default_label() == "ec-b0.083-k0.5-p32-pl1-lliterals+sentences-gap0.3x2k-rf0.01hdf-sentences-gap"
    assert CompressRecipe(budget=0.083, protect_level=0).default_label() != one.default_label()
    with pytest.raises(UsageError, match="from 0 to 2"):
        CompressRecipe(budget=0.083, protect_level=3)
    with pytest.raises(UsageError, match="from 0 to 2"):
        CompressRecipe(budget=0.083, protect_level=True)
    with pytest.raises(UsageError, match="option protect_level"):  # not ec: nothing to make finer
        CompressRecipe(budget=0.5, quant="int4", protect_level=1)
    with pytest.raises(UsageError, match="option protect_level"):
        CompressRecipe(keep=0.5, budget=None, protect_level=1)
    r = Recipe(name="t", compress={"budget": 0.083, "protect_level": 0})
    assert r.compress_recipe().protect_level == 0


def test_compress_with_protect_level_stores_those_levels(tiny_lm, tmp_path_factory):
    """The tiny model: the default stores the forced tail two levels up, level 1 one level up,
    level 0 at the other kept tokens' level; every version fits the cap."""
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.compress.document import CompressRecipe, compress_document

    st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
    made = {}
    with st.writer():
        for level in (None, 1, 0):
            recipe = CompressRecipe(budget=0.3, quant="ec", keep=0.5, protect=16, scorer="sentences", protect_level=level)
            made[level] = compress_document(st, "faq.md", recipe, lm=tiny_lm)
    cap = 0.3 * fp16_size(st, "faq.md")
    labels = {r.label for r in made.values()}
    assert len(labels) == 3 and all(r.bytes <= cap for r in made.values())
    for level, want in ((None, 2), (1, 1), (0, 0)):
        v = st.get_version("faq.md", made[level].label)
        bundles = [decode_bundle(st.read_object(c.object)) for c in v.chunks]
        levels = torch.cat([b.tensors["token_levels"] for b in bundles])
        assert levels[-16:].tolist() == [want] * 16
        assert int(levels.max()) == want
