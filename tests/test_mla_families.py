"""Every MLA model family of the installed transformers, found by its config (a `kv_lora_rank`), built from a
tiny config with random weights: a StaticCache greedy decode, eager and through MLAPass (graph_utils.
inductor_passes_backend: our ops' references, no C++), must give the same tokens, and each MLA layer must
fire qkv_a_proj, rope, q_b_absorb and mla_decode, or the family is listed below with what it lacks. A family
a new transformers adds is tested without a code change."""

import inspect

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from graph_utils import declined, fired, greedy, inductor_passes_backend
from mla_inductor import record, supported

DECODE_FUSIONS = ("qkv_a_proj", "rope", "q_b_absorb", "mla_decode")
# Sizes every family's config takes where it has the field (distinct, small, heads of 16 + 8 / 16; LongCat's
# `num_layers` holds two attentions each, every one a recompile: one layer).
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, head_dim=8, num_layers=1, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Families whose MLA layers lack what a fusion needs: fusion -> why (the missing feature), the README's
# table's source (mla_inductor/supported.py). The test fails when such a fusion starts to fire, so that the
# list stays true.
GAPS = supported.MLA_FAMILY_GAPS


def mla_families() -> list[str]:
    """The model types of the installed transformers whose configs take kv_lora_rank and that have a
    causal LM."""
    found = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        if "kv_lora_rank" in inspect.signature(config_cls.__init__).parameters:
            found.append(model_type)
    return found


def tiny_model(model_type: str) -> torch.nn.Module:
    config_cls = CONFIG_MAPPING[model_type]
    fields = inspect.signature(config_cls.__init__).parameters
    kwargs = {name: value for name, value in TINY.items() if name in fields}
    config = config_cls(**kwargs)
    if "linear_attention" in (getattr(config, "layer_types", None) or []):  # a hybrid: one layer of each
        config = config_cls(**kwargs, layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_the_families_are_found_and_the_readme_table_lists_each():
    found = set(mla_families())
    assert {"deepseek_v2", "deepseek_v3", "minicpm3", "kimi_linear"} <= found
    listed = {"deepseek_v2", "deepseek_v3", *supported.MLA_FAMILY_GAPS, *supported.MLA_FAMILIES_FIRING_ALL}
    assert found == listed, (found - listed, listed - found)


@pytest.mark.parametrize("model_type", mla_families())
def test_family_decode_fires_per_mla_layer_and_tokens_equal_eager(model_type):
    model = tiny_model(model_type)
    mla_layers = sum(1 for m in model.modules() if hasattr(m, "kv_b_proj"))
    prompt = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))
    make_cache = lambda: transformers.StaticCache(config=model.config, max_cache_len=32)  # noqa: E731
    expected, _ = greedy(model, make_cache(), prompt, 4)
    cache = make_cache()
    torch._dynamo.reset()
    start = record.event_count()
    step = torch.compile(lambda ids, pos: model(input_ids=ids, past_key_values=cache, position_ids=pos).logits,
                         backend=inductor_passes_backend)
    actual, _ = greedy(model, cache, prompt, 4, step)
    events = record.events_since(start)
    assert torch.equal(actual, expected)
    if model_type == "hy_v4":  # attention sinks: the decode walks say why they decline
        reasons = declined(events, "mla_decode") + declined(events, "gqa_decode")
        assert any("attention sinks" in reason for reason in reasons), reasons
    gaps = GAPS.get(model_type, {})
    for fusion in DECODE_FUSIONS:
        count = fired(events, fusion)
        if fusion in gaps:
            assert count == 0, f"{fusion} fires now on {model_type}: update GAPS ({gaps[fusion]})"
        else:
            assert count >= mla_layers, (fusion, count, mla_layers, declined(events, fusion))
