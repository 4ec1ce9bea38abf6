"""linear: mla::linear, its template (the projection templates' GEMM with the bias and the rounding per
task), and the rewrite of the bf16 / fp16 Linears no other fusion takes, on transformers models, where the
CPU has no native GEMM for them (patterns/linear.py)."""

import pytest
import torch
import transformers
from torch import nn
from torch._inductor.utils import run_and_get_code

import mla_inductor
from graph_utils import compiled_greedy_decode, fired, has_dynamic_sizes, rewrite_and_run, tiny_gqa_model
from mla_inductor import benchmarking, isa
from mla_inductor.lowerings.segment_gemm import can_pack, packs_rows
from mla_inductor.patterns import linear as linear_patterns


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def fp64_linear(x, weight, bias=None):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def within_one_rounding(actual, x, weight, bias=None):
    """actual is the fp64 product rounded once to its dtype (an error of at most one unit in its last
    place), give or take fp32 summation (at most K fp32 roundings of the sum of |x| |w|)."""
    expected = fp64_linear(x, weight, bias)
    summation = x.shape[1] * 2**-24 * (x.double().abs() @ weight.double().abs().T)
    bound = torch.finfo(actual.dtype).eps * expected.abs() + summation
    assert ((actual.double() - expected).abs() <= bound).all(), (actual.double() - expected).abs().max()


# --- the op ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_is_f_linear(dtype):
    x, weight, bias = randn(5, 40, dtype=dtype), randn(24, 40, dtype=dtype, seed=1), randn(24, dtype=dtype, seed=2)
    torch.testing.assert_close(torch.ops.mla.linear(x, weight, bias), nn.functional.linear(x, weight, bias),
                               atol=0, rtol=0)
    torch.testing.assert_close(torch.ops.mla.linear(x, weight).double(), fp64_linear(x, weight),
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-2, rtol=1e-2)


@pytest.mark.parametrize("args, message", [
    ((randn(2, 3, 8), randn(4, 8)), r"x must be \[rows, in_features\]"),
    ((randn(2, 8), randn(4, 7)), r"weight must be torch.bfloat16\[out_features, 8\]"),
    ((randn(2, 8), randn(4, 8, dtype=torch.float32)), "weight must be torch.bfloat16"),
    ((randn(2, 8), randn(4, 8), randn(5)), r"bias must be torch.bfloat16\[4\] or None"),
    ((randn(2, 8, dtype=torch.float64), randn(4, 8, dtype=torch.float64)), "x has dtype torch.float64"),
    ((randn(2, 8), randn(4, 8).to("meta")), "weight must be on the CPU"),
])
def test_bad_arguments_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.mla.linear(*args)


# --- the template ----------------------------------------------------------------------------------


class Linears(nn.Module):
    """nn.Linear's parameters given to mla::linear directly: K not a whole number of vectors, N not a
    whole number of tiles, x read at a row stride wider than K."""

    def __init__(self, dtype, k=200, n=50):
        super().__init__()
        self.weight = nn.Parameter(randn(n, k, dtype=dtype, seed=1, scale=k**-0.5), requires_grad=False)
        self.bias = nn.Parameter(randn(n, dtype=dtype, seed=2), requires_grad=False)
        self.k = k

    def forward(self, wide_x):
        x = wide_x[:, 3:3 + self.k]  # a row stride of the wide tensor's
        return torch.ops.mla.linear(x, self.weight, self.bias), torch.ops.mla.linear(x, self.weight)


