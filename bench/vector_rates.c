// The rate at which this core runs the vector instructions the one-row kernels are made of:
// each probe runs 8 independent copies of one instruction (or of a pair, alternating) per
// loop trip, so the loop measures throughput, not latency. bench/vector_rates.py turns the
// seconds into cycles with the first probe, a chain of dependent adds (one a cycle).
#include <stdint.h>
#include <time.h>

static char buffer[8192] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define X8(ins) ins ins ins ins ins ins ins ins
#define ADD "add $1, %%rax\n"
// 8 instructions `a` then `b` in turn, `op src1, src2, dst` with dst zmm8..zmm15 (or ymm),
// srcs zmm1/zmm2; OPS: 8 of one.
#define PAIR(a, b, r)                                                                      \
    a " %%" r "1, %%" r "2, %%" r "8\n" b " %%" r "1, %%" r "2, %%" r "9\n"               \
    a " %%" r "1, %%" r "2, %%" r "10\n" b " %%" r "1, %%" r "2, %%" r "11\n"             \
    a " %%" r "1, %%" r "2, %%" r "12\n" b " %%" r "1, %%" r "2, %%" r "13\n"             \
    a " %%" r "1, %%" r "2, %%" r "14\n" b " %%" r "1, %%" r "2, %%" r "15\n"
#define OPS(op, r) PAIR(op, op, r)
#define SHIFTS(op, r)                                                                     \
    op " $4, %%" r "1, %%" r "8\n" op " $4, %%" r "1, %%" r "9\n"                          \
    op " $4, %%" r "1, %%" r "10\n" op " $4, %%" r "1, %%" r "11\n"                        \
    op " $4, %%" r "1, %%" r "12\n" op " $4, %%" r "1, %%" r "13\n"                        \
    op " $4, %%" r "1, %%" r "14\n" op " $4, %%" r "1, %%" r "15\n"
// A three-operand op beside a shift by an immediate, 4 of each.
#define PAIR_SHIFT(a, b, r)                                                                \
    a " %%" r "1, %%" r "2, %%" r "8\n" b " $4, %%" r "1, %%" r "9\n"                     \
    a " %%" r "1, %%" r "2, %%" r "10\n" b " $4, %%" r "1, %%" r "11\n"                   \
    a " %%" r "1, %%" r "2, %%" r "12\n" b " $4, %%" r "1, %%" r "13\n"                   \
    a " %%" r "1, %%" r "2, %%" r "14\n" b " $4, %%" r "1, %%" r "15\n"
#define TERNLOG(r)                                                                        \
    "vpternlogd $0xF8, %%" r "1, %%" r "2, %%" r "8\n"                                     \
    "vpternlogd $0xF8, %%" r "1, %%" r "2, %%" r "9\n"                                     \
    "vpternlogd $0xF8, %%" r "1, %%" r "2, %%" r "10\n"                                    \
    "vpternlogd $0xF8, %%" r "1, %%" r "2, %%" r "11\n"                                    \
    "vpternlogd $0xF8, %%" r "1, %%" r "2, %%" r "12\n"                                    \
    "vpternlogd $0xF8, %%" r "1, %%" r "2, %%" r "13\n"                                    \
    "vpternlogd $0xF8, %%" r "1, %%" r "2, %%" r "14\n"                                    \
    "vpternlogd $0xF8, %%" r "1, %%" r "2, %%" r "15\n"
#define LOADS(op, r, at, step)                                                            \
    op " " #at "+0*" #step "(%0), %%" r "8\n" op " " #at "+1*" #step "(%0), %%" r "9\n"    \
    op " " #at "+2*" #step "(%0), %%" r "10\n" op " " #at "+3*" #step "(%0), %%" r "11\n"  \
    op " " #at "+4*" #step "(%0), %%" r "12\n" op " " #at "+5*" #step "(%0), %%" r "13\n"  \
    op " " #at "+6*" #step "(%0), %%" r "14\n" op " " #at "+7*" #step "(%0), %%" r "15\n"

#define CLOBBER "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define PROBE(name, text)                                                                 \
    static double name(long n) {                                                          \
        const double start = now();                                                       \
        for (long i = 0; i < n; i++) __asm__ volatile(text : : "r"(buffer) : "rax", CLOBBER); \
        return now() - start;                                                             \
    }

