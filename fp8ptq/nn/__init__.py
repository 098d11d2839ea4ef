"""Quantized modules: GEMMs and fused experts whose weights live as format codes + scales."""
