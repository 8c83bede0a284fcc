"""What differs between decoder architectures, asked of the model's own config and modules.

transformers' modules are the source of truth: the decoder stack is ``model.base_model``'s
``layers``; each layer's attention module is the child that holds the projections; the sliding
window, the soft-cap and the scale of every layer are what the module itself passes to its
attention function (read once by a two-token probe forward, :meth:`ModelAdapter.layer_attention`);
RoPE's cos/sin per layer come from the model's own rotary module (per layer type where the model
has several, with its scaling and rotary fraction).

Projection layouts known here:

* ``separate``: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (Llama, Qwen, Mistral, Gemma, OLMo),
  with ``q_norm``/``k_norm`` applied before RoPE where the module has them;
* ``fused``: ``qkv_proj`` = [q | k | v] along the output features, ``o_proj`` (Phi-3);
* ``interleaved``: ``query_key_value`` = per head [q | k | v], ``dense`` (GPT-NeoX).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Iterator

import torch

from ..errors import UnsupportedError

FULL, SLIDING = "full", "sliding"
# model types whose layers are not (all) softmax attention over a KV cache
STATE_SPACE_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "rwkv",
    "recurrent_gemma", "lfm2", "granitemoehybrid", "nemotron_h", "qwen3_next", "minimax", "xlstm",
})
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention as the model computes it."""

    kind: str  # FULL or SLIDING
    window: int | None  # SLIDING: a query at position p sees keys at positions > p - window
    softcap: float | None  # logits -> softcap * tanh(logits / softcap) before the softmax
    scaling: float

    def as_meta(self) -> dict:
        # a sliding-window layer is stored whole: every token, the window applied at attention
        stored = {"stored": "whole"} if self.kind == SLIDING else {}
        return {"kind": self.kind, "window": self.window, "softcap": self.softcap, **stored}


def check_supported(config) -> None:
    """Refuse, in one line, a config whose model kdnctl cannot hold as a decoder KV cache."""
    name = (getattr(config, "architectures", None) or [getattr(config, "model_type", "?")])[0]
    mtype = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedError(f"{name} is an encoder-decoder model: kdnctl stores a decoder-only model's "
                               "self-attention KV, and cross-attention has no place in it",
                               hint="use a decoder-only causal LM")
    if mtype in STATE_SPACE_TYPES:
        raise UnsupportedError(f"{name} ({mtype}) has state-space or recurrent layers: their state is not a "
                               "per-token KV cache kdnctl can store", hint="use a decoder-only attention model")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        raise UnsupportedError(f"{name} has layers of type {', '.join(other)}: only full and sliding-window "
                               "attention layers have a KV cache kdnctl can store",
                               hint="use a decoder-only attention model")
    if any(hasattr(config, k) for k in ("vision_config", "audio_config")):
        raise UnsupportedError(f"{name} is a multimodal model: kdnctl holds a text decoder's KV only",
                               hint="save and pass its text model (e.g. the *ForCausalLM of its text config)")


