"""The compress recipe: a dozen fields and one options table; recipes and catalog records written
before (flat option fields, ``method``, press settings in ``[compress.options]``) parse to the same
recipe; ``kdnctl compress`` takes the rest through ``--option KEY=VALUE``. No model is needed."""

from __future__ import annotations

import dataclasses

import pytest
from typer.main import get_command

from kdnctl.cli.app import app
from kdnctl.compress.document import CompressRecipe
from kdnctl.compress.options import OPTIONS
from kdnctl.errors import UsageError
from kdnctl.recipes import load_recipe

from conftest import REPO, run_cli

# The records the two defaults wrote before names were short (their last recipe step).
OLD_RECORDS = {
    0.25: {"step": "compress", "budget": 0.25, "keep": 1.0, "method": "kvcrush", "scorer": "hybrid", "quant": "ec",
           "group_size": 32, "seed": 0, "method_options": {}, "protect": 64, "lift": "literals", "lift_share": 0.3,
           "lift_level": 2, "lift_role": "keys", "layers": "fisher"},
    0.083: {"step": "compress", "budget": 0.083, "keep": 0.5, "method": "kvcrush", "scorer": "sentences-gap",
            "quant": "ec", "group_size": 32, "seed": 0, "method_options": {}, "protect": 32, "lift": "literals",
            "lift_share": 0.3, "lift_level": 2, "lift_role": "keys", "layers": "even", "refit": 0.01,
            "refit_hold": True, "refit_decoded": True, "refit_feedback": True},
}


def test_recipe_has_at_most_twelve_fields():
    names = [f.name for f in dataclasses.fields(CompressRecipe)]
    assert len(names) <= 12 and "options" in names
    assert not set(names) & set(OPTIONS)  # each setting in one place


# The 0.083 default's record before its steps came from the model's Fisher profile: its lift
# already took the better rank of literals and its eviction scorer
EVEN_RECORD = {**OLD_RECORDS[0.083], "lift": "literals+sentences-gap"}
# What the defaults record now
RECORDS = {0.25: OLD_RECORDS[0.25], 0.083: {**EVEN_RECORD, "layers": "fisher"}}


@pytest.mark.parametrize("budget", sorted(RECORDS))
def test_the_defaults_record_what_they_record(budget):
    """A default's record reads back as itself and is named after its budget; at 0.25 it is the
    record of the versions made before names were short ('unchanged', not remade)."""
    assert CompressRecipe(budget=budget).as_dict() == RECORDS[budget]
    again = CompressRecipe.from_dict(RECORDS[budget])
    assert again.as_dict() == RECORDS[budget] and again.default_label() == f"b{budget:g}"


def test_the_earlier_0083_default_reads_back_under_its_spelled_out_name():
    """The 0.083 default's record before its lift took the eviction scorer's ranks too: it reads
    back as itself, named by its recipe, so a store's version of it is never taken for b0.083."""
    old = CompressRecipe.from_dict(OLD_RECORDS[0.083])
    assert old.as_dict() == OLD_RECORDS[0.083]
    assert old.default_label() == "ec-b0.083-k0.5-p32-lliterals0.3x2k-even-rf0.01hdf-sentences-gap"


def test_the_even_step_0083_default_reads_back_under_its_spelled_out_name():
    """The 0.083 default's record before its steps came from the Fisher profile: itself, and never
    taken for b0.083 (a store holding it under that name refuses the new default's compress)."""
    even = CompressRecipe.from_dict(EVEN_RECORD)
    assert even.as_dict() == EVEN_RECORD
    assert even.default_label() == "ec-b0.083-k0.5-p32-lliterals+sentences-gap0.3x2k-even-rf0.01hdf-sentences-gap"


def test_names_short_for_a_budget_spelled_out_otherwise():
    assert CompressRecipe(budget=0.25).default_label() == "b0.25"
    assert CompressRecipe(budget=0.083, keep=0.5).default_label() == "b0.083"  # what auto chooses anyway
    assert CompressRecipe(budget=0.5).default_label() == "b0.5"
    assert CompressRecipe(budget=0.25, quant="int4").default_label() == "int4-b0.25"
    assert CompressRecipe(budget=0.083, refit=0).default_label() == \
        "ec-b0.083-k0.5-p32-lliterals+sentences-gap0.3x2k-sentences-gap"
    assert CompressRecipe(budget=None, keep=0.5).default_label() == "kvcrush-k0.5"


def test_old_recipe_files_parse(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text('name = "old"\n[compress]\nbudget = 0.083\nquant = "ec"\nkeep = 0.5\nprotect = 32\nmethod = "kvcrush"\n'
                   'scorer = "sentences-gap"\ngroup_size = 32\nlift = "literals"\nlift_share = 0.3\nlift_level = 2\n'
                   'lift_role = "keys"\nrefit = 0.01\nrefit_hold = true\nrefit_decoded = true\nrefit_feedback = true\n')
    # a file that leaves a field out takes today's default for it (the steps' split: fisher)
    assert load_recipe(old).compress_recipe().as_dict() == {**OLD_RECORDS[0.083], "layers": "fisher"}
    evict = tmp_path / "evict.toml"
    evict.write_text('name = "e"\n[compress]\nkeep = 0.5\nmethod = "kvcrush"\n[compress.options]\nratio = 0.5\n')
    r = load_recipe(evict).compress_recipe()
    assert r.budget is None and r.press == "kvcrush" and r.press_options == {"ratio": 0.5}
    new = tmp_path / "new.toml"
    new.write_text('name = "n"\n[compress]\nbudget = 0.083\n[compress.options]\nrefit = 0\n')
    assert load_recipe(new).compress_recipe().refit is None


@pytest.mark.parametrize("name", ["size-0.25", "size-0.083", "size-0.6", "lossless-int8"])
def test_shipped_recipes_parse(name):
    recipe = load_recipe(REPO / "recipes" / f"{name}.toml")
    r = recipe.compress_recipe()
    if name.startswith("size-0.") and name != "size-0.6":
        assert recipe.label == r.default_label() == f"b{r.budget:g}"


def test_options_are_checked_where_they_are_read():
    for bad in ({"refit": -1}, {"lift_level": 9}, {"key_basis": "pca"}, {"tail_reads": 1.0}, {"coding": "lzma"}):
        with pytest.raises(UsageError, match=next(iter(bad))):
            CompressRecipe(budget=0.083, **bad)
    with pytest.raises(UsageError, match="unknown compress"):
        CompressRecipe.from_dict({"budget": 0.25, "options": {"nonsense": 1}})
    with pytest.raises(TypeError):
        CompressRecipe(budget=0.25, nonsense=1)


def test_compress_help_lists_at_most_sixteen_options():
    cmd = get_command(app).commands["compress"]
    options = [p for p in cmd.get_params(get_command(app).make_context("kdnctl", ["compress"], resilient_parsing=True))
               if p.param_type_name == "option"]
    assert len(options) <= 16, [p.name for p in options]


@pytest.mark.parametrize("args, words", [
    (["--option", "nonsense=1"], ["unknown compress option", "refit"]),
    (["--option", "refit"], ["KEY=VALUE"]),
    (["--option", "lift_level=9"], ["lift_level", "1 to 4"]),
    (["--keep", "0.5", "--option", "workers=2"], ["--ray"]),
])
def test_bad_options_are_one_line_errors(tmp_path, args, words):
    proc = run_cli("compress", *args, store=tmp_path / "none")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert all(w in proc.stderr for w in words), proc.stderr
