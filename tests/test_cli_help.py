"""Every option's help text reaches ``--help`` whole: rich markup would swallow a bracketed word
such as ``kdnctl[ray]`` (an extra's name the user has to type) unless it is escaped."""

from __future__ import annotations

import re

import click
from click.testing import CliRunner
from typer.main import get_command

from kdnctl.cli.app import app


def _commands(group: click.Command, path=()):
    yield path, group
    for name, sub in getattr(group, "commands", {}).items():
        yield from _commands(sub, path + (name,))


def test_bracketed_words_in_option_help_survive_the_help_screen():
    root = get_command(app)
    checked = 0
    for path, cmd in _commands(root):
        wanted = [w.replace("\\", "") for p in cmd.params for w in re.findall(r"\S*\[[A-Za-z][\w-]*\]", p.help or "")]
        if not wanted:
            continue
        out = CliRunner().invoke(root, [*path, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"}).output
        flat = " ".join(out.replace("│", " ").split())
        for word in wanted:
            assert word in flat, (path, word)
            checked += 1
    assert checked >= 3  # --ray and both exports' --check name an extra
