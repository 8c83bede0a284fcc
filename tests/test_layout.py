"""The package layout rules of docs/architecture.md: no import cycle, imports point down, no
private names across modules, modules under 500 lines (scripts/check_imports.py)."""

import importlib.util

from conftest import REPO


def test_imports_point_down_no_cycles_small_modules():
    spec = importlib.util.spec_from_file_location("check_imports", REPO / "scripts" / "check_imports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.find_problems() == []


def test_every_command_module_is_registered():
    from kdnctl.cli import app as app_module

    registered = {m.__name__.rsplit(".", 1)[1] for m in app_module.COMMAND_MODULES}
    on_disk = {p.stem for p in (REPO / "kdnctl" / "cli").glob("*_cmd*.py")}
    assert on_disk <= registered
