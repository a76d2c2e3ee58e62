"""float8_e4m3fn encoding and decoding in integer arithmetic, for the Triton kernels.

Done by hand rather than with Triton's float8 casts so that every GPU (native FP8 or
not) and the interpreter round exactly like torch's ``.to(torch.float8_e4m3fn)``:
round to nearest, ties to even, subnormals included.
"""

import triton
import triton.language as tl


@triton.jit
def fp8_e4m3_encode(x):
    """float32 in [-448, 448] → the float8_e4m3fn bit pattern (uint8)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    # Normal results: keep 3 of 23 mantissa bits, rounding the other 20.
    kept = mantissa >> 20
    rest = mantissa & 0xFFFFF
    round_up = (rest > 0x80000) | ((rest == 0x80000) & ((kept & 1) == 1))
    kept = kept + round_up.to(tl.int32)
    normal = ((exponent + 7 + (kept >> 3)) << 3) | (kept & 7)
    # Subnormal results count units of 2**-9: the full significand shifted down.
    significand = mantissa | 0x800000
    shift = tl.minimum(14 - exponent, 31)
    units = significand >> shift
    remainder = significand - (units << shift)
    half = (1 << (shift - 1)).to(tl.int32)
    units = units + ((remainder > half) | ((remainder == half) & ((units & 1) == 1))).to(tl.int32)
    magnitude = tl.where(exponent >= -6, normal, units)
    magnitude = tl.where((bits & 0x7FFFFFFF) == 0, 0, magnitude)
    return (sign | magnitude).to(tl.uint8)


@triton.jit
def fp8_e4m3_decode(b):
    """float8_e4m3fn bit patterns (uint8) → float32."""
    b = b.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = (b & 7).to(tl.float32)
    normal = (1.0 + mantissa * 0.125) * tl.exp2((exponent - 7).to(tl.float32))
    magnitude = tl.where(exponent == 0, mantissa * 0.001953125, normal)
    return tl.where((b & 0x80) != 0, -magnitude, magnitude)
