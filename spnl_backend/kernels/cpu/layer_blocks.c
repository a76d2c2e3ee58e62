// A decoder layer as two calls (twin: DecoderLayer.forward in spnl_backend/models/layers.py,
// the per-op path): the attention block, from the normed residual to the gate/up product,
// and the MLP block, from the activated product to the next layer's normed input. Between
// them the gate is activated and multiplied by up (spnl_gated_act, which the per-op path
// calls too, so both paths round it alike), at the MLP block's start. A layer
// with experts instead ends its attention block at the MLP's input norm and runs its
// experts as the MoE block (spnl_moe, which the per-op path calls too). Each step is the
// very kernel the per-op path calls, in the same order on the same values, so the two paths
// give the same bits; this one just leaves Python out of the layer.

#include "common.h"

static int add_norm(const spnl_step_args *s, const spnl_layer_args *l, const float *delta,
                    const float *delta_scale, const float *scale) {
    return spnl_add_rms_norm(s->x, delta, delta_scale, l->eps, scale, l->eps, s->h, s->tokens,
                             l->hidden, s->threads);
}

// A projection's adapters on this step's rows: out (rows out_stride apart) += their products
// of x (rows x_stride apart), as the per-op path's LoraSite.add computes them.
static int lora(const spnl_step_args *s, const spnl_layer_args *l, int which, const float *x,
                int64_t x_stride, int64_t k_in, float *out, int64_t out_stride, int64_t n_out) {
    return spnl_lora_table_add(l->lora[which], s->lora_groups, s->lora_count, x, x_stride,
                               s->tokens, k_in, out, out_stride, n_out, s->threads);
}

// OLMoE's q and k normed over their whole projections, then q, k and v clamped, in place
// in the q/k/v product rows (as the per-op path norms and clamps its q, k and v).
static int full_norms_and_clip(const spnl_step_args *s, const spnl_layer_args *l,
                               int64_t q_size, int64_t kv_size) {
    const int64_t width = q_size + 2 * kv_size;
    for (int64_t t = 0; l->qk_full && t < s->tokens; t++) {
        float *q = s->qkv + t * width, *k = q + q_size;
        int status = spnl_rms_norm(q, l->q_norm, q, 1, q_size, l->eps);
        if (status || (status = spnl_rms_norm(k, l->k_norm, k, 1, kv_size, l->eps))) return status;
    }
    const float top = l->clip, bottom = -l->clip;
    for (int64_t i = 0; l->has_clip && i < s->tokens * width; i++) {
        const float v = s->qkv[i];
        s->qkv[i] = v < bottom ? bottom : v > top ? top : v;  // NaN stays NaN, as torch's clamp
    }
    return 0;
}

