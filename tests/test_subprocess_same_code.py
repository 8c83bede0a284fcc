"""Tests compare what a kdnctl child process writes with what this process writes (resume after
SIGKILL must equal a clean ingest to the byte), so a child must run the same kdnctl code as the
test process, whatever directory it starts in and whatever kdnctl is installed."""

from __future__ import annotations

import subprocess

from conftest import kdnctl_argv, kdnctl_env, kdnctl_source_root, python_argv


def _impostor(root):
    """Another kdnctl tree in the child's working directory (another checkout, an old build)."""
    pkg = root / "kdnctl"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("IMPOSTOR = True\n")
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "app.py").write_text("print('IMPOSTOR')\n")
    return root


def test_child_imports_this_process_kdnctl_from_another_checkout(tmp_path):
    cwd = _impostor(tmp_path)
    code = "import kdnctl; print(kdnctl.__file__)"
    out = subprocess.run(python_argv("-c", code), cwd=cwd, env=kdnctl_env(), capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == str(kdnctl_source_root() / "kdnctl" / "__init__.py")
    # the difference the helpers make: a plain child in that directory imports the other tree
    plain = subprocess.run([python_argv()[0], "-c", code], cwd=cwd, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert plain == str(cwd / "kdnctl" / "__init__.py")


def test_cli_child_runs_this_process_kdnctl(tmp_path):
    cwd = _impostor(tmp_path)
    proc = subprocess.run(kdnctl_argv("--help"), cwd=cwd, env=kdnctl_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "IMPOSTOR" not in proc.stdout and "ingest" in proc.stdout
