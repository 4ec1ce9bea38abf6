"""The speedup report end to end, in its one-minute form."""

import json

import pytest
import torch

from mla_inductor import report
from mla_inductor.models import weight_bytes


def test_quick_report_writes_json_markdown_and_chart(tmp_path, capsys):
    """The decode half of `--quick` for the transformers models, without the stock-frozen variant (prefill
    runs the same code with another phase, the serving model's decode another builder, stock-frozen
    stock's compile with other options; each would add a third to the suite's longest test: 37 s a
    model on a cold cache here)."""
    variants = ["eager", "stock", "mla_inductor"]
    result = report.main(["--quick", "--model", "hf", "llama", "--phase", "decode", "--variants", *variants,
                          "--out", str(tmp_path), "--name", "r"])
    written = json.loads((tmp_path / "r.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "r.md").read_text()

    labels = [r["label"] for r in written["results"]]
    assert labels == ["hf decode B=1 ctx 64", "llama decode B=1 ctx 64"]
    assert written["machine"]["copy_bandwidth_GBps"] > 1 and written["machine"]["gemm_GFLOPs"] > 1
    for r in written["results"]:
        assert set(r["times_s"]) == set(variants)
        assert all(t > 0 for t in r["times_s"].values())
        assert 0 < r["roofline_fraction"]["mla_inductor"] < 1.5
        assert r["roofline_bound"] == "memory"  # a few MB of weights against a few MFLOP
        assert r["speedup"]["vs_stock_best"] > 0
        assert r["label"] in markdown
    llama_decode = written["results"][1]["fusion_counts"]
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
