"""``kdnctl compress --ray``: source versions are read and compressed by workers from the shared
object directory; the driver decides what to do (same recipe = no-op) and commits."""

from __future__ import annotations

from typing import Callable, Iterator

from ..compress.document import CompressRecipe, CompressResult, existing_result
from ..store import Store
from .cluster import connect, placement, shared_env
from .ingest import RETRIES
from .pool import drive, start
from .workers import CompressOutcome, CompressWorker


def compress_on_ray(
    store: Store,
    doc_ids: list[str],
    recipe: CompressRecipe,
    *,
    source: str = "full",
    label: str | None = None,
    address: str = "local",
    workers: int | None = None,
    model: str | None = None,
    batch_size: int = 16,
    batch_seconds: float = 5.0,
    retries: int = RETRIES,
    on_result: Callable[[CompressResult], None] | None = None,
) -> list[CompressResult]:
    """Compress ``doc_ids`` on Ray workers; results in the order of ``doc_ids``."""
    label = label or recipe.default_label()
    results: dict[str, CompressResult] = {}
    with connect(address, workers) as ray, store.writer():
        place, n = placement(ray, workers)
        actor_cls = ray.remote(max_restarts=retries, max_task_retries=retries, **place.options)(CompressWorker)
        args = (model, recipe.needs_model, place.device, str(store.objects_dir.resolve()),
                str(store.tmp_dir.resolve()), shared_env())
        actors = [actor_cls.remote(*args) for _ in range(n)]
        try:
            start(ray, actors)
            basis = basis_ref(ray, store, recipe, actors[0]) if recipe.needs_model else None
            profile = profile_ref(ray, store, recipe, actors[0]) if recipe.needs_model else None

            def tasks() -> Iterator[tuple[str, tuple]]:
                for doc_id in doc_ids:
                    done = existing_result(store, doc_id, recipe, source, label)
                    if done is not None:
                        results[doc_id] = done
                        if on_result:
                            on_result(done)
                        continue
                    yield doc_id, (store.get_version(doc_id, source), recipe, label, source, basis, profile)

            def commit(batch: list[CompressOutcome]) -> None:
                store.commit_versions([o.version for o in batch])
                for o in batch:
                    r = CompressResult(o.doc_id, label, "compressed", o.source_bytes, o.bytes, o.seconds,
                                       o.score_seconds)
                    results[o.doc_id] = r
                    if on_result:
                        on_result(r)

            drive(ray, actors, tasks(), lambda a, task: a.compress.remote(*task), commit,
                  batch_size=batch_size, batch_seconds=batch_seconds)
        finally:
            for a in actors:
                ray.kill(a)
    return [results[d] for d in doc_ids if d in results]


def basis_ref(ray, store: Store, recipe: CompressRecipe, actor):
    """The store's key basis for the workers' model (calibrated by ``actor`` first where the store
    has none), put once into Ray's object store; None where the workers find one themselves."""
    from kdnctl.quant.store_basis import basis_for_workers, wants_basis

    if not wants_basis(recipe):
        return None
    fingerprint = ray.get(actor.describe.remote())["fingerprint"]
    data = basis_for_workers(store, recipe, fingerprint, lambda texts: ray.get(actor.calibrate_basis.remote(texts)))
    return None if data is None else ray.put(data)


def profile_ref(ray, store: Store, recipe: CompressRecipe, actor):
    """The store's Fisher profile for the workers' model (measured by ``actor`` on the store's
    documents first where the store has none; kdnctl/compress/layer_profile.py), put once into
    Ray's object store; None where the recipe wants none or there is nothing to measure it on."""
    from kdnctl.compress.layer_profile import calibration_versions, wants_profile
    from kdnctl.store.profiles import commit_profile, profile_record

    if not wants_profile(recipe):
        return None
    fingerprint = ray.get(actor.describe.remote())["fingerprint"]
    rec = profile_record(store, fingerprint)
    if rec is not None:
        return ray.put(rec.data)
    data, source = ray.get(actor.measure_profile.remote(calibration_versions(store, fingerprint)))
    if data is None:
        return None
    commit_profile(store, fingerprint, data, source)
    return ray.put(data)