// h (the input norm's output) -> attention -> x += ..., h = the MLP's input norm ->
// gate_up = the gate and up products of h (a dense layer's).
int spnl_attention_block(const spnl_step_args *s, const spnl_layer_args *l) {
    const int64_t tokens = s->tokens, q_size = l->heads * l->head_dim;
    const int64_t kv_size = l->kv_heads * l->head_dim, width = q_size + 2 * kv_size;
    if (tokens < 1 || l->hidden < 1 || (!l->moe && l->inner < 1) || l->heads < 1 ||
        l->kv_heads < 1 || l->head_dim < 1 || l->local < 0 || l->local > 1)
        return BAD_ARGUMENT;
    int status = spnl_qmatmul(l->qkv, s->h, tokens, l->hidden, s->qkv, width, s->threads,
                              s->exact);
    if (status) return status;
    const int64_t hidden = l->hidden;
    if ((status = lora(s, l, LORA_Q, s->h, hidden, hidden, s->qkv, width, q_size)) ||
        (status = lora(s, l, LORA_K, s->h, hidden, hidden, s->qkv + q_size, width, kv_size)) ||
        (status = lora(s, l, LORA_V, s->h, hidden, hidden, s->qkv + q_size + kv_size, width,
                       kv_size)))
        return status;
    if ((status = full_norms_and_clip(s, l, q_size, kv_size))) return status;
    const spnl_qk_args qk = {
        .q = s->qkv, .k = s->qkv + q_size, .q_row = width, .k_row = width, .tokens = tokens,
        .heads = l->heads, .kv_heads = l->kv_heads, .head_dim = l->head_dim,
        .rotary_dim = s->rotary_dim[l->local], .q_scale = l->qk_full ? NULL : l->q_norm,
        .k_scale = l->qk_full ? NULL : l->k_norm,
        .eps = l->eps, .cos = s->cos[l->local], .sin = s->sin[l->local],
    };
    if ((status = spnl_qk_norm_rope(&qk, s->threads))) return status;
    // q, k and v each made contiguous, as the per-op path's views are before their kernels
    float *q = s->q, *k = s->kv, *v = s->kv + tokens * kv_size;
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = s->qkv + t * width;
        memcpy(q + t * q_size, row, q_size * sizeof(float));
        memcpy(k + t * kv_size, row + q_size, kv_size * sizeof(float));
        memcpy(v + t * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
    }
    const int own_pool = s->window_slot_mapping != NULL && l->scoring.window > 0;
    const int64_t *slot_mapping = own_pool ? s->window_slot_mapping : s->slot_mapping;
    const int64_t num_slots = own_pool ? s->window_num_slots : s->num_slots;
    status = spnl_store_kv(k, v, l->k_cache, l->v_cache, slot_mapping, tokens, kv_size,
                           num_slots, l->half);
    if (status) return status;
    spnl_paged_decode_args attention = {
        .at = s->windowed && l->scoring.window > 0 ? s->at_windowed : s->at,
        .q = q, .k_cache = l->k_cache, .v_cache = l->v_cache, .half = l->half};
    attention.at.heads = l->heads;
    attention.at.kv_heads = l->kv_heads;
    attention.at.dim = l->head_dim;
    attention.at.num_slots = num_slots;
    attention.at.scoring = l->scoring;
    attention.at.out = s->attn;
    attention.at.threads = s->threads;
    if ((status = spnl_paged_decode(&attention))) return status;
    status = spnl_qmatmul(l->o, s->attn, tokens, q_size, s->out, l->hidden, s->threads,
                          s->exact);
    if (status) return status;
    if ((status = lora(s, l, LORA_O, s->attn, q_size, q_size, s->out, hidden, hidden)))
        return status;
    if ((status = add_norm(s, l, s->out, l->attn_delta_norm, l->attn_out_norm))) return status;
    if (l->moe) return 0;
    const int64_t inner = l->inner;
    status = spnl_qmatmul(l->gate_up, s->h, tokens, hidden, s->gate_up, 2 * inner, s->threads,
                          s->exact);
    if (status) return status;
    if ((status = lora(s, l, LORA_GATE, s->h, hidden, hidden, s->gate_up, 2 * inner, inner)))
        return status;
    return lora(s, l, LORA_UP, s->h, hidden, hidden, s->gate_up + inner, 2 * inner, inner);
}

// gate_up -> act (the activated gate times up) -> the down product -> x += ...,
// h = the next norm.
int spnl_mlp_block(const spnl_step_args *s, const spnl_layer_args *l) {
    if (s->tokens < 1 || l->hidden < 1 || l->inner < 1 || l->moe) return BAD_ARGUMENT;
    const int64_t inner = l->inner;
    int status = spnl_gated_act(l->act, s->gate_up, s->gate_up + inner, s->tokens, inner,
                                2 * inner, 2 * inner, s->act, s->threads);
    if (status) return status;
    status = spnl_qmatmul(l->down, s->act, s->tokens, l->inner, s->out, l->hidden, s->threads,
                          s->exact);
    if (status) return status;
    status = lora(s, l, LORA_DOWN, s->act, l->inner, l->inner, s->out, l->hidden, l->hidden);
    if (status) return status;
    return add_norm(s, l, s->out, l->mlp_delta_norm, l->mlp_out_norm);
}

// h (the MLP's input norm) -> the experts -> x += ..., h = the next norm.
int spnl_moe_block(const spnl_step_args *s, const spnl_layer_args *l) {
    if (!l->moe || l->moe->hidden != l->hidden) return BAD_ARGUMENT;
    const int status = spnl_moe(l->moe, s->h, s->tokens, s->out, s->scratch, s->scratch_bytes,
                                s->threads, s->exact);
    if (status) return status;
    return add_norm(s, l, s->out, l->mlp_delta_norm, l->mlp_out_norm);
}

// Every layer of a step in order, each its attention block, then its MoE block where it has
// experts, else its MLP block: the calls a caller would make one by one, in one call (a
// decode step's Python then makes one call, not two per layer). On a failure *failed is
// the call that failed (2 * layer, plus 1 for the layer's MLP or MoE block) and its
// status is returned; the layers after it are not run.
int spnl_layers(const spnl_step_args *s, const spnl_layer_args *layers, int64_t count,
                int64_t *failed) {
    if (count < 0 || (count && !layers) || !failed) return BAD_ARGUMENT;
    for (int64_t i = 0; i < count; i++) {
        const spnl_layer_args *l = layers + i;
        int status = spnl_attention_block(s, l);
        if (status) {
            *failed = 2 * i;
            return status;
        }
        status = l->moe ? spnl_moe_block(s, l) : spnl_mlp_block(s, l);
        if (status) {
            *failed = 2 * i + 1;
            return status;
        }
    }
    return 0;
}
