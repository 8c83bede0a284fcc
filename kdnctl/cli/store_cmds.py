"""`kdnctl ls | show | verify | gc`: inspect and maintain the store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .common import JsonOpt, ModelOpt, StoreOpt, emit_json, load_lm, message, open_store, store_root


def _version_dict(v, fp16_per_token: int | None = None) -> dict:
    d = {"label": v.label, "parent": v.parent, "chunks": len(v.chunks), "bytes": v.nbytes,
         "tokens": v.n_tokens, "mode": v.mode, "recipe": v.recipe}
    if fp16_per_token:
        d["bytes_per_token"] = round(v.nbytes / max(v.n_tokens, 1), 1)
        d["fraction_of_fp16"] = round(v.nbytes / (fp16_per_token * max(v.n_tokens, 1)), 4)
    return d


def _chunk_metas(st, v) -> list[dict]:
    from ..format.bundle import read_meta

    return [read_meta(st.read_object(c.object)) for c in v.chunks]


def _fp16_per_token(st, versions) -> int | None:
    """fp16 bytes of K and V per token (2 bytes x 2 x layers x KV heads x head dim)."""
    if not versions or not versions[0].chunks:
        return None
    from ..format.bundle import read_meta

    m = read_meta(st.read_object(versions[0].chunks[0].object))["model"]
    return 4 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"]


def _tier_mix(metas: list[dict]) -> dict | None:
    """Rows per precision tier over a version's chunks (keys and values apart), if laddered."""
    total: dict[str, dict[str, int]] = {}
    for m in metas:
        for role, counts in ((m.get("quant") or {}).get("mix") or {}).items():
            for tier, n in counts.items():
                total.setdefault(role, {})[tier] = total.get(role, {}).get(tier, 0) + n
    return total or None


def _mix_text(mix: dict) -> str:
    parts = []
    for role, counts in mix.items():
        n = sum(counts.values()) or 1
        parts.append(f"{role[0].upper()}: " + " ".join(f"{t} {c / n:.0%}" for t, c in counts.items()))
    return "; ".join(parts)


def ls(store: Optional[Path] = StoreOpt, as_json: bool = JsonOpt) -> None:
    """List documents, their versions, chunks and sizes."""
    st = open_store(store)
    docs = []
    # one pass over every version record (each key checked against its record): a damaged key
    # is an error here, not a document listed with fewer versions
    documents = st.list_documents()
    by_doc: dict[str, list] = {}
    for v in st.list_versions():
        by_doc.setdefault(v.doc_id, []).append(v)
    for d in documents:
        vs = by_doc.get(d.doc_id, [])
        per_token = _fp16_per_token(st, vs)
        versions = [_version_dict(v, per_token) for v in vs]
        docs.append({"id": d.doc_id, "doc_version": d.doc_version, "tokens": d.n_tokens, "source": d.source,
                     "fingerprint": d.fingerprint, "versions": versions})
    if as_json:
        emit_json({"documents": docs})
        return
    if not docs:
        message("store is empty; run `kdnctl ingest PATH`")
    for d in docs:
        print(f"{d['id']}  ({d['tokens']} tokens, version {d['doc_version']})")
        for v in d["versions"]:
            bpt = v["bytes"] / max(d["tokens"], 1)
            frac = f"  {v['fraction_of_fp16']:7.1%} of fp16" if "fraction_of_fp16" in v else ""
            print(f"    {v['label']:<28} {v['chunks']:>4} chunks  {v['bytes'] / 1e6:8.2f} MB  {bpt:9.0f} B/token{frac}")


