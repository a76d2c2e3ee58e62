"""Triton kernels and their torch reference twins."""
