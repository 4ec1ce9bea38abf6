"""The mla:: custom ops: schema, eager reference and fake (meta) implementation, one module per fused op."""
