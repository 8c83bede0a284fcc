"""Scale-out on a real local Ray (one per module) with the real SmolLM2 model: the distributed
ingest builds the same catalog as a single process, survives a SIGKILLed worker, and a SIGKILLed
driver leaves a verifiable store that a re-run completes without redoing committed documents."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import EXAMPLES, REPO, cli_json, kdnctl_argv, kdnctl_env, run_cli

from kdnctl.compress.document import CompressRecipe, compress_document
from kdnctl.ingest.corpus import read_corpus
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.store import Store

pytestmark = pytest.mark.model
SDE = "1700000000"  # fixed bundle `created`: equal stores have equal object hashes
OPTS = IngestOptions(chunk_tokens=64)


@pytest.fixture(scope="module", autouse=True)
def fixed_epoch():
    old = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = SDE
    yield
    if old is None:
        os.environ.pop("SOURCE_DATE_EPOCH")
    else:
        os.environ["SOURCE_DATE_EPOCH"] = old


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray for the module (starting one costs ~6 s); CLI runs join it by address."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, lm):
    """Seven short documents (150-300 tokens, 3-5 chunks each) cut from the example corpus."""
    out = tmp_path_factory.mktemp("corpus")
    n = 0
    for f, path in enumerate(sorted(EXAMPLES.iterdir())):
        ids = lm.tokenizer(path.read_text(), add_special_tokens=False).input_ids
        for part in range(2 if f < 2 else 1):
            piece = ids[part * 400: part * 400 + 150 + 25 * n]
            (out / f"{path.stem}-{part}.txt").write_text(lm.tokenizer.decode(piece))
            n += 1
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, lm, corpus):
    """The single-process ingest the distributed runs must equal."""
    docs, _ = read_corpus([corpus])
    with Store(tmp_path_factory.mktemp("base")) as st:
        report = ingest_documents(st, lm, docs, OPTS)
        assert len(report.ingested) == len(docs) == 7
        yield {"dump": st.catalog_dump(), "objects": _objects(st), "root": st.root, "docs": docs}


def _objects(store: Store) -> set[str]:
    return {p.name for p in store.objects_dir.rglob("*") if p.is_file()}


def _check_equal(store: Store, baseline: dict) -> None:
    assert store.catalog_dump() == baseline["dump"]
    rep = store.verify_report()
    assert rep.problems == []
    assert _objects(store) == baseline["objects"]  # nothing lost, nothing extra


def test_ray_ingest_equals_single_process(tmp_path, ray_address, baseline):
    from kdnctl.distributed.ingest import ingest_on_ray

    used, progress = set(), []
    # the documented layout: catalog on local disk, objects/ and tmp/ on a shared filesystem
    shared, root = tmp_path / "shared", tmp_path / "s"
    for d in ("objects", "tmp"):
        (shared / d).mkdir(parents=True)
    root.mkdir()
    (root / "objects").symlink_to(shared / "objects")
    (root / "tmp").symlink_to(shared / "tmp")
    with Store(root) as st:
        report = ingest_on_ray(st, baseline["docs"], OPTS, address="local", workers=2, batch_size=3,
                               on_dispatch=lambda doc, i: used.add(i), on_progress=lambda n, tps: progress.append(tps))
        assert sorted(report.ingested) == sorted(d.doc_id for d in baseline["docs"])
        assert used == {0, 1} and len(progress) == 7 and progress[-1] > 0
        assert report.tokens == sum(v["n_tokens"] for v in baseline["dump"]["docs"].values())
        _check_equal(st, baseline)
    assert {p.name for p in shared.rglob("*") if p.is_file()} == baseline["objects"]


def test_worker_that_cannot_see_the_objects_fails_with_a_domain_error(tmp_path, ray_address):
    import ray

    from kdnctl.distributed.pool import start
    from kdnctl.distributed.workers import CompressWorker
    from kdnctl.errors import NotFoundError

    actor = ray.remote(num_cpus=1)(CompressWorker).remote(None, False, "cpu", str(tmp_path / "nowhere"),
                                                            str(tmp_path / "tmp"), {})
    with pytest.raises(NotFoundError, match="does not exist on this host") as err:
        start(ray, [actor])
    assert "mount" in err.value.hint  # the worker's own error, hint included, not "actor died"
    ray.kill(actor)


def test_worker_sigkilled_mid_document_is_retried(tmp_path, ray_address, baseline):
    from kdnctl.distributed.ingest import ingest_on_ray

    pids, killed, finished, finished_at_kill = [], [], [], []

    def kill(pid: int) -> None:
        finished_at_kill.append(len(finished))
        os.kill(pid, signal.SIGKILL)

    def kill_soon(doc_id: str, worker: int) -> None:
        if not killed:  # the first document handed out: its worker dies while prefilling it
            killed.append(pids[worker])
            threading.Timer(0.3, kill, (pids[worker],)).start()

    with Store(tmp_path / "s") as st:
        report = ingest_on_ray(st, baseline["docs"], OPTS, address="local", workers=2,
                               on_start=lambda infos: pids.extend(i["pid"] for i in infos), on_dispatch=kill_soon,
                               on_progress=lambda n, tps: finished.append(n))
        assert finished_at_kill == [0]  # killed while its documents were unfinished
        with pytest.raises(ProcessLookupError):
            os.kill(killed[0], 0)  # the worker really died
        assert sorted(report.ingested) == sorted(d.doc_id for d in baseline["docs"])  # no duplicates either
        _check_equal(st, baseline)


def test_driver_sigkilled_mid_job_then_rerun_completes(tmp_path, ray_address, corpus, baseline):
    root = tmp_path / "s"
    proc = subprocess.Popen(kdnctl_argv("ingest", corpus, "--store", root, "--chunk-tokens", "64", "--ray", ray_address,
                                        "--workers", "2", "--batch", "1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=kdnctl_env({"SOURCE_DATE_EPOCH": SDE}))
    committed: list[str] = []
    deadline = time.monotonic() + 300
    while not committed and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        if (root / "catalog" / "data.mdb").exists():
            with Store(root, create=False) as st:
                committed = [d.doc_id for d in st.list_documents()]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    with Store(root, create=False) as st:
        committed = sorted(d.doc_id for d in st.list_documents())
        assert st.verify() == []  # a killed driver leaves a consistent store
    assert 0 < len(committed) < len(baseline["docs"])
    # the re-run starts its own local Ray: the literal `--ray local --workers 2`
    rerun = cli_json("ingest", corpus, "--chunk-tokens", "64", "--ray", "local", "--workers", "2",
                     store=root, env={"SOURCE_DATE_EPOCH": SDE})
    assert sorted(rerun["unchanged"]) == committed  # committed documents were not redone
    assert sorted(rerun["ingested"] + rerun["unchanged"]) == sorted(d.doc_id for d in baseline["docs"])
    with Store(root, create=False) as st:
        assert st.catalog_dump() == baseline["dump"] and st.verify() == []
        st.gc()  # the killed job's uncommitted objects are orphans; gc removes them
        _check_equal(st, baseline)


def test_ray_compress_equals_single_process(tmp_path, ray_address, baseline):
    from kdnctl.distributed.compress import compress_on_ray

    recipe = CompressRecipe(budget=None, keep=0.5, method="snapkv", scorer="window", quant="int8")
    local, remote = tmp_path / "local", tmp_path / "remote"
    shutil.copytree(baseline["root"], local)
    shutil.copytree(baseline["root"], remote)
    doc_ids = sorted(d.doc_id for d in baseline["docs"])
    with Store(local) as st, st.writer():
        expected = [compress_document(st, d, recipe).bytes for d in doc_ids]
    with Store(local) as a, Store(remote) as b:
        results = compress_on_ray(b, doc_ids, recipe, address="local", workers=2, batch_size=2)
        assert [r.doc_id for r in results] == doc_ids and [r.bytes for r in results] == expected
        assert all(r.status == "compressed" for r in results)
        assert b.catalog_dump() == a.catalog_dump() and b.verify() == []
        assert _objects(a) == _objects(b)
        again = compress_on_ray(b, doc_ids, recipe, address="local", workers=1)
        assert {r.status for r in again} == {"unchanged"}


def test_ray_flag_without_ray_says_how_to_install(tmp_path, corpus):
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['kdnctl'] + sys.argv[1:]; "
            "from kdnctl.cli.app import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "ingest", str(corpus), "--store", str(tmp_path / "s"),
                           "--ray", "local"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 11, proc.stderr
    assert "pip install 'kdnctl[ray]'" in proc.stderr


def test_workers_without_ray_is_a_usage_error(tmp_path, corpus):
    proc = run_cli("ingest", corpus, "--workers", "2", store=tmp_path / "s")
    assert proc.returncode == 2 and "--workers needs --ray" in proc.stderr


def test_batched_commit_is_one_transaction(tmp_path):
    """The driver's batch commit (no Ray needed): all records or none; an object written
    through ObjectDir (as a worker writes it) is committable by the Store."""
    from kdnctl.store import ObjectDir
    from kdnctl.store.records import ChunkRef, DocumentRecord, VersionRecord

    with Store(tmp_path / "s") as st, st.writer():
        objects = ObjectDir(st.objects_dir, st.tmp_dir)
        text = objects.put_object(b"text")
        chunk = objects.put_object(b"chunk")

        def records(doc_id: str, obj: str):
            doc = DocumentRecord(doc_id, "v1", text, "src", 1, "fp", text, 0.0)  # its content hash names its text
            ver = VersionRecord(doc_id, "v1", "full", None, {"step": "ingest"}, "fp",
                                [ChunkRef(0, obj, 0, 1, "ab" * 32, 5)], 0.0, 1)
            return doc, ver

        with pytest.raises(Exception, match="missing"):
            st.commit_documents([records("a", chunk), records("b", "f" * 64)])
        assert st.list_documents() == []  # the good first record was not committed either
        st.commit_documents([records("a", chunk), records("b", chunk)])
        assert sorted(d.doc_id for d in st.list_documents()) == ["a", "b"]
        assert st.verify_report(check_bundles=False).problems == []
