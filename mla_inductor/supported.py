"""The models the fusions are tested on and what fires on them: the README's supported-models table.

`python -m mla_inductor.supported` prints the table; tests/test_readme.py checks that the README holds it
as printed. Each row names the tests that check its claims. The rows of transformers' other MLA families
come from MLA_FAMILY_GAPS, which tests/test_mla_families.py asserts family by family (a fusion listed
there must not fire, every other one must), so that part of the table cannot drift from what runs.
"""

from __future__ import annotations

import dataclasses

DECODE_MLA = ("qkv_a_proj", "rope", "q_b_absorb", "mla_decode")

# transformers' MLA families besides DeepSeek V2 / V3 (found by their configs): fusion -> what the family lacks
MLA_FAMILY_GAPS = {
    "axk2": {"q_b_absorb": "its query is not whole heads' columns of q_b_proj"},
    "dots3_note_text": {"qkv_a_proj": "per-layer configs set their own LoRA ranks"},
    "hy_v4": {"q_b_absorb": "no mla_decode to absorb into",
              "mla_decode": "attention sinks (a learned per-head logit in the softmax: explain() says so), a sigmoid "
                            "gate on the output, and eager attention over kv_b_proj's heads"},
    "kimi_linear": {"rope": "its MLA layers have no RoPE",
                    "q_b_absorb": "its query has no RoPE part, which q_b_absorb's kernel rotates"},
    "longcat_flash": {"q_b_absorb": "q_nope and q_pe scaled by a constant (its LoRA scaling) after q_b_proj"},
}
MLA_FAMILIES_FIRING_ALL = ("axk1", "bailing_hybrid", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "minicpm3",
                           "youtu")


@dataclasses.dataclass(frozen=True)
class Row:
    models: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    formats: str
    tests: str


# `linear` (the Linears no other fusion took) fires on every model: at decode's rows where the CPU has a
# native bf16 GEMM, at every row count where it has not (docs/linear.md); it is left out of the rows.
ROWS = (
    Row("transformers DeepSeek-V3, DeepSeek-V2 (with their MoE)", ("rope", "mla_prefill", "moe (to 1024 tokens)"),
        DECODE_MLA + ("moe",), "bf16, fp32, int8 (torchao), W8A8, fp8 blocks",
        "test_mla_decode, test_q_b_absorb, test_mla_prefill, test_moe, test_quantized_linear"),
    Row("transformers DeepSeek-V2-Lite (no q LoRA)", ("rope", "mla_prefill", "moe (to 1024 tokens)"),
        ("qkv_a_proj", "rope", "mla_decode", "moe"), "bf16, fp32", "test_mla_decode, test_moe"),
    Row("transformers " + ", ".join(MLA_FAMILIES_FIRING_ALL), (), DECODE_MLA, "fp32", "test_mla_families"),
    *(Row(f"transformers {family}", (), tuple(f for f in DECODE_MLA if f not in gaps), "fp32", "test_mla_families")
      for family, gaps in MLA_FAMILY_GAPS.items()),
    Row("DeepSeek's reference inference/model.py", (), DECODE_MLA, "bf16, fp32", "spellings/test_mla_decode_spellings"),
    Row("serving-style MLA (SGLang / vLLM torch-native, models/mla.py)", ("qkv_a_proj", "rope", "mla_prefill"),
        DECODE_MLA + ("qkv_proj_with_rope",), "bf16, fp32, W8A8, fp8", "test_qkv_a, test_mla_decode, test_mla_prefill"),
    Row("transformers Llama, Qwen2, Qwen3, Gemma 1-3, Mistral", ("gqa_qkv", "rope", "gqa_prefill (bf16, not AMX)"),
        ("gqa_qkv", "gqa_decode"), "bf16, fp32, int8 (torchao)", "test_gqa_qkv, test_gqa_decode, test_mla_prefill"),
    Row("transformers Llama-2, Phi-3-mini, GPT-NeoX, OLMo (multi-head)", (), ("gqa_decode",), "bf16, fp32",
        "test_gqa_decode"),
    Row("transformers Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4-MoE", ("moe",), ("moe",), "bf16, fp32", "test_moe"),
)


def markdown() -> str:
    lines = ["| models | prefill | decode | weights | tested by |", "|---|---|---|---|---|"]
    for row in ROWS:
        cells = [row.models, ", ".join(row.prefill) or "-", ", ".join(row.decode), row.formats, row.tests]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
