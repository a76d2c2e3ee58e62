"""The row counts at which a kernel set switches arithmetic when batch invariance is off
(``MISTRALRS_BATCH_INVARIANT=false``): their one home.

Each picks, for the rows of one call, between a per-row path (every row computed alone,
as decoding it alone would) and a batched path (faster for many rows, but its rounding
depends on how many rows come together), so a request's tokens may then depend on what
shares its step. With batch invariance on (the default) no kernel branches on them: every
row takes the per-row path. The kernel sets and products that branch on them read them
from here and nowhere else.
"""

# Queries per sequence up to which a CPU step attends query by query with the native
# decode kernel: faster than the torch twin for short queries, and a speculative
# verification then computes each token exactly as decoding it alone would.
CPU_DECODE_ROWS = 32


def native_attention_queries(batch_invariant: bool) -> int | None:
    """Queries per sequence and step up to which CPU attention takes the native kernel
    (None: any number, as batch invariance needs)."""
    return None if batch_invariant else CPU_DECODE_ROWS


# Rows up to which the native products run before dequantize-then-GEMM takes over (int8
# or float32 activations alike; measured on the default model with AVX-512 when the GEMM
# was bfloat16). Up to here each row's result is the same whatever the other rows, so a
# speculative verification of a few tokens computes each exactly as decoding it alone.
NATIVE_MAX_ROWS = 24

# Rows up to which the Triton path fuses decoding into the product; more rows (a prefill)
# unpack the matrix once and take the float GEMM.
TRITON_FUSED_ROWS = 64
