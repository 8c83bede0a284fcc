"""A load whose ec decode runs behind the question's forward (``load_document(..., overlap=True)``,
kdnctl/engine/overlap.py): the same K/V and logits as a load that decodes first, a decode error
raised in the forward (no hang, no answer), and the layer groups the decode reports."""

from __future__ import annotations

import pytest
import torch

from kdnctl.errors import BundleFormatError
from kdnctl.engine.overlap import LayersReady, layer_groups
from kdnctl.quant import ec_batch

pytestmark = pytest.mark.skipif(not ec_batch.enabled(), reason="numba or ISA-L missing: loads take the reference path")


@pytest.mark.parametrize("n_layers,n_groups", [(30, 6), (1, 6), (7, 3), (5, 5), (4, 6)])
def test_layer_groups_cover_every_layer_once_in_order(n_layers, n_groups):
    groups = layer_groups(n_layers, n_groups)
    assert [i for g in groups for i in g] == list(range(n_layers))
    assert len(groups) == min(n_groups, n_layers) and max(map(len, groups)) - min(map(len, groups)) <= 1


@pytest.mark.parametrize("own", [False, True])
def test_grouped_decode_writes_what_one_pass_writes_and_reports_each_group_once(own):
    """``own``: each layer with positions of its own, each layer's role with levels of its own
    (the tables a chunk's layer groups share are sliced per group)."""
    from test_ec_batch import _chunk, _fast, _reference

    h, d, n_layers = 3, 16, 5
    chunks = [_chunk(31 + j, h, 40 + 3 * j, d, n_layers, start=50 * j, own_positions=own, own_levels=own)
              for j in range(3)]
    want = _fast(chunks, n_layers, h, d)
    assert all(torch.equal(a, b) for a, b in zip(want, _reference(chunks, n_layers, h, d)))
    total = sum(c.layer_len(0) for c in chunks)
    out = tuple(torch.full((n_layers, h, total, d), float("nan")) for _ in range(2))
    starts = [sum(c.layer_len(0) for c in chunks[:i]) for i in range(len(chunks))]
    seen = []
    groups = layer_groups(n_layers, 3)
    ec_batch.decode_into(out, chunks, starts, chunks[0].meta["quant"], groups=groups, on_group=seen.append)
    assert sorted(seen) == list(range(len(groups)))
    assert all(torch.equal(a, b) for a, b in zip(out, want))


def test_a_failed_decode_reaches_every_waiter():
    ready = LayersReady(layer_groups(6, 3))

    def decode(r):
        r.done(0)
        raise BundleFormatError("layers.3.keys.codes has an unknown code width")

    ready.start(decode)
    with pytest.raises(BundleFormatError):
        ready.wait(5)
    with pytest.raises(BundleFormatError):
        ready.wait_all()


def _held_decode(chunks, n_layers, n_groups):
    """A grouped decode whose background thread holds off until released, so that whatever is
    written before then was written by the waiting thread itself."""
    import threading

    h, d = chunks[0].meta["quant"]["n_heads"], chunks[0].meta["quant"]["head_dim"]
    total = sum(c.layer_len(0) for c in chunks)
    out = tuple(torch.full((n_layers, h, total, d), float("nan")) for _ in range(2))
    starts = [sum(c.layer_len(0) for c in chunks[:i]) for i in range(len(chunks))]
    ready = LayersReady(layer_groups(n_layers, n_groups))
    reported = []

    def done(g):
        reported.append(g)
        ready.done(g)

    job = ec_batch.GroupedDecode(out, chunks, starts, chunks[0].meta["quant"], groups=ready.groups, on_group=done)
    release, started = threading.Event(), threading.Event()

    def background(r):
        release.wait(5)  # (a waiter that does not help is stuck until then: the asserts below fail, no hang)
        started.set()
        job.run(workers=1)

    ready.start(background, helper=job.help)
    return ready, out, release, reported, started