def check_over_rows(compiled, module, dtype, runs, not_runs):
    """compiled(module) at rows that fill no panel, one, and several tiles (70: past one rounded tile of 64
    rows), within one rounding of the fp64 product; the C++ of the first call runs the tasks `runs`, not
    `not_runs`."""
    for rows in (1, 3, 8, 9, 70):
        wide_x = randn(rows, module.k + 11, dtype=dtype, seed=rows)
        (with_bias, without), codes = run_and_get_code(compiled, wide_x) if rows == 1 else (compiled(wide_x), None)
        if codes is not None:
            assert all(task in codes[0] for task in runs) and not_runs not in codes[0]
        x = wide_x[:, 3:3 + module.k]
        within_one_rounding(with_bias, x, module.weight, module.bias)
        within_one_rounding(without, x, module.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_template_over_rows_strides_and_dtypes(dtype):
    """One compile with the rows dynamic. bf16 on AVX-512 without BF16 packs the weight as the tiles go
    from 12 rows (packed_task_rounded_from_rows): K past one chunk of pairs and odd (the pair's zero pad),
    N a block and a part."""
    module = Linears(dtype, k=301)
    compiled = torch.compile(module, backend="mla_inductor", dynamic=True)
    runs = ("mi::nt_task_rounded",) + (("mi::packed_task_rounded_from_rows(",) if packs_rows(dtype) else ())
    check_over_rows(compiled, module, dtype, runs, "mi::packed_task_rounded(")


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="this target has no packed kernel")
def test_template_over_frozen_weights_packed_at_compile_time():
    """Under freezing the weight is packed for the target (packed_dot.h): one compile with the rows
    dynamic, K odd (the VNNI layout's zero pad), N a block and a part, K past one chunk of k."""
    module = Linears(torch.bfloat16, k=301, n=50).eval()
    torch._dynamo.reset()
    with benchmarking.inference_freezing(), torch.no_grad():
        compiled = torch.compile(module, backend="mla_inductor", dynamic=True)
        check_over_rows(compiled, module, torch.bfloat16, ("mi::packed_task_rounded(",), "mi::nt_task_rounded")


def test_template_without_rows_runs_nothing():
    module = Linears(torch.bfloat16)
    compiled = torch.compile(module, backend="mla_inductor", dynamic=False)
    with_bias, without = compiled(randn(0, module.k + 11))
    assert with_bias.shape == without.shape == (0, 50)


# --- the rewrite on transformers models ---------------------------------------------------------------


@pytest.fixture
def emulated_16_bit(monkeypatch):
    """The rewrite as a CPU without a native bf16 or fp16 GEMM makes it, on every CPU."""
    monkeypatch.setattr(isa, "native_gemm", lambda dtype: dtype == torch.float32)


