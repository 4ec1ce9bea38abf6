"""The mla:: custom ops: schema, eager reference and fake (meta) implementation, one module per fused op."""

from . import weight_quant  # noqa: F401  (mla::dequantize_weight)
from . import qkv_a  # noqa: F401
from . import mla_decode  # noqa: F401
from . import rope  # noqa: F401
from . import q_b_absorb  # noqa: F401
from . import qkv_proj_with_rope  # noqa: F401
from . import gqa_qkv  # noqa: F401
from . import gqa_decode  # noqa: F401
from . import linear  # noqa: F401
from . import moe  # noqa: F401
from . import mla_prefill  # noqa: F401
