"""Quantized Linears in plain PyTorch (quantization.py): BlockFp8Linear and W8A8Linear against fp64,
keep_fp8_weights_ on a checkpoint's tensors and on transformers' FP8Linear, and the serving model's
(fp8, W8A8) and transformers DeepSeek's (fp8) projections through the fusions, whose kernels read
the one-byte weights."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers.integrations.finegrained_fp8 import FP8Linear

import mla_inductor
from graph_utils import fired, rewrite_and_run
from mla_inductor.models import build_model, get_config, make_block_tables
from mla_inductor.models.hf import build_hf_model
from mla_inductor.ops.weight_quant import quantize_weight_fp8_blocks
from mla_inductor.quantization import BlockFp8Linear, W8A8Linear, keep_fp8_weights_
from quant_utils import dequantize_fp64, quantize_rows_int8_fp64

FP8 = torch.float8_e4m3fn


def test_block_fp8_linear_against_fp64():
    """Partial blocks in both dims; the weight dequantized in fp32, rounded once to the activations'
    dtype, as DeepSeek's reference does; bias added in that dtype."""
    g = torch.Generator().manual_seed(0)
    weight, scale = quantize_weight_fp8_blocks(torch.randn(40, 72, generator=g), [16, 32])
    bias = torch.randn(40, generator=g).to(torch.bfloat16)
    linear = BlockFp8Linear(weight, scale, [16, 32], bias)
    x = torch.randn(3, 72, generator=g).to(torch.bfloat16)
    w = dequantize_fp64(weight, scale, [16, 32]).to(torch.bfloat16)
    expected = (x.double() @ w.double().T + bias.double()).to(torch.bfloat16)
    torch.testing.assert_close(linear(x), expected, atol=1e-2, rtol=1e-2)
    assert torch.equal(linear.dequantized_weight(torch.bfloat16), w)


def test_block_fp8_linear_names_the_bad_argument():
    weight, scale = quantize_weight_fp8_blocks(torch.randn(40, 72), [16, 32])
    with pytest.raises(ValueError, match=r"weight_scale_inv must be \[2, 3\]"):
        BlockFp8Linear(weight, scale, [32, 32])
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        BlockFp8Linear(weight.float(), scale, [16, 32])
    with pytest.raises(ValueError, match="weight_scale_inv must be float32"):
        BlockFp8Linear(weight, scale.double(), [16, 32])


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(72, 40, bias=False)
        self.out = torch.nn.Linear(40, 8, bias=False)


def test_keep_fp8_weights_from_a_checkpoint():
    """The Linears the state dict holds in fp8 become BlockFp8Linear over those very tensors; the
    others keep their weights."""
    model = TwoLinears().to(torch.bfloat16)
    weight, scale = quantize_weight_fp8_blocks(torch.randn(40, 72), [16, 32])
    assert keep_fp8_weights_(model, {"proj.weight": weight, "proj.weight_scale_inv": scale}, [16, 32]) == ["proj"]
    assert isinstance(model.proj, BlockFp8Linear) and model.proj.weight.data_ptr() == weight.data_ptr()
    assert type(model.out) is torch.nn.Linear
    with pytest.raises(ValueError, match="no out.weight_scale_inv"):
        keep_fp8_weights_(model, {"out.weight": torch.zeros(8, 40, dtype=FP8)})


@pytest.mark.parametrize("block_size", [(16, 32), None])
def test_keep_fp8_weights_of_transformers_fp8_linear(block_size):
    """transformers' FP8Linear (whose forward needs a GPU) becomes a BlockFp8Linear of the same values;
    its block_size None is one scale for the whole weight."""
    module = FP8Linear(72, 40, block_size=block_size)
    weight, scale = quantize_weight_fp8_blocks(torch.randn(40, 72), block_size or (40, 72))
    module.weight.data, module.weight_scale_inv.data = weight, scale if block_size else scale.reshape(())
    model = torch.nn.Sequential(module)
    assert keep_fp8_weights_(model) == ["0"]
    expected = dequantize_fp64(weight, scale, block_size or (40, 72)).to(torch.bfloat16)
    assert torch.equal(model[0].dequantized_weight(torch.bfloat16), expected)


# --- through the fusions --------------------------------------------------------------------------

BLOCK = (32, 64)  # the tiny model's q_lora_rank (96) splits at a block of rows; partial blocks


def _decode_inputs(model):
    block_tables, num_blocks = make_block_tables(2, 40, 16)
    caches = model.allocate_kv_cache(num_blocks, 16)
    for c in caches:
        c.normal_(generator=torch.Generator().manual_seed(3))
    return torch.tensor([5, 7]), caches, block_tables, torch.tensor([17, 33])