def with_and_without(monkeypatch, fn, *args):
    """fn's graph rewritten and run (the ops' references) as on a CPU with native 16-bit GEMMs (no Linear
    rewritten) and as on one without: the outputs of both and the second's record. The op's reference
    is the ATen GEMM the graph held, so the two agree exactly."""
    monkeypatch.setattr(isa, "native_gemm", lambda dtype: True)
    kept, _ = rewrite_and_run(fn, *args)
    monkeypatch.setattr(isa, "native_gemm", lambda dtype: dtype == torch.float32)
    return (kept, *rewrite_and_run(fn, *args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_leaves_its_linears_to_the_rewrite(monkeypatch, dtype):
    """gqa_qkv takes q/k/v; o_proj, the MLP's three and lm_head are left: 4 a layer and one."""
    model = tiny_gqa_model("llama", dtype)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    expected, out, events = with_and_without(monkeypatch, logits, ids)
    assert fired(events, "gqa_qkv") == 2 and fired(events, "linear") == 2 * 4 + 1
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_dynamic_rows(emulated_16_bit):
    """Batch and sequence symbolic, as a server's one graph has them: the rows of every Linear too. Each of
    the layer's seven Linears and lm_head is gqa_qkv's or mla::linear, none is left to ATen."""
    model = tiny_gqa_model("llama", torch.bfloat16, layers=1)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    _, events = rewrite_and_run(lambda ids: model(input_ids=ids, use_cache=False).logits, ids, dynamic=True)
    graph = rewrite_and_run.graph
    assert has_dynamic_sizes(graph) and fired(events, "linear") + 3 * fired(events, "gqa_qkv") == 7 + 1
    assert not [n for n in graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]


def test_gpt_neox_biased_linears_become_linear_with_bias(monkeypatch):
    """GPT-NeoX: every Linear has a bias (addmm), its fused query_key_value included."""
    config = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    expected, out, events = with_and_without(monkeypatch, lambda ids: model(input_ids=ids).logits, ids)
    assert fired(events, "linear") == 2 * 4 + 1
    graph = rewrite_and_run.graph
    biased = [n for n in graph.nodes if n.target is torch.ops.mla.linear.default and n.args[2] is not None]
    assert len(biased) == 2 * 4  # all but the embed_out head
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_not_on_conv1d_weights_computed_weights_or_fp32(emulated_16_bit):
    """GPT-2's Conv1D holds its weight [in, out] (addmm(b, x, w): no Linear's layout); a weight computed in
    the graph, a broadcast bias and an fp32 Linear are not taken either. GPT-2's lm_head is a Linear and is."""
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    _, events = rewrite_and_run(lambda ids: gpt2(input_ids=ids).logits, ids)
    assert fired(events, "linear") == 1

    weight = randn(24, 40, seed=1)
    _, events = rewrite_and_run(lambda x, w: x @ (2 * w).T, randn(3, 40), weight)
    assert fired(events, "linear") == 0
    _, events = rewrite_and_run(lambda x, w, b: torch.addmm(b, x, w.T), randn(3, 40), weight, randn(1))
    assert fired(events, "linear") == 0  # a bias of one element, broadcast: no Linear's
    _, events = rewrite_and_run(nn.Linear(40, 24).eval(), randn(3, 40, dtype=torch.float32))
    assert fired(events, "linear") == 0


@pytest.fixture
def native_16_bit(monkeypatch):
    """The rewrite as a CPU with native bf16 and fp16 GEMMs and without AMX makes it, on every CPU."""
    monkeypatch.setattr(isa, "native_gemm", lambda dtype: True)
    monkeypatch.setattr(isa, "host_isa", lambda: "avx512_bf16")


@pytest.mark.parametrize("freezing", [False, True])
def test_native_bf16_gemm_only_at_decode_rows(native_16_bit, freezing):
    """Where oneDNN's bf16 GEMM is native the template wins only at a few rows (its one-row GEMV streams
    the weights at half the memory's rate): static rows up to the limit are rewritten, more rows,
    rows known only at run time and fp16 Linears stay."""
    limit = linear_patterns.MAX_NATIVE_ROWS_FROZEN if freezing else linear_patterns.MAX_NATIVE_ROWS_UNFROZEN
    module = nn.Linear(40, 24).to(torch.bfloat16).eval()
    with torch._inductor.config.patch(freezing=freezing):
        for rows, taken in [(1, 1), (limit, 1), (limit + 1, 0)]:
            _, events = rewrite_and_run(module, randn(rows, 40))
            assert fired(events, "linear") == taken, rows
    _, events = rewrite_and_run(module, randn(3, 40), dynamic=True)
    assert fired(events, "linear") == 0
    _, events = rewrite_and_run(nn.Linear(40, 24).to(torch.float16).eval(), randn(3, 40, dtype=torch.float16))
    assert fired(events, "linear") == 0


def test_native_bf16_gemm_on_amx_keeps_four_rows(native_16_bit, monkeypatch):
    monkeypatch.setattr(isa, "host_isa", lambda: "amx")
    module = nn.Linear(40, 24).to(torch.bfloat16).eval()
    assert [fired(rewrite_and_run(module, randn(rows, 40))[1], "linear") for rows in (4, 5)] == [1, 0]


def test_switched_off_by_name(emulated_16_bit):
    module = nn.Linear(40, 24).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="mla_inductor", options={"mla_inductor.fusions": {"linear": False}})
    with torch.no_grad():
        compiled(randn(3, 40))
    assert mla_inductor.fusion_counts()["linear"] == 0


@pytest.mark.parametrize("freezing", [False, True])
def test_llama_bf16_static_cache_decode_compiled(freezing):
    """The compiled decode of a bf16 Llama: the same tokens as eager, the Linears rewritten (here for real:
    the C++ is built and run), whether the CPU emulates bf16 GEMMs or not: a step's two rows are decode's."""
    counts, (expected, _), (actual, _) = compiled_greedy_decode(tiny_gqa_model("llama", torch.bfloat16), freezing, 4)
    assert counts["linear"] == 2 * 4 + 1
    assert torch.equal(actual, expected)