def _attention_child(layer) -> torch.nn.Module | None:
    for name in ("self_attn", "attention", "attn"):
        mod = getattr(layer, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


class ModelAdapter:
    """The one view of a transformers causal LM that the rest of kdnctl uses."""

    def __init__(self, model):
        check_supported(model.config)
        self.model = model
        self.config = model.config
        cfg = self.config
        self.decoder = model.base_model
        layers = getattr(self.decoder, "layers", None)
        name = type(model).__name__
        if layers is None:
            raise UnsupportedError(f"{name}: no decoder layer stack found (expected base_model.layers)",
                                   hint="use a decoder-only causal LM")
        self.layers = list(layers)
        self.attentions = [_attention_child(layer) for layer in self.layers]
        if any(a is None for a in self.attentions):
            raise UnsupportedError(f"{name}: a decoder layer has no attention module (self_attn / attention)",
                                   hint="use a decoder-only attention model")
        a0 = self.attentions[0]
        if all(hasattr(a0, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            self.layout = "separate"
        elif hasattr(a0, "qkv_proj") and hasattr(a0, "o_proj"):
            self.layout = "fused"
        elif hasattr(a0, "query_key_value") and hasattr(a0, "dense"):
            self.layout = "interleaved"
        else:
            raise UnsupportedError(f"{name}: its attention's projections ({', '.join(n for n, _ in a0.named_children())}) "
                                   "are none of q/k/v/o, qkv/o or query_key_value/dense",
                                   hint="use a decoder-only attention model with a known projection layout")
        self.n_layers = len(self.layers)
        self.n_q_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_q_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_q_heads
        self._layer_attention: list[LayerAttention] | None = None

    # ---- attention per layer ------------------------------------------------------------------

    def layer_attention(self) -> list[LayerAttention]:
        """Per layer: full or sliding (and its window), soft-cap and scale, as the model's own
        attention modules pass them to their attention function (one probe forward)."""
        if self._layer_attention is None:
            seen: dict[int, dict] = {}
            device = next(self.model.parameters()).device
            with torch.inference_mode(), _recording(self.model, seen):
                self.decoder(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
            out = []
            for i, mod in enumerate(self.attentions):
                kw = seen.get(getattr(mod, "layer_idx", i), {})
                window = kw.get("sliding_window")
                scaling = kw.get("scaling")
                out.append(LayerAttention(SLIDING if window else FULL, int(window) if window else None,
                                          float(kw["softcap"]) if kw.get("softcap") else None,
                                          float(scaling if scaling is not None else self.head_dim ** -0.5)))
            self._layer_attention = out
        return self._layer_attention

    @property
    def has_sliding(self) -> bool:
        return any(a.kind == SLIDING for a in self.layer_attention())

    def attention_meta(self) -> list[dict] | None:
        """Per-layer attention for a bundle's model record; None where every layer is plain full
        attention without soft-capping (the records of such models stay as they were)."""
        la = self.layer_attention()
        if all(a.kind == FULL and a.softcap is None for a in la):
            return None
        return [a.as_meta() for a in la]

    def full_cache(self, kv=None):
        """A ``DynamicCache`` whose every layer holds every token (sliding-window layers too:
        kdnctl's attention applies the window), optionally filled with ``kv`` [(K, V)] per layer."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=kv) if kv is not None else DynamicCache()

    # ---- projections --------------------------------------------------------------------------

    def output_weight(self, layer: int) -> torch.Tensor:
        """The attention output projection's weight ``[hidden, H_q * D]``."""
        a = self.attentions[layer]
        return (a.dense if self.layout == "interleaved" else a.o_proj).weight

    def _split(self, out: torch.Tensor, role: str) -> torch.Tensor:
        """A projection's output ``[T, features]`` -> ``role``'s heads ``[T, H, D]``."""
        d, hq, hkv = self.head_dim, self.n_q_heads, self.n_kv_heads
        t = out.shape[0]
        if self.layout == "interleaved":
            i = {"q": 0, "k": 1, "v": 2}[role]
            return out.view(t, hq, 3 * d)[..., i * d:(i + 1) * d]
        if self.layout == "fused":
            bounds = {"q": (0, hq * d), "k": (hq * d, (hq + hkv) * d), "v": ((hq + hkv) * d, (hq + 2 * hkv) * d)}
            s, e = bounds[role]
            return out[:, s:e].view(t, -1, d)
        return out.reshape(t, -1, d)

    def _source(self, layer: int, role: str) -> torch.nn.Module:
        """The projection module whose output holds ``role``."""
        a = self.attentions[layer]
        if self.layout == "interleaved":
            return a.query_key_value
        if self.layout == "fused":
            return a.qkv_proj
        return getattr(a, f"{role}_proj")

    def _normed(self, layer: int, role: str, x: torch.Tensor) -> torch.Tensor:
        """``role``'s heads ``[T, H, D]`` from its projection's output ``[T, F]``, through the
        module's q/k norm where it has one (over each head, or over all heads' features)."""
        norm = getattr(self.attentions[layer], f"{role}_norm", None) if role in ("q", "k") else None
        heads = self._split(x, role)
        if not isinstance(norm, torch.nn.Module):
            return heads
        weight = getattr(norm, "weight", None)
        if weight is not None and weight.numel() != self.head_dim:  # one norm over all heads' features
            return self._split(norm(heads.reshape(heads.shape[0], -1)), role)
        return norm(heads)

    @contextlib.contextmanager
    def capture(self, roles=("q",), on=None) -> Iterator[dict]:
        """Within the block, every forward of the decoder records, per layer and role
        (``q``/``k``/``v``), the projection ``[T, H, D]`` of the first sequence, before RoPE and after
        the model's q/k norm (applied here to the projection's output, as the module applies it). ``on(layer, role, tensor)`` is called instead of storing when given."""
        got: dict = {}
        handles = []

        def hook(i, role):
            def f(_mod, _inp, out):
                x = out[0].detach()
                x = self._normed(i, role, x.reshape(x.shape[0], -1))
                if on is not None:
                    on(i, role, x)
                else:
                    got[(i, role)] = x
            return f

        for i in range(self.n_layers):
            for role in roles:
                handles.append(self._source(i, role).register_forward_hook(hook(i, role)))
        try:
            yield got
        finally:
            for h in handles:
                h.remove()

    # ---- RoPE ---------------------------------------------------------------------------------

    def rotary_dim(self) -> int:
        """How many channels of a head RoPE rotates (the first ones)."""
        a0 = self.attentions[0]
        if getattr(a0, "rotary_ndims", None):
            return int(a0.rotary_ndims)
        rope = getattr(self.config, "rope_parameters", None) or {}
        frac = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
        frac = frac if frac is not None else getattr(self.config, "partial_rotary_factor", None)
        return int(self.head_dim * float(frac)) if frac else self.head_dim

    def rotary_module(self) -> torch.nn.Module | None:
        """The decoder's rotary embedding module (None for a model without RoPE)."""
        return getattr(self.decoder, "rotary_emb", None)

    def layer_rope_type(self, layer: int) -> str | None:
        types = getattr(self.config, "layer_types", None)
        return types[layer] if types else None

    def rope_cos_sin(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own RoPE for ``layer`` at ``positions [T]``: (cos, sin) ``[T, rotary_dim]``
        in float32, scaling factors included."""
        rotary = self.rotary_module()
        if rotary is None:
            raise UnsupportedError(f"{type(self.model).__name__} has no rotary embedding module",
                                   hint="kdnctl re-rotates keys only for RoPE models")
        p = next(self.model.parameters())
        probe = torch.zeros(1, 1, self.head_dim, device=p.device, dtype=p.dtype)
        pos = positions.to(p.device).long()[None]
        params = inspect.signature(rotary.forward).parameters
        if "layer_type" in params:
            cos, sin = rotary(probe, pos, self.layer_rope_type(layer))
        else:
            cos, sin = rotary(probe, pos)
        return cos[0].float(), sin[0].float()

    def plain_rope_theta(self) -> float | None:
        """theta where every layer rotates every channel with plain RoPE (``default`` type, one
        theta): then kdnctl's own RoPE formula equals the model's; else None."""
        rope = getattr(self.config, "rope_parameters", None)
        if rope is None:
            rope = {"rope_theta": getattr(self.config, "rope_theta", None),
                    "rope_type": (getattr(self.config, "rope_scaling", None) or {}).get("rope_type", "default")}
        return plain_rope_theta(rope)


def plain_rope_theta(rope: dict | None) -> float | None:
    """theta of a model record's ``rope`` entry when it is plain RoPE over the whole head, else None."""
    rope = rope or {}
    if rope.get("rope_type", "default") != "default":
        return None
    frac = rope.get("partial_rotary_factor")
    if frac is not None and float(frac) != 1.0:
        return None
    theta = rope.get("rope_theta")
    return theta if isinstance(theta, (int, float)) and not isinstance(theta, bool) else None


_PROBE_NAME = "kdnctl-probe"
_RECORD: list[dict] = []


def _probe_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Records what a module passes to its attention function; the output is plain causal
    attention (the probe's two tokens only need a well-shaped result)."""
    if _RECORD:
        _RECORD[-1][getattr(module, "layer_idx", len(_RECORD[-1]))] = dict(kwargs, scaling=scaling)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _recording(model, seen: dict):
    from transformers import AttentionInterface

    if _PROBE_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(_PROBE_NAME, _probe_attention)
    previous = model.config._attn_implementation
    model.config._attn_implementation = _PROBE_NAME
    _RECORD.append(seen)
    try:
        yield
    finally:
        _RECORD.pop()
        model.config._attn_implementation = previous


ADAPTER_ATTR = "_kdnctl_adapter"


def adapter_for(model) -> ModelAdapter:
    """The adapter of a transformers model (built once per model object). It is kept on the model
    itself: an adapter holds its model, so a cache keyed by the model (even a weak one) would keep
    every model a process ever loaded alive."""
    model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
    found = model.__dict__.get(ADAPTER_ATTR)
    if found is None:
        found = ModelAdapter(model)
        object.__setattr__(model, ADAPTER_ATTR, found)  # plain attribute: not a submodule, not saved
    return found
