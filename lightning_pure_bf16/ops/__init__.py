"""Rounding, random bits and the fused update kernels (the Triton kernel is imported only where it is used)."""
