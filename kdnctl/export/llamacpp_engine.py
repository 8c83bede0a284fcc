"""llama.cpp (through llama-cpp-python) as an engine for exported sequence states: open a GGUF
with the KV settings an export was made for, load a state file with llama.cpp's own
``llama_state_seq_load_file``, prefill, decode at explicit positions, generate greedily.

Used by ``kdnctl export llama-cpp --check``, tests/test_export_llamacpp.py and
bench/engines.py. Needs ``pip install 'kdnctl[llamacpp]'``.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ExportError
from .base import require_engine


@dataclass
class LlamaCppAnswer:
    token_ids: list[int]
    first_logits: np.ndarray
    ttft_s: float


class LlamaCppRunner:
    """One llama.cpp context on sequence 0. ``kv_type``: f16 | q8_0 (K and V);
    ``flash_attn`` None = off for f16, on for q8_0 (what the export assumes by default);
    ``n_threads`` None = 1 (a checker and benchmark harness, not a server)."""

    def __init__(self, gguf: str | Path, *, n_ctx: int = 4096, kv_type: str = "f16",
                 flash_attn: bool | None = None, n_threads: int | None = None, n_batch: int = 512):
        require_engine("llama_cpp", "llamacpp", "running llama.cpp")
        self.gguf = str(gguf)
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self.flash_attn = (kv_type != "f16") if flash_attn is None else bool(flash_attn)
        # one thread unless asked: ggml's workers spin at barriers, so on a shared, busy machine
        # two threads were measured far slower than one (a 600-token prefill: 24 s vs > 4 min)
        self.n_threads = n_threads or 1
        self.n_batch = n_batch
        self.llm = None

    def __enter__(self) -> "LlamaCppRunner":
        import llama_cpp

        types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
        self.llm = llama_cpp.Llama(
            model_path=self.gguf, n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_batch,
            n_threads=self.n_threads, n_threads_batch=self.n_threads, flash_attn=self.flash_attn,
            type_k=types[self.kv_type], type_v=types[self.kv_type], verbose=False, logits_all=False,
        )
        self.n_vocab = self.llm.n_vocab()
        return self

    def __exit__(self, *exc) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    # -- cache --------------------------------------------------------------------------
    def clear(self) -> None:
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm._ctx.ctx), True)

    def load_state(self, path: str | Path) -> int:
        """Load a sequence state file into sequence 0 with llama.cpp's own loader; returns the
        token count it records (the position where the next token goes)."""
        import llama_cpp

        self.clear()
        cap = self.n_ctx * 8
        tokens = (llama_cpp.llama_token * cap)()
        n = ctypes.c_size_t(0)
        read = llama_cpp.llama_state_seq_load_file(self.llm._ctx.ctx, str(path).encode(), 0, tokens, cap,
                                                   ctypes.byref(n))
        if read == 0:
            raise ExportError(f"llama.cpp refused the state file {path} (see its log above)")
        return int(n.value)

    def save_state(self, path: str | Path, tokens: list[int]) -> int:
        """llama.cpp's own ``llama_state_seq_save_file`` of sequence 0."""
        import llama_cpp

        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        return int(llama_cpp.llama_state_seq_save_file(self.llm._ctx.ctx, str(path).encode(), 0, arr, len(tokens)))

    def pos_range(self) -> tuple[int, int]:
        """(smallest, largest) position sequence 0 holds, as llama.cpp reports them."""
        import llama_cpp

        mem = llama_cpp.llama_get_memory(self.llm._ctx.ctx)
        return int(llama_cpp.llama_memory_seq_pos_min(mem, 0)), int(llama_cpp.llama_memory_seq_pos_max(mem, 0))

    # -- compute ------------------------------------------------------------------------
    def decode(self, tokens: list[int], n_past: int) -> np.ndarray:
        """Run ``tokens`` at positions n_past.. after what the cache holds; last logits."""
        batch = self.llm._batch
        for i in range(0, len(tokens), self.n_batch):
            part = tokens[i : i + self.n_batch]
            batch.set_batch(batch=part, n_past=n_past + i, logits_all=False)
            self.llm._ctx.decode(batch)
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def prefill(self, tokens: list[int]) -> np.ndarray:
        self.clear()
        return self.decode(tokens, 0)

    def generate(self, suffix: list[int], n_past: int, *, stop_ids: set[int], max_new_tokens: int = 40,
                 t0: float | None = None) -> LlamaCppAnswer:
        """Greedy answer after the cache: ``suffix`` at n_past.., then one token at a time."""
        t0 = time.perf_counter() if t0 is None else t0
        logits = self.decode(list(suffix), n_past)
        ttft = time.perf_counter() - t0
        first = logits
        pos = n_past + len(suffix)
        out: list[int] = []
        nxt = int(np.argmax(logits))
        while nxt not in stop_ids and len(out) < max_new_tokens:
            out.append(nxt)
            logits = self.decode([nxt], pos)
            pos += 1
            nxt = int(np.argmax(logits))
        return LlamaCppAnswer(out, first, ttft)
