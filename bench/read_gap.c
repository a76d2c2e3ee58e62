// Plain reads of a one-row product's weights in the product's own order, for
// bench/read_gap.py: the loads the decode kernels issue (and their software prefetches),
// with none of their arithmetic, so that a gap between a product and bench/read_bound.c
// can be split into what the access pattern costs and what the arithmetic costs. Not part
// of the library: built by the bench with the system's compiler.

#include <stdint.h>

#include <immintrin.h>

// Every load is folded into one of two accumulators by xor (kept: the result is returned).
#define FOLD(acc, at) acc = _mm512_xor_si512(acc, _mm512_loadu_si512((const void *)(at)))

static uint64_t folded(__m512i a, __m512i b) {
    uint64_t out[8];
    _mm512_storeu_si512((void *)out, _mm512_xor_si512(a, b));
    return out[0] ^ out[1] ^ out[2] ^ out[3] ^ out[4] ^ out[5] ^ out[6] ^ out[7];
}

static inline void prefetch_from(uintptr_t at, int bytes, int l2) {
    for (int o = 0; o < bytes; o += 64) {
        if (l2)
            __builtin_prefetch((const void *)(at + (uintptr_t)o), 0, 2);
        else
            __builtin_prefetch((const void *)(at + (uintptr_t)o), 0, 3);
    }
}

// The cache lines of [at, at + bytes), each once, as the kernels' prefetch_lines asks for them.
static inline void prefetch_lines_from(uintptr_t at, int bytes, int l2) {
    prefetch_from(at & ~(uintptr_t)63, (int)((at & 63) + bytes + 63) & ~63, l2);
}

// read_bound.c's loop (256 bytes a step, 4 prefetches `ahead` bytes on) over [p, p + bytes).
uint64_t spnl_gap_plain(const uint8_t *p, int64_t bytes, int64_t ahead) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i + 256 <= bytes; i += 256) {
        prefetch_from((uintptr_t)(p + i + ahead), 256, 0);
        FOLD(a0, p + i);
        FOLD(a1, p + i + 64);
        FOLD(a2, p + i + 128);
        FOLD(a3, p + i + 192);
    }
    return folded(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
}

// q5_0_row1's loads: each row's groups of 4 blocks (88 bytes) read as [0, 64) and
// [24, 88); every other group, the 176 bytes `ahead` on prefetched (ahead 0: none).
uint64_t spnl_gap_q5_0(const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t ahead,
                       int l2) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    const int64_t groups = row_bytes / 88;
    for (int64_t n = 0; n < rows; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *group = row + g * 88;
            if (ahead && !(g & 1)) prefetch_from((uintptr_t)group + (uintptr_t)ahead, 176, l2);
            FOLD(a0, group);
            FOLD(a1, group + 24);
        }
    }
    return folded(a0, a1);
}

// The Q4_K one-row kernel's loads: per row, 8 blocks of 144 bytes at a time, the 18
// lines `ahead` on prefetched once each, then per block its 16-byte head and its 128
// value bytes as two 64-byte loads.
uint64_t spnl_gap_q4_k(const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t ahead,
                       int l2) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    __m128i h = _mm_setzero_si128();
    const int64_t blocks = row_bytes / 144;
    for (int64_t n = 0; n < rows; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t b = 0; b < blocks; b += 8) {
            const int count = blocks - b < 8 ? (int)(blocks - b) : 8;
            if (ahead)
                prefetch_lines_from((uintptr_t)(row + b * 144) + (uintptr_t)ahead, count * 144, l2);
            for (int i = 0; i < count; i++) {
                const uint8_t *block = row + (b + i) * 144;
                h = _mm_xor_si128(h, _mm_loadu_si128((const __m128i *)block));
                FOLD(a0, block + 16);
                FOLD(a1, block + 80);
            }
        }
    }
    return folded(a0, _mm512_xor_si512(a1, _mm512_castsi128_si512(h)));
}

// The Q6_K one-row kernel's loads: per row, 8 blocks of 210 bytes at a time, the lines
// `ahead` on prefetched once each, then per block its 128 low-bit bytes as two 64-byte
// loads, its 64 high-bit bytes as two 32-byte loads and its 16 scales (d read with them).
uint64_t spnl_gap_q6_k(const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t ahead,
                       int l2) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    __m256i q = _mm256_setzero_si256();
    __m128i h = _mm_setzero_si128();
    const int64_t blocks = row_bytes / 210;
    for (int64_t n = 0; n < rows; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t b = 0; b < blocks; b += 8) {
            const int count = blocks - b < 8 ? (int)(blocks - b) : 8;
            if (ahead)
                prefetch_lines_from((uintptr_t)(row + b * 210) + (uintptr_t)ahead, count * 210, l2);
            for (int i = 0; i < count; i++) {
                const uint8_t *block = row + (b + i) * 210;
                FOLD(a0, block);
                FOLD(a1, block + 64);
                q = _mm256_xor_si256(q, _mm256_loadu_si256((const __m256i *)(block + 128)));
                q = _mm256_xor_si256(q, _mm256_loadu_si256((const __m256i *)(block + 160)));
                h = _mm_xor_si128(h, _mm_loadu_si128((const __m128i *)(block + 192)));
            }
        }
    }
    a1 = _mm512_xor_si512(a1, _mm512_castsi256_si512(q));
    return folded(a0, _mm512_xor_si512(a1, _mm512_castsi128_si512(h)));
}

// q8_0_row1's loads: each row's groups of 4 blocks (136 bytes) read as [0, 64), [64, 128)
// and [72, 136), the group's 136 bytes `ahead` on prefetched (3 lines: ahead 0, none).
uint64_t spnl_gap_q8_0(const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t ahead,
                       int l2) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    const int64_t groups = row_bytes / 136;
    for (int64_t n = 0; n < rows; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *group = row + g * 136;
            if (ahead) prefetch_from((uintptr_t)group + (uintptr_t)ahead, 136, l2);
            FOLD(a0, group);
            FOLD(a1, group + 64);
            FOLD(a0, group + 72);
        }
    }
    return folded(a0, a1);
}
