"""Fused GPU kernels (Triton), each with an eager reference it is tested against."""