def test_serving_fp8_decode_compiled_frozen_keeps_the_fused_weights_fp8():
    """The serving model with DeepSeek-V3's fp8 format (in-graph block dequantization) through the
    backend with freezing: the whole input chain and the latent attention fuse, the fused templates
    read the fp8 weights (stock freezing folds them into bf16 constants), and the logits match eager."""
    config = get_config("tiny", num_layers=2)
    model = build_model(config, quant="fp8", block_size=BLOCK)
    ids, caches, block_tables, lens = _decode_inputs(model)
    torch._dynamo.reset()
    mla_inductor.reset_counts()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        expected = model.forward_decode(ids, [c.clone() for c in caches], block_tables, lens)
        compiled = torch.compile(model.forward_decode, backend="mla_inductor")
        actual, code = run_and_get_code(compiled, ids, caches, block_tables, lens)
    counts = mla_inductor.fusion_counts()
    for fusion in ("qkv_proj_with_rope", "qkv_a_proj", "q_b_absorb", "mla_decode"):
        assert counts[fusion] == config.num_layers, counts
    code = "\n".join(code)
    assert "gemm.run(" in code and "using weight_t = mla_inductor::Float8_e4m3fn_finite;  // q_b_proj's" in code, code
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)


def test_w8a8_linear_against_fp64():
    """SGLang's W8A8 in PyTorch: x quantized per token (absmax / 127), the integer product times both
    scales, rounded once."""
    g = torch.Generator().manual_seed(1)
    linear = W8A8Linear.from_linear(torch.nn.Linear(72, 40, bias=False))
    x = torch.randn(2, 3, 72, generator=g).to(torch.bfloat16)
    w = dequantize_fp64(linear.weight, linear.weight_scale)
    expected = (quantize_rows_int8_fp64(x) @ w.T).to(torch.bfloat16)
    torch.testing.assert_close(linear(x), expected, atol=1e-2, rtol=1e-2)


def test_serving_w8a8_decode_fuses_the_input_chain_with_int8_activations():
    """The serving model with SGLang's W8A8 Linears (graph level): qkv_a_proj and q_b_absorb read the
    int8 weights and quantize their inputs per token as the Linears did (activation_quant="int8"),
    the concatenated weight split with its scale rows; the whole chain and the latent attention fuse."""
    config = get_config("tiny", num_layers=2)
    model = build_model(config, quant="w8a8")
    ids, caches, block_tables, lens = _decode_inputs(model)
    with torch.no_grad():
        expected = model.forward_decode(ids, [c.clone() for c in caches], block_tables, lens)
    actual, events = rewrite_and_run(model.forward_decode, ids, caches, block_tables, lens)
    for fusion in ("qkv_proj_with_rope", "qkv_a_proj", "q_b_absorb", "mla_decode"):
        assert fired(events, fusion) == config.num_layers, fusion
    fused = [n for n in rewrite_and_run.graph.nodes
             if n.target in (torch.ops.mla.qkv_a_proj.default, torch.ops.mla.q_b_absorb.default)]
    assert len(fused) == 2 * config.num_layers
    for node in fused:
        assert node.args[1].meta["val"].dtype == torch.int8 and node.kwargs["activation_quant"] == "int8"
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)


def test_transformers_deepseek_with_a_checkpoints_fp8_weights_fuses_its_a_projections():
    """transformers' DeepseekV3 given fp8 q_a / kv_a / q_b / kv_b / o_proj weights by keep_fp8_weights_
    (graph level): qkv_a_proj and q_b_absorb read the fp8 weights, the other Linears dequantize as the
    model wrote it."""
    config = get_config("tiny", num_layers=1)
    model = build_hf_model(config, arch="v3", dtype=torch.bfloat16)
    checkpoint = {}
    for name, module in model.named_modules():
        if name.endswith(("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")):
            checkpoint[f"{name}.weight"], checkpoint[f"{name}.weight_scale_inv"] = quantize_weight_fp8_blocks(
                module.weight.detach(), BLOCK)
    assert len(keep_fp8_weights_(model, checkpoint, BLOCK)) == 5
    prompt = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    fn = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    with torch.no_grad():
        expected = fn(prompt)
    actual, events = rewrite_and_run(fn, prompt)
    assert fired(events, "qkv_a_proj") == 1
    fused = [n for n in rewrite_and_run.graph.nodes if n.target is torch.ops.mla.qkv_a_proj.default]
    assert [n.args[1].meta["val"].dtype for n in fused] == [FP8]
    assert fused[0].kwargs["weight_block_size"] == list(BLOCK)
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)
