// LoRA products over a step's rows, grouped by adapter (twin: lora_delta_ref in
// spnl_backend/kernels/lora_ref.py): for each segment, out[row] += scale * B (A x[row]) on its
// rows, in float32.
//
// A task is one row, and computes it alone in a fixed order, segment after segment: each
// segment's `rank` low values is a dot product over the input (two 16-lane chains, then the
// tail), and each output is the sum over the rank in order, 16 outputs per vector (B is
// passed transposed, [rank][out], so those 16 lie side by side); the tail of the outputs
// goes through the same vector code on a zero-padded copy. No row's arithmetic depends on
// how many rows, or which other adapters, share the call: batch invariance.

#include "common.h"

#define MAX_RANK 4096          // low values per row, on the task's stack
#define PARALLEL_WORK 65536    // multiply-adds from which a call uses the threads

// sum_i a[i] * b[i] in a fixed order: two 16-lane chains, then the tail.
static float lora_dot(const float *a, const float *b, int64_t n) {
    v16f even = {0}, odd = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        even = fma16(load_f32(a + i), load_f32(b + i), even);
        odd = fma16(load_f32(a + i + 16), load_f32(b + i + 16), odd);
    }
    if (i + 16 <= n) {
        even = fma16(load_f32(a + i), load_f32(b + i), even);
        i += 16;
    }
    float sum = hsum(even + odd);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

// 16 outputs from column j: out += scale * sum_r low[r] * bt[r][j .. j + 16], the rank in
// order. `width` (at most 16) of them are real; the rest of the lanes read and write a
// zero-padded copy.
static void expand16(const float *low, const float *bt, int64_t rank, int64_t n_out, int64_t j,
                     int64_t width, float scale, float *out) {
    v16f acc = {0};
    if (width == 16) {
        for (int64_t r = 0; r < rank; r++)
            acc = fma16(splat(low[r]), load_f32(bt + r * n_out + j), acc);
        const v16f o = load_f32(out + j) + acc * splat(scale);
        memcpy(out + j, &o, sizeof o);
        return;
    }
    float column[16] = {0}, tail[16] = {0};
    for (int64_t r = 0; r < rank; r++) {
        memcpy(column, bt + r * n_out + j, width * sizeof(float));
        acc = fma16(splat(low[r]), load_f32(column), acc);
    }
    memcpy(tail, out + j, width * sizeof(float));
    const v16f o = load_f32(tail) + acc * splat(scale);
    memcpy(out + j, &o, width * sizeof(float));
}

typedef struct {
    const spnl_lora_segment *segs;
    int64_t k_in, n_out, x_stride, out_stride;
    const int64_t *task_row;  // [tasks]: the row each task computes
    const int64_t *start;     // [tasks + 1]: each task's first entry in `entry`
    const int64_t *entry;     // the segments of each task's row, in segment order
    const float *x;
    float *out;
} lora_call;

// Task i: one row, through each of its segments in segment order (a row of several
// adapters takes their products one after the other, as the twin adds them).
static void lora_task(void *ctx, int64_t i, int worker) {
    (void)worker;
    const lora_call *c = ctx;
    const int64_t row = c->task_row[i];
    const float *x = c->x + row * c->x_stride;
    float *out = c->out + row * c->out_stride;
    float low[MAX_RANK];
    for (int64_t e = c->start[i]; e < c->start[i + 1]; e++) {
        const spnl_lora_segment *seg = &c->segs[c->entry[e]];
        const int64_t rank = seg->rank;
        for (int64_t r = 0; r < rank; r++) low[r] = lora_dot(seg->a + r * c->k_in, x, c->k_in);
        for (int64_t j = 0; j < c->n_out; j += 16) {
            const int64_t width = c->n_out - j < 16 ? c->n_out - j : 16;
            expand16(low, seg->bt, rank, c->n_out, j, width, seg->scale, out);
        }
    }
}

