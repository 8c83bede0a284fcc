"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel module is imported so
kernel tests can run the Triton path on CPU tensors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "corpus"

# Torch intra-op threads for the whole run, and through OMP_NUM_THREADS for every subprocess
# and Ray worker it starts: KDNCTL_TEST_THREADS (default 1; 0 = torch's own default). The suite
# is mostly small ops (decode steps, short prefills, per-layer statistics); on a shared 2-core
# machine a second spinning thread per process made them 3-5x slower, not faster
# (bench/threads.py; bench/quality.py runs on one thread for the same reason).
TEST_THREADS = int(os.environ.get("KDNCTL_TEST_THREADS", "1"))
if TEST_THREADS > 0:
    os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))


def pytest_configure(config):
    if TEST_THREADS > 0:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Models loaded once per session; in-process CLI runs get them through the library's
# injection point (kdnctl.models.load.use_loaded_models) instead of loading their own.
_SESSION_MODELS: list = []


def default_lm():
    """The real default model (SmolLM2-135M-Instruct), loaded once per test session."""
    from kdnctl.models.load import load_model

    if not _SESSION_MODELS:
        _SESSION_MODELS.append(load_model())
    return _SESSION_MODELS[0]


@pytest.fixture(scope="session")
def lm():
    return default_lm()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, lm):
    """A tiny randomly initialised Llama (same tokenizer) saved as a HF folder: a *different*
    model, for fingerprint-mismatch tests and fast plumbing checks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=lm.tokenizer.vocab_size if lm.tokenizer.vocab_size >= 49152 else 49152,
                      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    """The tiny random model of ``tiny_model_dir``, loaded once per session."""
    from kdnctl.models.load import load_model

    model = load_model(tiny_model_dir)
    _SESSION_MODELS.append(model)
    return model


def run_cli(*args, store=None, env=None, timeout=600, check=False, own_process=False):
    """Run the real `kdnctl` entry point (argument parsing, error table, exit codes) on ``args``;
    returns a CompletedProcess. In-process on the session's models by default; ``own_process``
    runs it as a subprocess (``python -m kdnctl.cli.app``), for tests where the process boundary
    is the point; ``own_process="fork"`` runs it in a forked child of this process: its own
    address space, so a crash (SIGBUS, SIGSEGV) is the child's exit status (negative, as
    subprocess reports it), without an interpreter start and its imports for every call."""
    argv = [*map(str, args)] + (["--store", str(store)] if store is not None else [])
    # KDNCTL_TEST_CLI=subprocess runs every CLI test in its own process (to compare timings)
    if os.environ.get("KDNCTL_TEST_CLI") == "subprocess":
        own_process = True
    if own_process == "fork":
        proc = _run_forked(argv, env, timeout)
    elif own_process:
        proc = _run_subprocess(argv, env, timeout)
    else:
        proc = _run_in_process(argv, env)
    if check and proc.returncode != 0:
        raise AssertionError(f"kdnctl {args} failed ({proc.returncode}): {proc.stderr}")
    return proc


def kdnctl_source_root() -> Path:
    """The directory holding the kdnctl package this test process imported."""
    import kdnctl

    return Path(kdnctl.__file__).resolve().parent.parent


def kdnctl_source_digest() -> str:
    """sha256 over this process's kdnctl source files (names and bytes)."""
    import hashlib

    root = kdnctl_source_root()
    h = hashlib.sha256()
    for path in sorted((root / "kdnctl").rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# The kdnctl source as this session found it: a comparison of bytes written by a child process
# with bytes written here means nothing if the checkout changed in between (a merge mid-run).
SOURCE_DIGEST_AT_START = kdnctl_source_digest()


def python_argv(*args) -> list[str]:
    """A Python command line that does not put its working directory first on sys.path (-P):
    with ``kdnctl_env`` it imports the same kdnctl as this process, not a tree that happens to
    sit in the working directory."""
    return [sys.executable, "-P", *map(str, args)]


def kdnctl_argv(*args) -> list[str]:
    """``python -m kdnctl.cli.app ARGS``, run on the same kdnctl code as this process."""
    return python_argv("-m", "kdnctl.cli.app", *args)


def kdnctl_env(env=None) -> dict:
    """os.environ plus ``env``, with PYTHONPATH leading to this process's kdnctl: a child
    started from another checkout's directory, or with the installed (editable) package first
    on its path, would otherwise run other code, and its bundles other bytes."""
    full = dict(os.environ)
    full.update(env or {})
    rest = full.get("PYTHONPATH")
    full["PYTHONPATH"] = str(kdnctl_source_root()) + (os.pathsep + rest if rest else "")
    return full


def _run_subprocess(argv, env, timeout):
    full_env = kdnctl_env(env)
    full_env.pop("KDNCTL_DEBUG", None)
    if env and "KDNCTL_DEBUG" in env:
        full_env["KDNCTL_DEBUG"] = env["KDNCTL_DEBUG"]
    return subprocess.run(kdnctl_argv(*argv), capture_output=True, text=True, env=full_env, timeout=timeout)


def _run_forked(argv, env, timeout):
    import tempfile
    import time

    from kdnctl.cli.app import app
    from kdnctl.cli.common import run_cli as entry
    from kdnctl.models.load import use_loaded_models

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 70
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                os.environ.pop("KDNCTL_DEBUG", None)
                os.environ.update(env or {})
                with use_loaded_models(*_SESSION_MODELS):
                    try:
                        entry(app, argv)
                        code = 0
                    except SystemExit as exc:
                        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 70
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(["kdnctl", *argv], timeout)
            time.sleep(0.005)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    return subprocess.CompletedProcess(["kdnctl", *argv], os.waitstatus_to_exitcode(status), stdout, stderr)


def _run_in_process(argv, env):
    from click.testing import CliRunner

    from kdnctl.cli.app import app
    from kdnctl.cli.common import run_cli as entry
    from kdnctl.models.load import use_loaded_models

    code = 0
    with CliRunner().isolation(env={"KDNCTL_DEBUG": None, **(env or {})}) as (out, err, _):
        with use_loaded_models(default_lm(), *_SESSION_MODELS):
            try:
                entry(app, argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return subprocess.CompletedProcess(["kdnctl", *argv], code, stdout, stderr)


def cli_json(*args, store=None, **kw):
    proc = run_cli(*args, "--json", store=store, check=True, **kw)
    return json.loads(proc.stdout)


def damage_object(root: Path, sha: str) -> None:
    """Flip the middle byte of object ``sha`` in the store at ``root`` (on disk, as rot would)."""
    path = Path(root) / "objects" / sha[:2] / sha
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