def test_a_waiting_thread_decodes_its_group_itself():
    from test_ec_batch import _chunk, _fast

    h, d, n_layers = 3, 16, 6
    chunks = [_chunk(41 + j, h, 33 + 5 * j, d, n_layers, start=40 * j) for j in range(3)]
    want = _fast(chunks, n_layers, h, d)
    ready, out, release, reported, started = _held_decode(chunks, n_layers, 3)
    ready.wait(2)  # layer 2: group 1 (layers 2-3), with the background thread held
    assert not started.is_set() and sorted(reported) == [0, 1]
    for o, w in zip(out, want):
        assert torch.equal(o[:4], w[:4])  # groups 0 and 1, written by this thread
        assert o[4:].isnan().all()  # a later group's jobs are left to the background
    release.set()
    ready.wait_all()
    assert sorted(reported) == [0, 1, 2]  # every group reported once, whichever thread finished it
    assert all(torch.equal(o, w) for o, w in zip(out, want))


def test_a_corrupt_frame_met_by_the_waiting_thread_reaches_every_waiter():
    from test_ec_batch import _chunk

    h, d, n_layers = 3, 16, 4
    chunks = [_chunk(51 + j, h, 20, d, n_layers, start=20 * j) for j in range(2)]
    blob = chunks[1].tensors["layers.0.values.codes"].clone()
    blob[1] = 0  # no frames: its bins need some
    chunks[1].tensors["layers.0.values.codes"] = blob
    ready, out, release, _, started = _held_decode(chunks, n_layers, 2)
    with pytest.raises(BundleFormatError, match="layers.0.values"):
        ready.wait(0)
    assert not started.is_set()  # met by this thread's own decode
    release.set()
    with pytest.raises(BundleFormatError, match="layers.0.values"):
        ready.wait(3)
    with pytest.raises(BundleFormatError):
        ready.wait_all()
    assert all(o[2:].isnan().all() for o in out)  # the failed load's later group: no thread decoded it


@pytest.mark.parametrize("cores,threads,inside", [(2, 2, 1), (8, 8, 7), (8, 2, 2), (1, 1, 1)])
def test_the_forward_leaves_the_decode_a_core_while_it_runs(monkeypatch, cores, threads, inside):
    """Around the forward, while the decode runs, torch runs on the cores the decode thread leaves
    (a forward that already leaves one is not touched); the threads come back at the first wait
    after the decode is done, or when the block ends, whatever it raised."""
    import threading

    from kdnctl.engine import overlap

    monkeypatch.setattr(overlap, "usable_cores", lambda: cores)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ready = LayersReady(layer_groups(4, 2))
        release = threading.Event()

        def decode(r):
            r.done(0)
            release.wait(5)
            r.done(1)

        ready.start(decode)
        with ready.sharing_cores():
            assert torch.get_num_threads() == inside
            ready.wait(0)  # group 0 written, group 1 not: still shared
            assert torch.get_num_threads() == inside
            release.set()
            ready.wait(3)
            assert torch.get_num_threads() == threads  # taken back inside the forward
        assert torch.get_num_threads() == threads
        failed, hold = LayersReady(layer_groups(4, 2)), threading.Event()
        failed.start(lambda r: hold.wait(5))
        with pytest.raises(RuntimeError, match="stopped"), failed.sharing_cores():
            assert torch.get_num_threads() == inside
            raise RuntimeError("forward stopped")
        assert torch.get_num_threads() == threads
        hold.set()
        failed.join()
        with failed.sharing_cores():  # a decode that is done shares nothing
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_forwards_that_share_at_once_restore_the_threads_when_the_last_is_done(monkeypatch):
    """Two forwards over two decodes (threads of one process asking at once): the first lowers
    torch's threads, the second finds them lowered and changes nothing, and they come back to what
    the first found only when both are done, in either order."""
    import threading

    from kdnctl.engine import overlap

    monkeypatch.setattr(overlap, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for first_done in (0, 1):
            holds = [threading.Event(), threading.Event()]
            ready = [LayersReady(layer_groups(2, 2)) for _ in holds]
            for r, hold in zip(ready, holds):
                r.start(lambda _r, hold=hold: hold.wait(5))
            with ready[0].sharing_cores():
                with ready[1].sharing_cores():
                    assert torch.get_num_threads() == 1
                    holds[first_done].set()
                    ready[first_done].join()
                    ready[first_done].wait(1)  # that forward's decode is done: it gives its share back
                    assert torch.get_num_threads() == 1  # the other still shares
                    holds[1 - first_done].set()
                    ready[1 - first_done].join()
                assert torch.get_num_threads() == (2 if first_done == 0 else 1)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def store(lm, tmp_path_factory):
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document

    st = trimmed_store(tmp_path_factory, lm, {"faq.md": 300})
    with st.writer():
        compress_document(st, "faq.md", CompressRecipe(budget=0.25), lm=lm)
    return st


@pytest.mark.model
def test_an_overlapped_load_answers_as_a_load_that_decodes_first(lm, store):
    from kdnctl.engine.hf import forward_suffix, generate, load_document

    question = lm.tokenizer("How long does charging take?", add_special_tokens=False).input_ids
    with torch.inference_mode():
        first = load_document(lm, store, "faq.md", "b0.25")
        assert first.pending is None
        want = forward_suffix(lm, first, question, last_only=True)[0]
        ctx = load_document(lm, store, "faq.md", "b0.25", overlap=True)
        assert ctx.pending is not None  # the decode runs behind the forward
        got = forward_suffix(lm, ctx, question, last_only=True)[0]
        ctx.settle()
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(ctx.keys + ctx.values, first.keys + first.values))
        again = load_document(lm, store, "faq.md", "b0.25", overlap=True)
        res = generate(lm, again, question, max_new_tokens=4)
        assert again.pending is None and torch.equal(res.first_logits, want[-1])
        # a second cache over the same context (copies the settled buffers)
        assert torch.equal(forward_suffix(lm, again, question, last_only=True)[0], want)


