"""Reference DeepSeek MLA models: a serving-style model and a transformers builder, from shared configs."""

from .configs import CONFIGS, MLAConfig, get_config
from .mla import MLAModel, build_model, make_block_tables, weight_bytes

__all__ = ["CONFIGS", "MLAConfig", "MLAModel", "build_model", "get_config", "make_block_tables", "weight_bytes"]
