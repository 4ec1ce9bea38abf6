"""Inductor lowerings of the mla:: ops: a C++ template choice beside the extern reference, one module per op."""
