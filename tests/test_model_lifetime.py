"""A process that loads one model after another (an in-process corpus compress, `bench/quality.py`,
a server) keeps only the models still in use: nothing kdnctl caches per model holds its model."""

import gc
import weakref

import torch


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(cfg).eval()


def test_a_model_with_an_adapter_is_freed_when_its_last_user_lets_go():
    from kdnctl.models import adapter_for

    model = _tiny_llama()
    adapter = adapter_for(model)
    assert adapter_for(model) is adapter  # built once per model
    assert adapter.decoder is not None
    ref = weakref.ref(model)
    del model, adapter
    gc.collect()
    assert ref() is None, "a kdnctl cache keeps a model alive after its last user"


def test_key_weights_kept_for_a_model_do_not_keep_it_alive():
    from kdnctl.models import adapter_for
    from kdnctl.quant import sensitivity

    model = _tiny_llama()
    adapter_for(model)
    sensitivity._KEY_WEIGHTS.setdefault(model, {})["doc"] = torch.zeros(2, 1, 16)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
