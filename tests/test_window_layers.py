"""Sliding-window layers stored by their window (``--option window_layers=window``): each window
layer keeps the document's last W tokens and nothing else, the bundle says ``stored: window``,
the bytes go down by what was dropped, and the next-token logits after loading equal
transformers' own forward over the same tokens, through kdnctl's attention and through the
model's own sliding-window cache. Tiny random models (tests/test_models.py's builder); the
document is longer than every window."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from test_models import DOC, SUFFIX, TOL, own_forward_logits
from test_models import built as models  # noqa: F401 (the matrix's module-scoped model builder)

from kdnctl.models.cache_args import cache_arg

WINDOWED = ["mistral", "gemma2", "gemma3"]


def _windowed(name, models, tmp_path, *args):
    from kdnctl.models.load import use_loaded_models

    path, mlm = models(name)
    store = tmp_path / "s"
    with use_loaded_models(mlm):
        run_cli("ingest", DOC, "--model", path, store=store, check=True)
        proc = run_cli("compress", DOC.name, *args, "--option", "window_layers=window", "--label", "win",
                       "--model", path, store=store)
    return path, mlm, store, proc


@pytest.mark.parametrize("name", WINDOWED)
def test_window_layers_store_their_window_and_load_as_the_model_computes(name, models, tmp_path):
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.engine.window_cache import model_cache
    from kdnctl.presses.window_layers import window_sizes
    from kdnctl.store import Store, read_bundle_meta

    path, mlm, store, proc = _windowed(name, models, tmp_path, "--keep", "1")
    assert proc.returncode == 0, proc.stderr
    with Store(store, create=False) as st:
        full, win = st.get_version(DOC.name, "full"), st.get_version(DOC.name, "win")
        meta = read_bundle_meta(st, win.chunks[0].object)["model"]
        windows = window_sizes(meta)
        assert windows and all(meta["attention"][i]["stored"] == "window" for i in windows)
        assert all(a.get("stored") in (None, "whole") for i, a in enumerate(meta["attention"]) if i not in windows)
        ctx = load_document(mlm, st, DOC.name, label="win")
        n = ctx.n_tokens
        assert all(n > 2 * w for w in windows.values())
        # a window layer holds the last W tokens, a full layer every token
        for i, k in enumerate(ctx.keys):
            assert k.shape[2] == (windows[i] if i in windows else n), (i, k.shape)
            if i in windows:
                assert torch.equal(ctx.positions[i], torch.arange(n - windows[i], n))
        # the stored bytes go down by the dropped tokens' K/V (a few bytes of positions aside)
        n_layers = len(ctx.keys)
        kept = sum(k.shape[2] for k in ctx.keys) / (n_layers * n)
        assert win.nbytes < full.nbytes
        assert abs(win.nbytes / full.nbytes - kept) < 0.05, (win.nbytes / full.nbytes, kept)
        suffix = mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids
        want = own_forward_logits(mlm, ctx.token_ids + suffix)
        got, _ = forward_suffix(mlm, ctx, suffix, last_only=True)
        assert (got[-1] - want).abs().max().item() < TOL
        # the model's own forward over its own cache types, filled from the window version
        cache = model_cache(mlm, ctx)
        with torch.inference_mode():
            out = mlm.model(input_ids=torch.tensor([suffix]), **cache_arg(mlm.model, cache), use_cache=True,
                            cache_position=torch.arange(n, n + len(suffix)))
        assert (out.logits[0, -1].float() - want).abs().max().item() < TOL


def test_window_layers_with_a_press_keep_the_window_and_the_presss_picks(models, tmp_path):
    from kdnctl.engine.hf import load_document
    from kdnctl.presses.window_layers import window_sizes
    from kdnctl.store import Store, read_bundle_meta

    _, mlm, store, proc = _windowed("gemma3", models, tmp_path, "--keep", "0.5")
    assert proc.returncode == 0, proc.stderr
    with Store(store, create=False) as st:
        win = st.get_version(DOC.name, "win")
        windows = window_sizes(read_bundle_meta(st, win.chunks[0].object)["model"])
        ctx = load_document(mlm, st, DOC.name, label="win")
    n = ctx.n_tokens
    for i, k in enumerate(ctx.keys):
        if i in windows:  # the window, whatever the press picked
            assert k.shape[2] == windows[i] and torch.equal(ctx.positions[i], torch.arange(n - windows[i], n))
        else:  # the press's half
            assert 0.4 * n < k.shape[2] < 0.6 * n, (i, k.shape, n)


def test_window_layers_under_the_default_budget(models, tmp_path):
    """``--budget 0.25`` (ec, every token kept): each window layer codes only its last W tokens,
    and the bytes that frees go to the rest: nearer to the full version than stored whole."""
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.models.load import use_loaded_models
    from kdnctl.presses.window_layers import window_sizes
    from kdnctl.store import Store, read_bundle_meta

    path, mlm, store, proc = _windowed("gemma3", models, tmp_path, "--budget", "0.25")
    assert proc.returncode == 0, proc.stderr
    with use_loaded_models(mlm):
        run_cli("compress", DOC.name, "--budget", "0.25", "--label", "whole", "--model", path, store=store, check=True)
    suffix = mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids
    with Store(store, create=False) as st:
        windows = window_sizes(read_bundle_meta(st, st.get_version(DOC.name, "win").chunks[0].object)["model"])
        nexts = {}
        for label in ("full", "whole", "win"):
            ctx = load_document(mlm, st, DOC.name, label=label)
            nexts[label] = torch.softmax(forward_suffix(mlm, ctx, suffix, last_only=True)[0][-1], -1)
            if label == "win":
                n = ctx.n_tokens
                assert [k.shape[2] for k in ctx.keys] == [windows.get(i, n) for i in range(len(ctx.keys))]
        assert st.get_version(DOC.name, "win").nbytes <= 0.25 * 2 * sum(
            k.numel() for k in load_document(mlm, st, DOC.name).keys) * 2
    tv = {x: 0.5 * (nexts[x] - nexts["full"]).abs().sum().item() for x in ("whole", "win")}
    assert tv["win"] <= tv["whole"] and tv["win"] < 0.05, tv


def test_window_layers_with_another_budgeted_layout_are_refused_in_one_line(models, tmp_path):
    *_, proc = _windowed("mistral", models, tmp_path, "--budget", "0.25", "--quant", "int4")
    assert proc.returncode == 2, proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert "window_layers" in first and "int4" in first