// Whether every segment is well formed, every row index inside x and no row twice in one
// segment; each row's number of segments in count[row], the total multiply-adds in *work.
static int check_segments(const spnl_lora_segment *segs, int64_t n_segs, int64_t x_rows,
                          int64_t k_in, int64_t n_out, int64_t *count, int64_t *work) {
    int64_t *last = malloc(((size_t)x_rows + 1) * sizeof(int64_t));  // the last segment seen
    if (!last) return NO_MEMORY;
    for (int64_t row = 0; row < x_rows; row++) last[row] = -1;
    int status = 0;
    *work = 0;
    for (int64_t s = 0; s < n_segs && !status; s++) {
        const spnl_lora_segment *seg = &segs[s];
        if (seg->count < 0 || seg->rank < 1 || seg->rank > MAX_RANK || !seg->a || !seg->bt ||
            (seg->count && !seg->rows)) {
            status = BAD_ARGUMENT;
            break;
        }
        for (int64_t i = 0; i < seg->count && !status; i++) {
            const int64_t row = seg->rows[i];
            if (row < 0 || row >= x_rows) status = OUT_OF_BOUNDS;
            else if (last[row] == s) status = BAD_ARGUMENT;
            else last[row] = s, count[row]++;
        }
        *work += seg->count * seg->rank * (k_in + n_out);
    }
    free(last);
    return status;
}

// The tasks of a checked call: each row of some segment, and its segments in order.
static int run_tasks(const spnl_lora_segment *segs, int64_t n_segs, const int64_t *count,
                     lora_call *call, int64_t x_rows, int threads) {
    int64_t tasks = 0, entries = 0;
    for (int64_t row = 0; row < x_rows; row++) tasks += count[row] > 0, entries += count[row];
    int64_t *task_row = malloc(((size_t)tasks + 1) * sizeof(int64_t));
    int64_t *start = malloc(((size_t)tasks + 1) * sizeof(int64_t));
    int64_t *entry = malloc(((size_t)entries + 1) * sizeof(int64_t));
    int64_t *fill = malloc(((size_t)x_rows + 1) * sizeof(int64_t));  // next free entry per row
    int status = task_row && start && entry && fill ? 0 : NO_MEMORY;
    if (!status) {
        int64_t t = 0;
        start[0] = 0;
        for (int64_t row = 0; row < x_rows; row++) {
            if (!count[row]) continue;
            task_row[t] = row, fill[row] = start[t], start[t + 1] = start[t] + count[row];
            t++;
        }
        for (int64_t s = 0; s < n_segs; s++)
            for (int64_t i = 0; i < segs[s].count; i++) entry[fill[segs[s].rows[i]]++] = s;
        call->task_row = task_row, call->start = start, call->entry = entry;
        spnl_parallel(tasks, lora_task, call, threads);
    }
    free(task_row), free(start), free(entry), free(fill);
    return status;
}

int spnl_lora_add(const spnl_lora_segment *segs, int64_t n_segs, const float *x,
                  int64_t x_stride, int64_t x_rows, int64_t k_in, float *out,
                  int64_t out_stride, int64_t n_out, int threads) {
    if (n_segs < 0 || x_rows < 0 || k_in < 1 || n_out < 1 || x_stride < k_in ||
        out_stride < n_out)
        return BAD_ARGUMENT;
    int64_t *count = calloc((size_t)x_rows + 1, sizeof(int64_t)), work;
    if (!count) return NO_MEMORY;
    int status = check_segments(segs, n_segs, x_rows, k_in, n_out, count, &work);
    if (!status) {
        lora_call call = {segs, k_in, n_out, x_stride, out_stride, NULL, NULL, NULL, x, out};
        status = run_tasks(segs, n_segs, count, &call, x_rows,
                           work >= PARALLEL_WORK ? threads : 1);
    }
    free(count);
    return status;
}

int spnl_lora_table_add(const spnl_lora_table *t, const spnl_lora_group *groups,
                        int64_t n_groups, const float *x, int64_t x_stride, int64_t x_rows,
                        int64_t k_in, float *out, int64_t out_stride, int64_t n_out,
                        int threads) {
    if (!t || n_groups < 1) return 0;
    spnl_lora_segment *segs = malloc((size_t)n_groups * sizeof(spnl_lora_segment));
    if (!segs) return NO_MEMORY;
    int64_t n = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        const int64_t slot = groups[g].slot;
        if (slot < 0 || slot >= t->slots || !t->a[slot]) continue;  // no adapter here
        segs[n++] = (spnl_lora_segment){groups[g].rows, groups[g].count, t->a[slot],
                                        t->bt[slot], t->rank[slot],
                                        (float)(t->scale[slot] * groups[g].factor)};
    }
    const int status = spnl_lora_add(segs, n, x, x_stride, x_rows, k_in, out, out_stride, n_out,
                                     threads);
    free(segs);
    return status;
}
