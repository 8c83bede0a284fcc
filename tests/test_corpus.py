"""read_corpus on real files in tmp_path: ids, file types, skip reasons, hashes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kdnctl.ingest.corpus import Document, Skipped, html_to_text, read_corpus
from kdnctl.errors import InputError


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_bytes(data.encode("utf-8"))
    return path


def _by_id(docs: list[Document]) -> dict[str, Document]:
    return {d.doc_id: d for d in docs}


def _reasons(skipped: list[Skipped]) -> dict[str, str]:
    return {Path(s.path).name: s.reason for s in skipped}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "docs"
    _write(root / "manual.md", "# Manual\n\nInstall it.\n")
    _write(root / "sub" / "notes.txt", "notes here\n")
    _write(root / "sub" / "deeper" / "guide.rst", "Guide\n=====\n")
    _write(root / "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    _write(root / "data.csv", "a,b\n1,2\n")
    _write(root / ".git" / "config.txt", "hidden dir file\n")
    _write(root / ".kdn" / "objects" / "x.txt", "store file\n")
    _write(root / ".hidden.md", "hidden file\n")
    return root


def test_directory_ids_are_relative_posix_paths_in_sorted_order(tree: Path) -> None:
    docs, skipped = read_corpus([tree])
    assert [d.doc_id for d in docs] == ["manual.md", "sub/deeper/guide.rst", "sub/notes.txt"]
    assert _by_id(docs)["sub/notes.txt"].text == "notes here\n"
    assert _by_id(docs)["manual.md"].source == str(tree / "manual.md")
    # Unsupported types inside a directory are reported with exactly this reason.
    assert sorted((Path(s.path).name, s.reason) for s in skipped) == [
        ("data.csv", "unsupported type"),
        ("image.png", "unsupported type"),
    ]
    # Hidden files and dirs are neither read nor reported.
    assert not any(".git" in s.path or ".kdn" in s.path or ".hidden" in s.path for s in skipped)


def test_ids_do_not_depend_on_how_the_directory_is_spelled(tree: Path, monkeypatch) -> None:
    monkeypatch.chdir(tree)
    docs_dot, _ = read_corpus(["."])
    docs_abs, _ = read_corpus([str(tree) + "/"])
    assert [d.doc_id for d in docs_dot] == [d.doc_id for d in docs_abs]
    assert [d.content_sha256 for d in docs_dot] == [d.content_sha256 for d in docs_abs]


def test_explicit_file_uses_its_name_as_id(tree: Path) -> None:
    docs, skipped = read_corpus([tree / "sub" / "notes.txt"])
    assert [d.doc_id for d in docs] == ["notes.txt"]
    assert skipped == []


def test_explicit_unsupported_file_is_skipped_with_reason(tree: Path) -> None:
    docs, skipped = read_corpus([tree / "data.csv"])
    assert docs == []
    assert len(skipped) == 1
    assert skipped[0].reason.startswith("unsupported type '.csv'")
    assert ".txt" in skipped[0].reason  # tells the user what is supported


def test_explicit_hidden_file_is_read(tmp_path: Path) -> None:
    f = _write(tmp_path / ".notes.txt", "explicitly asked for\n")
    docs, _ = read_corpus([f])
    assert [d.doc_id for d in docs] == [".notes.txt"]


def test_missing_path_raises_input_error_naming_it(tmp_path: Path) -> None:
    good = _write(tmp_path / "a.txt", "x")
    missing = tmp_path / "nope" / "gone.md"
    with pytest.raises(InputError) as info:
        read_corpus([good, missing])
    assert str(missing) in info.value.message
    assert "\n" not in info.value.one_line()


def test_crlf_is_normalised_and_hash_is_of_extracted_text(tmp_path: Path) -> None:
    _write(tmp_path / "d" / "win.txt", b"line one\r\nline two\r\n")
    _write(tmp_path / "d" / "unix.txt", b"line one\nline two\n")
    docs = _by_id(read_corpus([tmp_path / "d"])[0])
    assert docs["win.txt"].text == "line one\nline two\n"
    assert docs["win.txt"].content_sha256 == docs["unix.txt"].content_sha256
    expected = hashlib.sha256("line one\nline two\n".encode("utf-8")).hexdigest()
    assert docs["win.txt"].content_sha256 == expected


def test_same_text_same_hash_different_text_different_hash(tmp_path: Path) -> None:
    a = _write(tmp_path / "a" / "x.md", "same words")
    b = _write(tmp_path / "b" / "x.md", "same words")
    c = _write(tmp_path / "c" / "x.md", "other words")
    (da,), _ = read_corpus([a])
    (db,), _ = read_corpus([b])
    (dc,), _ = read_corpus([c])
    assert da.content_sha256 == db.content_sha256
    assert da.content_sha256 != dc.content_sha256


def test_utf8_bom_is_dropped(tmp_path: Path) -> None:
    f = _write(tmp_path / "bom.txt", b"\xef\xbb\xbfhello")
    (doc,), _ = read_corpus([f])
    assert doc.text == "hello"


def test_empty_binary_and_non_utf8_files_are_skipped_with_reasons(tmp_path: Path) -> None:
    root = tmp_path / "in"
    _write(root / "empty.txt", b"")
    _write(root / "blank.md", b"  \n\t\r\n  ")
    _write(root / "nul.txt", b"plain text " * 100 + b"\x00" + b"more text " * 100)
    _write(root / "controls.txt", bytes(range(1, 9)) * 50 + b"some text")
    _write(root / "latin1.txt", "caf\u00e9 au lait".encode("latin-1"))
    _write(root / "ok.txt", "caf\u00e9 au lait")
    docs, skipped = read_corpus([root])
    assert [d.doc_id for d in docs] == ["ok.txt"]
    assert docs[0].text == "caf\u00e9 au lait"
    reasons = _reasons(skipped)
    assert reasons["empty.txt"] == "empty file"
    assert reasons["blank.md"] == "empty file"
    assert reasons["nul.txt"] == "binary file"
    assert reasons["controls.txt"] == "binary file"
    # "caf" is 3 bytes, so the latin-1 e-acute 0xe9 sits at offset 3.
    assert reasons["latin1.txt"] == "not valid UTF-8 (byte 0xe9 at offset 3)"


def test_text_with_tabs_and_form_feeds_is_not_binary(tmp_path: Path) -> None:
    f = _write(tmp_path / "tabs.txt", "col\tcol\tcol\n\fpage two\n" * 20)
    docs, skipped = read_corpus([f])
    assert len(docs) == 1 and skipped == []


HTML_PAGE = """<!DOCTYPE html>
<html><head><title>Page title</title>
<style>body { color: red; } .secret-style {}</style>
<script>var secretScript = "<p>not text</p>";</script>
</head>
<body>
<!-- secret comment -->
<h1>Fish &amp; Chips</h1>
<p>First   paragraph
   spans lines.</p>
