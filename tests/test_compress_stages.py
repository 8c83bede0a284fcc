"""The compress pipeline's registries: every stage a pipeline names is registered, each recipe
kind runs its pipeline, ec's kept set comes from the recipe's press, scorers are found by name."""

import pytest
import torch

from kdnctl.compress.recipe import CompressRecipe
from kdnctl.compress.stages import PIPELINES, STAGES, pipeline_for
from kdnctl.compress.stages.select import shared_keep, shared_press
from kdnctl.errors import UsageError
from kdnctl.presses.base import ScoreContext
from kdnctl.scorers import SCORERS, compute_importance


def test_every_pipeline_names_registered_stages_once():
    for name, stages in PIPELINES.items():
        assert stages and len(set(stages)) == len(stages), name
        assert all(s in STAGES for s in stages), name
    assert {s for stages in PIPELINES.values() for s in stages} == set(STAGES)
    assert all(cls.name == name for name, cls in STAGES.items())


@pytest.mark.parametrize("kwargs,want", [({"budget": 0.25}, "ec"), ({"budget": 0.083}, "ec"),
                                         ({"budget": 0.25, "quant": "ladder"}, "ladder"),
                                         ({"budget": None, "keep": 0.5}, "plain"),
                                         ({"budget": None, "quant": "int4"}, "plain")])
def test_each_recipe_kind_runs_its_pipeline(kwargs, want):
    assert pipeline_for(CompressRecipe(**kwargs)) == want


def test_ec_keeps_what_the_recipes_press_ranks_first():
    """The kept set is the press's: knorm ranks by the keys (low norm first), not by importance."""
    g = torch.Generator().manual_seed(3)
    n, header, protect = 40, 2, 3
    importance = torch.rand(2, 2, n, generator=g)
    keys = [torch.randn(2, n, 8, generator=g) for _ in range(2)]
    ctx = ScoreContext(importance=importance, keys=keys)
    by_importance = shared_keep(importance, 0.5, header, protect).tolist()
    press = shared_press(header, protect, "knorm")
    by_norm = shared_keep(importance, 0.5, header, protect, press=press, ctx=ctx).tolist()
    score = press.token_scores(ctx)
    forced = set(range(header)) | set(range(n - protect, n))
    rest = sorted((t for t in range(n) if t not in forced), key=lambda t: (-float(score[t]), t))
    assert by_norm == sorted(forced | set(rest[:round(0.5 * n) - len(forced)]))
    assert by_norm != by_importance


def test_scorers_are_found_by_name():
    assert all(cls.name == name for name, cls in SCORERS.items())
    window = torch.rand(2, 3, 7)
    assert torch.equal(compute_importance("window", {"window": window}, n_layers=2, n_heads=3), window)
    surprisal = torch.rand(7)
    got = compute_importance("surprisal", {"surprisal": surprisal}, n_layers=2, n_heads=3)
    assert got.shape == (2, 3, 7) and torch.equal(got[1, 2], surprisal)
    with pytest.raises(UsageError, match="unknown scorer"):
        compute_importance("nope", {}, n_layers=1, n_heads=1)
    with pytest.raises(UsageError, match="needs the model"):
        compute_importance("reconstruct", {}, n_layers=1, n_heads=1)
