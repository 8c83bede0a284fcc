"""Methods by name: presses, allocators (and whatever registers the same way) are dataclasses
whose fields are their options; ``build`` looks one up and converts option strings."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from kdnctl.errors import UsageError


def method_fields(cls: type) -> dict[str, Any]:
    """Option name -> default value, for option parsing and error hints."""
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = None
    return out


def coerce_option(kind: str, name: str, option: str, value: Any, default: Any) -> Any:
    """Option values from the command line arrive as strings; convert them to the type of
    the option's default so ``kernel_size=5`` works as well as ``kernel_size="5"``."""
    if not isinstance(value, str) or default is None or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise UsageError(
            f"{kind} '{name}': option {option}={value!r} is not a valid {type(default).__name__}"
        ) from None
    return value


def build(kind: str, registry: dict[str, type], name: str, opts: dict[str, Any]) -> Any:
    """An instance of ``registry[name]`` with ``opts``; unknown names or options -> UsageError
    naming the valid ones (``kind`` is "press", "allocator", ...)."""
    key = str(name).strip().lower()
    if key not in registry:
        raise UsageError(f"unknown {kind} {name!r}", hint=f"valid {kind}s: {', '.join(sorted(registry))}")
    cls = registry[key]
    defaults = method_fields(cls)
    unknown = sorted(set(opts) - set(defaults))
    if unknown:
        raise UsageError(
            f"{kind} '{key}' has no option {', '.join(unknown)}",
            hint=f"options of {key}: {', '.join(defaults) or 'none'}",
        )
    return cls(**{k: coerce_option(kind, key, k, v, defaults[k]) for k, v in opts.items()})