<noscript>secret noscript</noscript>
<svg><text>secret svg</text></svg>
<template><p>secret template</p></template>
<ul><li>alpha</li><li>beta &lt;tag&gt;</li></ul>
<table><tr><th>Name</th><th>Price</th></tr><tr><td>Cod</td><td>&euro;5&nbsp;each</td></tr></table>
<p>line<br>break</p>
<script type="module">import("secret-module")</script>
<p>caf&eacute; &#8212; done</p>
</body></html>
"""


def test_html_keeps_visible_text_only(tmp_path: Path) -> None:
    f = _write(tmp_path / "page.html", HTML_PAGE)
    (doc,), skipped = read_corpus([f])
    assert skipped == []
    text = doc.text
    assert "secret" not in text
    assert "Page title" not in text
    assert "color" not in text
    assert "<p>" not in text
    assert "Fish & Chips" in text  # entity unescaped
    assert "First paragraph spans lines." in text  # whitespace collapsed
    assert "beta <tag>" in text
    lines = text.split("\n")
    # Table cells and list items each end up on their own line.
    for cell in ("Name", "Price", "Cod", "\u20ac5 each", "alpha", "beta <tag>"):
        assert cell in lines, cell
    assert "line\nbreak" in text
    assert "caf\u00e9 \u2014 done" in text
    assert doc.content_sha256 == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_html_paragraphs_are_separated_and_runs_of_spaces_collapsed() -> None:
    text = html_to_text("<p>one   two</p><p>  three\tfour </p><div>five</div>six")
    assert text == "one two\n\nthree four\n\nfive\nsix"


def test_html_without_closing_head_keeps_body(tmp_path: Path) -> None:
    text = html_to_text("<html><head><title>t</title><body><p>body text</p></body>")
    assert text == "body text"


def test_html_preformatted_text_keeps_its_layout() -> None:
    text = html_to_text("<p>code:</p><pre>def f():\n    return 1</pre>")
    assert text == "code:\n\ndef f():\n    return 1"
    # The newline right after <pre> is not content (as in a browser).
    assert html_to_text("<pre>\n  x\n</pre><p>after</p>") == "  x\n\nafter"


def test_html_without_visible_text_is_skipped(tmp_path: Path) -> None:
    f = _write(tmp_path / "blank.htm", "<html><head><script>x()</script></head><body> </body></html>")
    docs, skipped = read_corpus([f])
    assert docs == []
    assert skipped[0].reason == "no visible text"


def test_jsonl_good_bad_and_duplicate_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"id": "a", "text": "alpha text"}),
        "{not json",
        json.dumps({"id": "b", "text": "beta\r\ntext", "extra": 1}),
        json.dumps({"id": 7, "text": "numeric id"}),
        json.dumps({"id": "c"}),
        json.dumps(["id", "text"]),
        "",
        json.dumps({"id": "a", "text": "duplicate of a"}),
        json.dumps({"id": "d", "text": "   "}),
        json.dumps({"id": "e", "text": "last"}),
    ]
    f = _write(tmp_path / "records.jsonl", "\n".join(lines) + "\n")
    docs, skipped = read_corpus([f])
    assert [d.doc_id for d in docs] == ["a", "b", "e"]
    assert _by_id(docs)["a"].text == "alpha text"
    assert _by_id(docs)["b"].text == "beta\ntext"
    assert _by_id(docs)["a"].source == f"{f}:1"
    bad = {s.path: s.reason for s in skipped}
    assert set(bad) == {f"{f}:{n}" for n in (2, 4, 5, 6, 8, 9)}  # blank line 7 is not a record
    assert bad[f"{f}:2"].startswith("line 2: invalid JSON")
    assert "'id'" in bad[f"{f}:4"]
    assert "'text'" in bad[f"{f}:5"]
    assert bad[f"{f}:8"].startswith("duplicate document id 'a'")
    assert bad[f"{f}:9"] == "line 9: empty text"


def test_jsonl_bad_utf8_line_costs_only_that_line(tmp_path: Path) -> None:
    first = json.dumps({"id": "x", "text": "fine"}).encode() + b"\n"
    second = b'{"id": "y", "text": "caf\xe9"}\n'
    third = json.dumps({"id": "z", "text": "also fine"}).encode() + b"\n"
    f = _write(tmp_path / "mixed.jsonl", first + second + third)
    docs, skipped = read_corpus([f])
    assert [d.doc_id for d in docs] == ["x", "z"]
    assert len(skipped) == 1
    offset = len(first) + second.index(b"\xe9")
    assert skipped[0].path == f"{f}:2"
    assert skipped[0].reason == f"line 2: not valid UTF-8 (byte 0xe9 at offset {offset})"


def test_jsonl_inside_directory_uses_line_ids(tmp_path: Path) -> None:
    root = tmp_path / "c"
    _write(root / "sub" / "batch.jsonl", json.dumps({"id": "doc-1", "text": "one"}) + "\n")
    _write(root / "doc-1", "no extension, unsupported")
    docs, skipped = read_corpus([root])
    assert [d.doc_id for d in docs] == ["doc-1"]
    assert [s.reason for s in skipped] == ["unsupported type"]


def test_same_id_from_two_paths_keeps_the_first(tmp_path: Path) -> None:
    a = _write(tmp_path / "one" / "readme.md", "first")
    _write(tmp_path / "two" / "readme.md", "second")
    _write(tmp_path / "two" / "other.md", "other")
    docs, skipped = read_corpus([tmp_path / "one", tmp_path / "two"])
    assert [d.doc_id for d in docs] == ["readme.md", "other.md"]
    assert _by_id(docs)["readme.md"].text == "first"
    assert len(skipped) == 1
    assert skipped[0].path == str(tmp_path / "two" / "readme.md")
    assert skipped[0].reason.startswith("duplicate document id 'readme.md'")
    assert str(a) in skipped[0].reason


def test_jsonl_id_colliding_with_a_file_id_is_a_duplicate(tmp_path: Path) -> None:
    _write(tmp_path / "d" / "notes.txt", "from file")
    rec = _write(tmp_path / "r.jsonl", json.dumps({"id": "notes.txt", "text": "from jsonl"}))
    docs, skipped = read_corpus([tmp_path / "d", rec])
    assert [d.text for d in docs] == ["from file"]
    assert skipped[0].reason.startswith("duplicate document id")


def test_uppercase_extensions_are_supported(tmp_path: Path) -> None:
    _write(tmp_path / "d" / "README.TXT", "upper")
    _write(tmp_path / "d" / "Page.HTML", "<p>upper html</p>")
    docs, skipped = read_corpus([tmp_path / "d"])
    assert {d.doc_id: d.text for d in docs} == {"Page.HTML": "upper html", "README.TXT": "upper"}
    assert skipped == []


def test_symlinked_directories_are_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "d"
    _write(root / "a.txt", "a")
    (root / "loop").symlink_to(root, target_is_directory=True)
    docs, _ = read_corpus([root])
    assert [d.doc_id for d in docs] == ["a.txt"]


def test_dangling_symlink_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "d"
    _write(root / "a.txt", "a")
    (root / "gone.txt").symlink_to(tmp_path / "missing.txt")
    docs, skipped = read_corpus([root])
    assert [d.doc_id for d in docs] == ["a.txt"]
    assert [s.reason for s in skipped] == ["not a regular file"]
