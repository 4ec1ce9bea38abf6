"""The speedup report end to end, in its one-minute form."""

import json

import pytest
import torch

from mla_inductor import report
from mla_inductor.models import weight_bytes


def test_quick_report_writes_json_markdown_and_chart(tmp_path, capsys):
    """`--quick` for one model and phase, Llama's decode, without the stock-frozen variant: the other
    models, phases and variants run the same code with other builders and options, and each would add
    the whole of this test again to the suite's longest (37 s a model on a cold cache here). The
    builders of every case are tested below without compiling."""
    variants = ["eager", "stock", "mla_inductor"]
    result = report.main(["--quick", "--model", "llama", "--phase", "decode", "--variants", *variants,
                          "--out", str(tmp_path), "--name", "r"])
    written = json.loads((tmp_path / "r.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "r.md").read_text()

    labels = [r["label"] for r in written["results"]]
    assert labels == ["llama decode B=1 ctx 64"]
    assert written["machine"]["copy_bandwidth_GBps"] > 1 and written["machine"]["gemm_GFLOPs"] > 1
    for r in written["results"]:
        assert set(r["times_s"]) == set(variants)
        assert all(t > 0 for t in r["times_s"].values())
        assert 0 < r["roofline_fraction"]["mla_inductor"] < 1.5
        assert r["roofline_bound"] == "memory"  # a few MB of weights against a few MFLOP
        assert r["speedup"]["vs_stock_best"] > 0
        assert r["label"] in markdown
    llama_decode = written["results"][0]["fusion_counts"]
    assert llama_decode["gqa_qkv"] == llama_decode["gqa_decode"] == 2  # one per layer
    assert "| case |" in capsys.readouterr().out


def test_cases_follow_the_arguments():
    args = report.parse_args(["--model", "serving", "--phase", "decode", "--batch", "1", "8", "--context", "1024"])
    assert [c.label for c in report.build_cases(args)] == [
        "serving decode B=1 ctx 1024",
        "serving decode B=8 ctx 1024",
    ]


def test_int8_cases_are_the_transformers_models_with_torchao_weights():
    args = report.parse_args(["--phase", "decode", "--batch", "1", "--context", "64", "--quant", "int8"])
    assert [c.label for c in report.build_cases(args)] == ["hf int8 decode B=1 ctx 64", "llama int8 decode B=1 ctx 64"]
    linear = report.quantized(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16), "int8")
    assert weight_bytes(linear) == 48 * 64 + 48 * (4 + 1)  # the int8 weight; per channel an fp32 scale, an int8 zero point


def test_fp8_cases_are_the_deepseek_models_with_block_fp8_linears():
    args = report.parse_args(["--phase", "decode", "--batch", "1", "--context", "64", "--quant", "fp8"])
    assert [c.label for c in report.build_cases(args)] == ["serving fp8 decode B=1 ctx 64", "hf fp8 decode B=1 ctx 64"]
    with pytest.raises(SystemExit, match="llama"):
        report.build_cases(report.parse_args(["--model", "llama", "--quant", "fp8"]))
    model = report.quantized(torch.nn.Sequential(torch.nn.Linear(256, 200, bias=False)).to(torch.bfloat16), "fp8")
    assert weight_bytes(model) == 200 * 256 + 2 * 2 * 4  # the fp8 weight; an fp32 scale per 128 x 128 block


def test_w8a8_cases_are_every_model_with_per_token_int8_activations():
    args = report.parse_args(["--phase", "decode", "--batch", "1", "--context", "64", "--quant", "w8a8"])
    assert [c.label for c in report.build_cases(args)] == [
        "serving w8a8 decode B=1 ctx 64", "hf w8a8 decode B=1 ctx 64", "llama w8a8 decode B=1 ctx 64"]
    model = report.quantized(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)).to(torch.bfloat16), "w8a8")
    assert weight_bytes(model) < 48 * 64 * 2  # int8, not bf16


@pytest.mark.parametrize("quant", ["none", "w8a8", "fp8"])
def test_every_quick_workload_runs_eagerly(quant):
    """What the compiled test above leaves out: every model and phase of `--quick` builds its workload,
    whose step runs (eagerly: the compiled step is the same function) and repeats after each reset, as
    the report calls it."""
    models = ["all", "hf-dense"] + ([] if quant == "fp8" else ["qwen3", "llama2"])  # no fp8 Qwen3 or Llama-2
    args = report.parse_args(["--quick", "--quant", quant, "--model", *models])
    builders = {"serving": report.serving_workload, "hf": report.hf_workload, "hf-dense": report.hf_workload,
                "llama": report.llama_workload, "llama2": report.llama_workload, "qwen3": report.llama_workload}
    for case in report.build_cases(args):
        workload = builders[case.model](report.model_config(args, case.model, torch.bfloat16), case, torch.bfloat16)
        assert workload.weight_bytes > 0 and workload.flops > 0, case.label
        with torch.no_grad():
            workload.reset()
            first = workload.fn(*workload.args)
            workload.reset()
            again = workload.fn(*workload.args)
        assert torch.isfinite(first).all() and torch.equal(first, again), case.label


def test_hf_is_deepseek_with_its_moe_and_decode_reads_the_experts_its_token_selects():
    """"hf" is transformers' DeepSeek with the config's MoE layout (the first layer dense; the tiny config's
    is V3's grouped routing); a one-token step's bytes hold top-k routed experts per MoE layer, not all of
    them; "hf-dense" has no experts."""
    args = report.parse_args(["--quick", "--model", "hf", "hf-dense", "--phase", "decode", "--batch", "1",
                              "--context", "64"])
    config = report.model_config(args, "hf", torch.bfloat16)
    moe, dense = (report.hf_workload(config, case, torch.bfloat16) for case in report.build_cases(args))
    experts = report.routed_experts(moe.module)
    assert moe.module.config.n_group == config.n_group > 1 and not report.routed_experts(dense.module)
    assert len(experts) == config.num_layers - config.first_k_dense_replace > 0
    per_expert = 2 * (experts[0].gate_up_proj[0].numel() + experts[0].down_proj[0].numel())
    everything = weight_bytes(moe.module, exclude=("model.embed_tokens",))
    routed = len(experts) * config.n_routed_experts * per_expert
    assert moe.weight_bytes == everything - routed + len(experts) * config.num_experts_per_tok * per_expert


def test_deepseek_v3_rank_has_its_grouped_routing():
    """`--hf-config deepseek-v3-tp16`: a DeepseekV3 rank's share with all 256 experts and V3's grouped
    routing (the transformers config; building the weights would take gigabytes)."""
    from mla_inductor.models.hf import hf_config
    from mla_inductor.models import get_config

    config = hf_config(get_config("deepseek-v3-tp16"), "v3", moe=True)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (256, 8, 8, 4)
    assert (config.moe_intermediate_size, config.first_k_dense_replace, config.num_attention_heads) == (128, 1, 8)
