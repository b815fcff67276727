"""Triton kernels and their launch helpers. Import only where Triton is installed (CUDA backends)."""
