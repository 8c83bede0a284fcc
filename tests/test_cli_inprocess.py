"""The CLI run in-process (how most tests run it) behaves like the real process, and the
library's injection point hands commands the already-loaded model."""

from __future__ import annotations

from conftest import run_cli

from kdnctl.models.load import load_model, use_loaded_models


def test_use_loaded_models_returns_the_loaded_model(tiny_lm, tiny_model_dir):
    with use_loaded_models(tiny_lm):
        assert load_model(tiny_model_dir) is tiny_lm
        assert load_model(str(tiny_model_dir) + "/") is tiny_lm  # same path, other spelling
        other = load_model(tiny_model_dir, dtype="bfloat16")  # another dtype: a real load
        assert other is not tiny_lm and str(other.dtype) == "torch.bfloat16"
        with use_loaded_models(other):  # nested: the inner block wins for its dtype
            assert load_model(tiny_model_dir, dtype="bfloat16") is other
            assert load_model(tiny_model_dir) is tiny_lm
    assert load_model(tiny_model_dir) is not tiny_lm  # outside the block: loads again


def test_in_process_matches_subprocess_exit_codes_and_streams(tmp_path):
    for args in (["compress", "--budget", "2"], ["ls"], ["edit", "--steer", "x", "--alpha", "0", "--heads", "1:0", "d"]):
        a = run_cli(*args, store=tmp_path / "none")
        b = run_cli(*args, store=tmp_path / "none", own_process=True)
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr), args
        assert a.returncode != 0 and a.stderr.startswith("error: ") and "Traceback" not in a.stderr