def show(doc: str = typer.Argument(..., help="Document id."), version: Optional[str] = typer.Option(None, "--version", "-v"),
         store: Optional[Path] = StoreOpt, as_json: bool = JsonOpt) -> None:
    """Show one document, or one version of it with its chunks."""
    st = open_store(store)
    d = st.get_document(doc)
    data = {"id": d.doc_id, "doc_version": d.doc_version, "tokens": d.n_tokens, "source": d.source,
            "content_sha256": d.content_sha256, "fingerprint": d.fingerprint,
            "history": [h.doc_version for h in st.document_history(doc)],
            "versions": []}
    vs = st.list_versions(doc)
    per_token = _fp16_per_token(st, vs)
    data["versions"] = [_version_dict(v, per_token) for v in vs]
    if version:
        v = st.get_version(doc, version)
        data["version"] = _version_dict(v, per_token) | {"chunks": [c.__dict__ for c in v.chunks]}
        mix = _tier_mix(_chunk_metas(st, v))
        if mix:
            data["version"]["tier_mix"] = mix
    if as_json:
        emit_json(data)
        return
    for key, value in data.items():
        if key not in ("versions", "version"):
            print(f"{key}: {value}")
    for v in data["versions"]:
        frac = f" ({v['bytes_per_token']:.0f} B/token, {v['fraction_of_fp16']:.1%} of fp16)" if "fraction_of_fp16" in v else ""
        print(f"version {v['label']}: {v['chunks']} chunks, {v['bytes']} bytes{frac}, parent {v['parent']}")
    if version:  # the steps that made it: a version's name is short, its recipe is here
        for step in data["version"]["recipe"].get("steps", [data["version"]["recipe"]]):
            print("recipe: " + " ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in step.items() if v not in (None, {})))
    if version and data["version"].get("tier_mix"):
        print(f"tier mix (rows): {_mix_text(data['version']['tier_mix'])}")
    if version:
        for c in data["version"]["chunks"]:
            print(f"  chunk {c['index']}: tokens [{c['token_start']}, {c['token_end']}) object {c['object'][:16]} {c['nbytes']} B")


def verify(store: Optional[Path] = StoreOpt, as_json: bool = JsonOpt) -> None:
    """Check every catalog record, re-hash every object and check each chunk's bundle header
    against the record that points at it. Exit 1 on any problem."""
    st = open_store(store)
    rep = st.verify_report()
    problems = rep.problems
    if as_json:
        emit_json({"ok": not problems, "problems": problems, "info": rep.info, "records": rep.n_records,
                   "objects": rep.n_objects, "bytes": rep.n_bytes})
    else:
        for p in problems:
            message(f"problem: {p}")
        for line in rep.info:
            message(f"note: {line}")
        summary = f"{rep.n_records} catalog record(s), {rep.n_objects} object(s) checked"
        message(f"store OK ({summary})" if not problems else f"{len(problems)} problem(s) found ({summary})")
    if problems:
        sys.exit(1)


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'600', '30s', '10m', '2h', '1d' -> seconds."""
    from ..errors import UsageError

    t = text.strip().lower()
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise UsageError(f"--grace must be a duration like 30s, 10m, 2h or 0, got {text!r}")
    return value * _UNITS[unit]


def gc(store: Optional[Path] = StoreOpt, dry_run: bool = typer.Option(False, "--dry-run"),
       grace: str = typer.Option("10m", "--grace", help="Keep objects of versions superseded less than this long ago "
                                 "(readers may still be loading them), e.g. 30s, 10m, 2h; 0 = none."),
       release_held: bool = typer.Option(False, "--release-held", help="Also remove unreferenced objects that "
                                         "rebuild-catalog could not place (held until now)."),
       as_json: bool = JsonOpt) -> None:
    """Drop superseded document versions (after --grace), unreferenced objects and stale temp files.
    Refuses (deleting nothing) while the catalog is another store's or any record fails verify."""
    grace_s = parse_duration(grace)
    st = open_store(store)
    with st.writer():
        report = st.gc(dry_run=dry_run, grace_s=grace_s, release_held=release_held)
    if as_json:
        emit_json(report)
    else:
        message(" ".join(f"{k}={v}" for k, v in report.items()))


def rebuild_catalog(store: Optional[Path] = StoreOpt, model: Optional[str] = ModelOpt,
                    force: bool = typer.Option(False, "--force", help="Rebuild even if the catalog opens fine."),
                    as_json: bool = JsonOpt) -> None:
    """Rebuild a damaged catalog from the bundles' own metadata (the old catalog is kept aside)."""
    from ..ingest.rebuild import rebuild_catalog as rebuild

    root = store_root(store)
    lm = load_lm(model)
    report = rebuild(root, lm, force=force)
    if as_json:
        emit_json(report.as_dict())
    else:
        for line in report.skipped:
            message(f"not recovered: {line}")
        for line in report.dropped:
            message(f"dropped (held by the old catalog, not recovered): {line}")
        if report.held:
            message(f"{report.held} object(s) no rebuilt record uses are held: gc keeps them "
                    "(`kdnctl gc --release-held` lets it remove them)")
        message(f"rebuilt {len(report.documents)} document(s), {report.versions} version(s)"
                + (f"; damaged catalog kept at {report.damaged_catalog}" if report.damaged_catalog else "")
                + "; run `kdnctl verify`")


def register(app: typer.Typer) -> None:
    app.command("ls")(ls)
    app.command("show")(show)
    app.command("verify")(verify)
    app.command("gc")(gc)
    app.command("rebuild-catalog")(rebuild_catalog)
