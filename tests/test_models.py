"""Reference models: absorbed decode against naive attention, configs, paging, the transformers builder."""

import pytest
import torch

from mla_inductor.models import build_model, get_config, make_block_tables
from mla_inductor.models.mla import MLAAttention, rope_inv_freq


def _prefill_then_decode(config, block_size, batch=2, prompt=19):
    model = build_model(config, dtype=torch.float64, seed=1)
    block_tables, num_blocks = make_block_tables(batch, prompt + 1, block_size, seed=2, spare_blocks=3)
    caches = model.allocate_kv_cache(num_blocks, block_size)
    gen = torch.Generator().manual_seed(3)
    prompt_lens = torch.tensor([prompt, prompt - 5])[:batch]
    with torch.no_grad():
        for b in range(batch):  # ragged prompts: one request at a time
            ids = torch.randint(0, config.vocab_size, (1, int(prompt_lens[b])), generator=gen)
            model.forward_prefill(ids, caches, block_tables[b : b + 1], prompt_lens[b : b + 1])
        naive_caches = [c.clone() for c in caches]
        new = torch.randint(0, config.vocab_size, (batch,), generator=gen)
        seq_lens = prompt_lens + 1
        absorbed = model.forward_decode(new, caches, block_tables, seq_lens)
        naive = torch.cat(
            [
                model.forward_prefill(new[b : b + 1, None], naive_caches, block_tables[b : b + 1], seq_lens[b : b + 1])[:, 0]
                for b in range(batch)
            ]
        )
    return absorbed, naive, caches, naive_caches


@pytest.mark.parametrize("config_name, q_lora_rank", [("tiny", 96), ("tiny", None)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_absorbed_decode_equals_naive_attention_in_fp64(config_name, q_lora_rank, block_size):
    config = get_config(config_name, q_lora_rank=q_lora_rank)
    absorbed, naive, caches, naive_caches = _prefill_then_decode(config, block_size)
    assert absorbed.abs().max() > 0.1  # a real signal, not zeros
    torch.testing.assert_close(absorbed, naive, rtol=0, atol=1e-10)
    for c, n in zip(caches, naive_caches):  # both paths write the same new rows
        torch.testing.assert_close(c, n, rtol=0, atol=1e-10)


def test_decode_never_reads_past_seq_len():
    config = get_config("tiny")
    model = build_model(config, dtype=torch.float32)
    block_tables, num_blocks = make_block_tables(1, 40, 16)
    caches = model.allocate_kv_cache(num_blocks, 16)
    for c in caches:
        c.normal_()
    ids = torch.tensor([3])
    beyond = torch.arange(20, 32)  # allocated rows past the 20 valid ones
    beyond_slots = block_tables[0, beyond // 16] * 16 + beyond % 16
    with torch.no_grad():
        ref = model.forward_decode(ids, caches, block_tables, torch.tensor([20]))
        for c in caches:
            c.view(-1, c.shape[-1])[beyond_slots] = 7.0
        again = model.forward_decode(ids, caches, block_tables, torch.tensor([20]))
    torch.testing.assert_close(again, ref)


def test_config_shapes():
    tp22 = get_config("deepseek-v3-tp22")
    with torch.device("meta"):
        attn = MLAAttention(tp22)
        lite = MLAAttention(get_config("deepseek-v2-lite"))
    assert attn.q_b_proj.weight.shape == (4224, 1536)
    assert attn.fused_qkv_a_proj_with_mqa.weight.shape == (1536 + 576, 7168)
    assert attn.w_kc.shape == (22, 512, 128) and attn.w_vc.shape == (22, 128, 512)
    assert lite.q_proj.weight.shape == (16 * 192, 2048) and not hasattr(lite, "q_b_proj")
    v3 = get_config("deepseek-v3")
    assert (v3.hidden_size, v3.num_heads, v3.q_lora_rank, v3.latent_dim) == (7168, 128, 1536, 576)
    # 192^-0.5 * mscale(40, 1)^2, as transformers computes it for the released config
    assert v3.softmax_scale == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    with pytest.raises(ValueError, match="unknown config"):
        get_config("deepseek-v4")


def test_yarn_frequencies_match_transformers():
    from mla_inductor.models.hf import build_hf_model

    config = get_config("tiny")
    hf = build_hf_model(config, dtype=torch.float32)
    ours, attention_factor = rope_inv_freq(config)
    torch.testing.assert_close(ours.float(), hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)


def test_weights_are_seeded_and_realistic():
    config = get_config("tiny")
    a, b, c = (build_model(config, dtype=torch.float32, seed=s) for s in (0, 0, 1))
    wa = a.layers[0].self_attn.q_b_proj.weight
    torch.testing.assert_close(wa, b.layers[0].self_attn.q_b_proj.weight)
    assert not torch.equal(wa, c.layers[0].self_attn.q_b_proj.weight)
    assert wa.std().item() == pytest.approx(config.q_lora_rank**-0.5, rel=0.1)


@pytest.mark.parametrize("name, arch_class", [("tiny", "DeepseekV3ForCausalLM"), ("deepseek-v2-lite", "DeepseekV2ForCausalLM")])
def test_hf_builder(name, arch_class):
    from mla_inductor.models.hf import build_hf_model

    overrides = {"num_hidden_layers": 1, "vocab_size": 64, "intermediate_size": 32} if name != "tiny" else {}
    model = build_hf_model(name, dtype=torch.float32, **overrides)
    assert type(model).__name__ == arch_class
    again = build_hf_model(name, dtype=torch.float32, **overrides)
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        torch.testing.assert_close(p, q, msg=n)
    with torch.no_grad():
        logits = model(torch.randint(0, model.config.vocab_size, (1, 5))).logits
    assert logits.shape == (1, 5, model.config.vocab_size) and torch.isfinite(logits).all()
