"""Which (layer, query head) pairs a steering edit acts on.

``--heads`` takes one of:

* ``auto``            the profiled head config shipped for the loaded model: the file under
  ``recipes/heads/`` whose ``fingerprint`` equals the model's (``kdnctl steer profile`` writes
  them; ``recipes/heads/smollm2-135m.json`` for the default model);
* ``L:H,L:H,...``     explicit pairs; ``L:*`` = every query head of layer L; ``all`` = every head;
* a FILE (``.json`` or ``.toml``) with ``heads = [[L, H], ...]`` (or a table/object mapping a
  layer to a list of heads, or a string in the ``L:H,...`` form).

Returns ``{layer: sorted [heads]}``; every index is range-checked against the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError, UsageError

if TYPE_CHECKING:
    from ..models.load import LoadedModel

HEADS_DIR = Path(__file__).resolve().parents[2] / "recipes" / "heads"
FORMAT = "kdnctl-heads/1"


def _check(layer: int, head: int, n_layers: int, n_q_heads: int) -> None:
    if not 0 <= layer < n_layers:
        raise UsageError(f"heads: layer {layer} out of range (the model has {n_layers} layers)", param="heads")
    if not 0 <= head < n_q_heads:
        raise UsageError(f"heads: head {head} out of range (the model has {n_q_heads} query heads)", param="heads")


def _add(out: dict[int, set[int]], layer: int, head: int, n_layers: int, n_q_heads: int) -> None:
    _check(layer, head, n_layers, n_q_heads)
    out.setdefault(layer, set()).add(head)


def parse_pairs(text: str, n_layers: int, n_q_heads: int) -> dict[int, list[int]]:
    """``"12:0,12:3,20:*"`` -> {12: [0, 3], 20: [0..H-1]}; ``"all"`` -> every head."""
    out: dict[int, set[int]] = {}
    if text.strip() == "all":
        return {layer: list(range(n_q_heads)) for layer in range(n_layers)}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        layer_s, sep, head_s = item.partition(":")
        try:
            layer = int(layer_s)
            heads = list(range(n_q_heads)) if head_s.strip() == "*" else [int(head_s)]
        except ValueError:
            raise UsageError(f"heads: bad item {item!r}", hint="use L:H pairs, e.g. 12:0,12:3,20:*", param="heads") from None
        if not sep:
            raise UsageError(f"heads: bad item {item!r}", hint="use L:H pairs, e.g. 12:0,12:3,20:*", param="heads")
        for h in heads:
            _add(out, layer, h, n_layers, n_q_heads)
    if not out:
        raise UsageError("heads selects no head", param="heads")
    return {layer: sorted(hs) for layer, hs in sorted(out.items())}


def from_value(value: Any, n_layers: int, n_q_heads: int, where: str = "head config") -> dict[int, list[int]]:
    """Heads from the ``heads`` value of a config file (list of pairs, mapping or string)."""
    if isinstance(value, str):
        return parse_pairs(value, n_layers, n_q_heads)
    out: dict[int, set[int]] = {}
    try:
        if isinstance(value, dict):
            for layer, heads in value.items():
                for h in heads:
                    _add(out, int(layer), int(h), n_layers, n_q_heads)
        elif isinstance(value, list):
            for pair in value:
                layer, h = pair
                _add(out, int(layer), int(h), n_layers, n_q_heads)
        else:
            raise TypeError(type(value).__name__)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: 'heads' must be [[layer, head], ...] ({exc})") from None
    if not out:
        raise InputError(f"{where}: 'heads' is empty")
    return {layer: sorted(hs) for layer, hs in sorted(out.items())}


def read_config(path: Path) -> dict:
    if not path.is_file():
        raise InputError(f"head config {path} does not exist")
    try:
        if path.suffix == ".toml":
            import tomllib

            return tomllib.loads(path.read_text(encoding="utf-8"))
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"head config {path} cannot be parsed: {exc}") from None


def find_auto_config(fingerprint: str, directory: Path = HEADS_DIR) -> Path:
    """The shipped head config profiled on the model with this fingerprint."""
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("fingerprint") == fingerprint:
                return path
        except (ValueError, OSError):
            continue
    raise UsageError(
        f"no profiled head config for this model (fingerprint {fingerprint[:12]}) in {directory}",
        hint="run `kdnctl steer profile --out FILE` and pass --heads FILE, or give --heads L:H,...",
    )


def resolve_heads(spec: str, lm: LoadedModel) -> tuple[dict[int, list[int]], str]:
    """(heads, description) for a --heads value and a loaded model."""
    n_layers, n_q = lm.summary["n_layers"], lm.summary["n_q_heads"]
    spec = (spec or "auto").strip()
    if spec == "auto":
        path = find_auto_config(lm.fingerprint)
        return from_value(read_config(path).get("heads"), n_layers, n_q, str(path)), f"auto:{path.name}"
    path = Path(spec)
    if path.suffix in (".json", ".toml") or path.is_file():
        return from_value(read_config(path).get("heads"), n_layers, n_q, str(path)), f"file:{path.name}"
    return parse_pairs(spec, n_layers, n_q), spec


def heads_list(heads: dict[int, list[int]]) -> list[list[int]]:
    """JSON-able [[layer, head], ...] in order."""
    return [[layer, h] for layer in sorted(heads) for h in heads[layer]]
