"""The KV cache is passed by the name the installed transformers takes (no deprecation warning on
every forward), and no module of kdnctl spells the old name outside kdnctl/models/cache_args.py."""

from pathlib import Path

from kdnctl.models.cache_args import cache_arg, cache_name, cache_out

ROOT = Path(__file__).resolve().parents[1]


class NewStyle:
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return None


class OldStyle:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return None


def test_the_name_follows_the_signature():
    assert cache_name(NewStyle) == "cache" and cache_arg(NewStyle(), 1) == {"cache": 1}
    assert cache_name(OldStyle) == "past_key_values" and cache_arg(OldStyle(), 2) == {"past_key_values": 2}


def test_the_output_cache_under_either_name():
    class Out:
        pass

    new, old = Out(), Out()
    new.cache, old.past_key_values = "c", "p"
    assert cache_out(new) == "c" and cache_out(old) == "p"


def test_transformers_models_take_the_name_kdnctl_passes():
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg)
    for module in (model, model.get_decoder()):
        assert cache_name(type(module)) in inspect.signature(type(module).forward).parameters


def test_no_module_passes_the_old_name():
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "kdnctl").rglob("*.py"))
                 if p.name != "cache_args.py" and "past_key_values" in p.read_text()]
    assert offenders == [], f"pass the cache with cache_arg(): {offenders}"
