"""Exports of stored KV to inference engines' own formats, registered by name in one place.

* ``lmcache``: LMCache ``fs`` remote-storage files (FSConnector) + manifest.json, for vLLM.
* ``llama-cpp``: a llama.cpp sequence-state file (``llama_state_seq_load_file``) + sidecar JSON.

See docs/engines.md for how each engine is configured to read them.
"""

from __future__ import annotations

from .llamacpp import export_llamacpp
from .lmcache import export_lmcache

EXPORTERS = {
    "lmcache": export_lmcache,
    "llama-cpp": export_llamacpp,
}

__all__ = ["EXPORTERS", "export_lmcache", "export_llamacpp"]
