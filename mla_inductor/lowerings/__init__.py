"""Inductor lowerings of the mla:: ops: a C++ template choice beside the extern reference, one module per
op (template.py has what they share).

Everything here touches Inductor internals (lowering registry, IR, CppTemplate); keep that surface in
this package. Importing it registers the lowerings.
"""

from . import gqa_decode, gqa_qkv, linear, mla_decode, mla_prefill, moe, q_b_absorb, qkv_a, rope  # noqa: F401
