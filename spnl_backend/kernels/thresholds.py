"""The row counts at which a kernel set switches arithmetic: their one home.

Each picks, for the rows of one call, between a per-row path (every row computed alone,
as decoding it alone would) and a batched path (faster for many rows, but its rounding
can depend on how many rows come together). A request's tokens may therefore depend on
what shares its step wherever a step crosses one of these. The kernel sets and products
that branch on them read them from here and nowhere else.
"""

# Queries per sequence up to which a CPU step attends query by query with the native
# decode kernel: faster than the torch twin for short queries, and a speculative
# verification then computes each token exactly as decoding it alone would.
CPU_DECODE_ROWS = 32

# Rows up to which the native int8 products are at least as fast as dequantize-then-GEMM
# (measured on the default model with AVX-512: the products re-read every weight block
# once per row group, the GEMM's cost is the unpack). Up to here each row's result is the
# same whatever the other rows, so a speculative verification of a few tokens computes
# each exactly as decoding it alone. The exact (float32) products take every row count
# the library allows (`CpuKernels.max_rows`).
NATIVE_MAX_ROWS = 24

# Rows up to which the Triton path fuses decoding into the product; more rows (a prefill)
# unpack the matrix once and take the float GEMM.
TRITON_FUSED_ROWS = 64