typedef struct {
    const char *name;
    double (*run)(long);
} probe;

#if defined(__x86_64__)
PROBE(add_chain, X8(ADD))
#endif
#if defined(__AVX2__)
PROBE(ymm_load, LOADS("vmovdqu", "ymm", 0, 32))
PROBE(ymm_and, OPS("vpand", "ymm"))
PROBE(ymm_shift, SHIFTS("vpsrlw", "ymm"))
PROBE(ymm_shuffle, OPS("vpshufb", "ymm"))
PROBE(ymm_maddubs, OPS("vpmaddubsw", "ymm"))
#endif
#if defined(__AVX512BW__)
PROBE(zmm_load, LOADS("vmovdqu64", "zmm", 0, 64))
PROBE(zmm_load_split, LOADS("vmovdqu64", "zmm", 16, 64))
PROBE(zmm_and, OPS("vpandd", "zmm"))
PROBE(zmm_shift, SHIFTS("vpsrlw", "zmm"))
PROBE(zmm_pshufb, OPS("vpshufb", "zmm"))
PROBE(zmm_permw, OPS("vpermw", "zmm"))
PROBE(zmm_packs, OPS("vpackssdw", "zmm"))
PROBE(zmm_shift_permw, PAIR("vpsllvw", "vpermw", "zmm"))
PROBE(zmm_ternlog, TERNLOG("zmm"))
PROBE(zmm_mulld, OPS("vpmulld", "zmm"))
PROBE(zmm_add, OPS("vpaddd", "zmm"))
#endif
#if defined(__AVX512VNNI__)
PROBE(zmm_dpbusd, OPS("vpdpbusd", "zmm"))
PROBE(zmm_dpbusd_permw, PAIR("vpdpbusd", "vpermw", "zmm"))
PROBE(zmm_dpbusd_dpwssd, PAIR("vpdpbusd", "vpdpwssd", "zmm"))
PROBE(zmm_dpbusd_mulld, PAIR("vpdpbusd", "vpmulld", "zmm"))
PROBE(zmm_dpbusd_shift, PAIR_SHIFT("vpdpbusd", "vpsrlw", "zmm"))
PROBE(zmm_dpbusd_and, PAIR("vpdpbusd", "vpandd", "zmm"))
#endif

// Only x86-64 cores have probes (none elsewhere: the count is then 0).
static const probe probes[] = {
#if defined(__x86_64__)
    {"add chain (the clock: one a cycle)", add_chain},
#endif
#if defined(__AVX2__)
    {"ymm load, aligned", ymm_load},
    {"ymm vpand", ymm_and},
    {"ymm vpsrlw", ymm_shift},
    {"ymm vpshufb", ymm_shuffle},
    {"ymm vpmaddubsw", ymm_maddubs},
#endif
#if defined(__AVX512BW__)
    {"zmm load, aligned", zmm_load},
    {"zmm load, across two cache lines", zmm_load_split},
    {"zmm vpandd", zmm_and},
    {"zmm vpsrlw", zmm_shift},
    {"zmm vpshufb", zmm_pshufb},
    {"zmm vpermw", zmm_permw},
    {"zmm vpackssdw", zmm_packs},
    {"zmm vpsllvw + vpermw", zmm_shift_permw},
    {"zmm vpternlogd", zmm_ternlog},
    {"zmm vpmulld", zmm_mulld},
    {"zmm vpaddd", zmm_add},
#endif
#if defined(__AVX512VNNI__)
    {"zmm vpdpbusd", zmm_dpbusd},
    {"zmm vpdpbusd + vpermw", zmm_dpbusd_permw},
    {"zmm vpdpbusd + vpdpwssd", zmm_dpbusd_dpwssd},
    {"zmm vpdpbusd + vpmulld", zmm_dpbusd_mulld},
    {"zmm vpdpbusd + vpsrlw", zmm_dpbusd_shift},
    {"zmm vpdpbusd + vpandd", zmm_dpbusd_and},
#endif
};

int spnl_rate_count(void) { return (int)(sizeof probes / sizeof(probe)); }
const char *spnl_rate_name(int i) { return probes[i].name; }
// Seconds for n loop trips of probe i (8 instructions a trip).
double spnl_rate_run(int i, long n) { return probes[i].run(n); }