@pytest.mark.model
def test_a_corrupt_frame_found_behind_the_forward_raises_in_it(lm, store):
    from kdnctl.engine.hf import context_from_bundles, forward_suffix
    from kdnctl.format.bundle import decode_bundle

    bundles = [decode_bundle(store.read_object(c.object)) for c in store.get_version("faq.md", "b0.25").chunks]
    last = bundles[0].n_layers - 1
    blob = bundles[1].tensors[f"layers.{last}.values.codes"].clone()
    blob[1] = 0  # no frames: its bins need some
    bundles[1].tensors[f"layers.{last}.values.codes"] = blob
    question = lm.tokenizer("How long does charging take?", add_special_tokens=False).input_ids
    with torch.inference_mode():
        ctx = context_from_bundles(lm, bundles, overlap=True)
        assert ctx.pending is not None
        with pytest.raises(BundleFormatError, match=f"layers.{last}.values"):
            forward_suffix(lm, ctx, question, last_only=True)
        with pytest.raises(BundleFormatError):
            ctx.settle()


@pytest.mark.model
def test_an_answered_overlapped_load_leaves_its_memory_to_the_next_load(lm, store):
    """Once a context loaded behind the forward has answered and is dropped, its pooled cache
    memory is free for the next load at once: nothing of the finished decode refers to it (no
    cycle for the garbage collector's next full pass to find first)."""
    import gc

    from kdnctl.engine.hf import generate, load_document
    from kdnctl.store.arena import POOL, _address

    question = lm.tokenizer("How long does charging take?", add_special_tokens=False).input_ids
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.inference_mode():
            ctx = load_document(lm, store, "faq.md", "b0.25", overlap=True)
            assert ctx.pending is not None
            arena = ctx.buffers[0][0].untyped_storage().data_ptr()
            generate(lm, ctx, question, max_new_tokens=2)
            del ctx
        states = POOL._states()
        mine = [ok for a, ok in states if a and _address(a) <= arena < _address(a) + len(a)]
        assert mine == [True]
    finally:
        if enabled:
            gc.enable()
