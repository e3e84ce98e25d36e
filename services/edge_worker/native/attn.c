// onnxruntime custom op "meshserve.edge:Attention": com.microsoft GroupQueryAttention (fp32, packed QKV, rotary
// non-interleaved over the whole head, no local window, no softcap) for past and present KV in ONE buffer, as the
// batched edge engine binds them (services/edge_worker/kvslots.py). AVX2 + FMA; built into the library of kq4.c and
// int4op.c (kernel.py), registered next to Int4MatMul by RegisterCustomOps in int4op.c.
//
// Why our own: onnxruntime's CPU GroupQueryAttention runs one generic SGEMM per (row, head) for Q K^T and one for
// P V, which at one query position (decode) is overhead-bound (docs/edge.md).
//
// Inputs: 0 qkv float [B, S, (H + 2 KV) * D] (per position: H query heads, then KV key heads, then KV value
// heads, D each); 1 past_key, 2 past_value float [B, KV, C, D]; 3 seqlens_k int32 [B] (total length - 1 per
// row); 4 total_sequence_length int32 (one element); 5 cos_cache, 6 sin_cache float [P, D / 2].
// Outputs: 0 float [B, S, H * D]; 1 present_key, 2 present_value: the same buffers as inputs 1 and 2 (required;
// the op fails otherwise). Attributes: num_heads H, kv_num_heads KV, scale (0: 1 / sqrt(D)).
// Semantics (onnxruntime's for the cases the engine runs): row b has total length T = seqlens_k[b] + 1 and past
// length L = T - S (>= 0; T <= total_sequence_length <= C, T <= P). Position s of the chunk is at L + s: its key
// and query are rotated with cos/sin row L + s (x1 = x[i], x2 = x[i + D/2]: x1 c - x2 s, x2 c + x1 s), its key
// and value are written at L + s, and query head h (kv head h / (H / KV)) attends to positions 0 .. L + s
// (causal within the chunk): softmax(scale * q . k) . v with the row's maximum subtracted.
// onnxruntime itself takes L = 0 for a first prompt (S == total_sequence_length) and refuses S > 1 with past
// unless B == 1; the checks below make both agree wherever onnxruntime runs (T <= total, L >= 0).
//
// Work: items of (row, kv head, up to 16 query positions), on onnxruntime's intra-op threads through
// KernelContext_ParallelFor (small calls on the calling thread alone); an item visits K and V in tiles of 64 rows
// that all its query heads use while the tile is in L1.
// Row invariance: each item is computed by the same instruction sequence whatever the batch holds; every sum runs
// in an order fixed by the row's own length (dot products: 8-lane FMA chains over D reduced by one fixed tree, the
// last keys copied into a zero-padded block of 8; P V: one FMA chain per 8 lanes in key order, tiles or not). So a
// row's output and KV are bit-identical alone or with other rows and at any thread count, and a position's output
// is the same whether its prompt came in one chunk or several.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ortapi.h"
#include "avxmath.h"

#define MAX_HEAD 256   // D
#define QBLOCK 16      // query positions per work item of a prefill chunk
// Below this many (query head, key) pairs a call runs on the calling thread alone: waking onnxruntime's sleeping
// pool costs more (one decode row at 100 positions, 909 pairs: 12 us alone vs 21 us with a second thread, measured
// on the 2-core build machine); the items are the same either way, so the bits are too.
#define SERIAL_PAIRS 4096
#define KTILE 64       // keys per tile: a tile of K (or V) rows, 16 KiB at D = 64, stays in L1 for a block's queries

// ---- math (exp8: avxmath.h) ----

// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): the order reduce8 gives each of its lanes.
static inline float tree8(__m256 v) {
    float a[8];
    _mm256_storeu_ps(a, v);
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// Lane j = tree8(acc[j]), for 8 accumulators at once.
static inline __m256 reduce8(const __m256* acc) {
    __m256 r01 = _mm256_hadd_ps(acc[0], acc[1]), r23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 r45 = _mm256_hadd_ps(acc[4], acc[5]), r67 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 s03 = _mm256_hadd_ps(r01, r23), s47 = _mm256_hadd_ps(r45, r67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20), _mm256_permute2f128_ps(s03, s47, 0x31));
}

// out = x rotated by (cos, sin) of one position, non-interleaved halves; x and out may not overlap.
static inline void rotate(const float* x, const float* cs, const float* sn, int half, float* out) {
    for (int i = 0; i < half; i += 8) {
        __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(sn + i);
        _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
        _mm256_storeu_ps(out + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
    }
}

// scores[0..8) = q . k[j] for 8 keys of nc * 8 floats each (rows of k, nc*8 apart), each an FMA chain over the
// chunks reduced by the tree8 order.
static inline __attribute__((always_inline)) void qk8(const float* q, const float* k, int nc, float* scores) {
    __m256 acc[8];
    const int d = nc * 8;
    for (int j = 0; j < 8; j++) acc[j] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k + j * d));
    for (int c = 1; c < nc; c++) {
        __m256 qc = _mm256_loadu_ps(q + c * 8);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + j * d + c * 8), acc[j]);
    }
    _mm256_storeu_ps(scores, reduce8(acc));
}

// scores[t] = q . K[t] for t in [t0, min(t1, T)), in blocks of 8 (t0 a multiple of 8); a block crossing T is
// copied into a zero-padded block of 8 so its keys go through the same arithmetic (and no row past T is read).
static inline __attribute__((always_inline)) void qk_range(const float* q, const float* K, int t0, int t1, int T,
                                                            int nc, float* scores) {
    const int d = nc * 8;
    for (int t = t0; t < t1 && t < T; t += 8) {
        if (t + 8 <= T) {
            qk8(q, K + (size_t)t * d, nc, scores + t);
        } else {
            float tail[8 * MAX_HEAD];
            memcpy(tail, K + (size_t)t * d, sizeof(float) * (size_t)(T - t) * d);
            memset(tail + (T - t) * d, 0, sizeof(float) * (size_t)(8 - (T - t)) * d);
            qk8(q, tail, nc, scores + t);
        }
    }
}

// scores[0..T) = exp(scale * scores - max) in place; returns 1 / their sum (tree8 of 8 lane sums).
static inline float softmax(float* scores, int T, float scale) {
    const int full = T & ~7;
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(T - full), lane);  // the last block's lanes < T
    for (int t = 0; t < full; t += 8) {
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scores + t), vscale);
        _mm256_storeu_ps(scores + t, s);
        vmax = _mm256_max_ps(vmax, s);
    }
    if (full < T) {
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scores + full), vscale);
        s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(valid));
        _mm256_storeu_ps(scores + full, s);
        vmax = _mm256_max_ps(vmax, s);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 vsum = _mm256_setzero_ps();
    for (int t = 0; t < full; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mx));
        _mm256_storeu_ps(scores + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (full < T) {
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + full), mx)), _mm256_castsi256_ps(valid));
        _mm256_storeu_ps(scores + full, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    return 1.0f / tree8(vsum);
}

// acc[D] += sum of p[t] V[t] for t in [t0, t1), one FMA chain per 8 lanes in t order (so cutting the keys into
// tiles does not change a bit).
static inline __attribute__((always_inline)) void pv_range(const float* p, const float* V, int t0, int t1, int nc,
                                                            float* acc) {
    const int d = nc * 8;
    if (nc == 8) {  // the model's D = 64: the 8 accumulators stay in registers
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(acc + c * 8);
        for (int t = t0; t < t1; t++) {
            const __m256 pt = _mm256_broadcast_ss(p + t);
            const float* v = V + (size_t)t * 64;
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + c * 8), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + c * 8, a[c]);
    } else {
        for (int c = 0; c < nc; c++) {
            __m256 a = _mm256_loadu_ps(acc + c * 8);
            for (int t = t0; t < t1; t++)
                a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_loadu_ps(V + (size_t)t * d + c * 8), a);
            _mm256_storeu_ps(acc + c * 8, a);
        }
    }
}

// ---- the op ----

typedef struct {
    const OrtApi* api;
    int64_t heads, kv_heads;
    float scale;
} Kernel;

typedef struct {
    const float* qkv;
    float *key, *value, *out;  // key/value: the shared past/present buffers
    const float *cos, *sin;
    const int32_t* seqlens;
    int S, H, KV, D, C, blocks;
    float scale;
    int failed;  // set by an item that could not get its scratch memory
} Job;

// One item: row b, kv head kv, query positions [s0, s1) of the chunk, each with the kv head's query heads (QH
// query-heads). Keys and values are visited in tiles of KTILE rows that every query-head uses while they are in
// L1 (a prefill chunk's queries share them); per query-head: scores, softmax over its own length, then P V.
static inline __attribute__((always_inline)) void run_block(const Job* j, int b, int kv, int s0, int s1, int nc,
                                                             float* work) {
    const int D = nc * 8, half = D / 2, group = j->H / j->KV, width = (j->H + 2 * j->KV) * D;
    const int QH = (s1 - s0) * group, past = j->seqlens[b] + 1 - j->S, Tmax = past + s1, stride = (j->C + 7) & ~7;
    const float* K = j->key + ((size_t)b * j->KV + kv) * j->C * D;
    const float* V = j->value + ((size_t)b * j->KV + kv) * j->C * D;
    float *q = work, *acc = q + (size_t)QH * D, *inv = acc + (size_t)QH * D, *scores = inv + QH;
    for (int i = 0; i < QH; i++) {
        const int s = s0 + i / group, h = kv * group + i % group, pos = past + s;
        const float* row = j->qkv + ((size_t)b * j->S + s) * width;
        rotate(row + h * D, j->cos + (size_t)pos * half, j->sin + (size_t)pos * half, half, q + (size_t)i * D);
    }
    for (int t0 = 0; t0 < Tmax; t0 += KTILE)
        for (int i = 0; i < QH; i++) {
            const int T = past + s0 + i / group + 1;
            if (T > t0) qk_range(q + (size_t)i * D, K, t0, t0 + KTILE, T, nc, scores + (size_t)i * stride);
        }
    for (int i = 0; i < QH; i++) inv[i] = softmax(scores + (size_t)i * stride, past + s0 + i / group + 1, j->scale);
    memset(acc, 0, sizeof(float) * (size_t)QH * D);
    for (int t0 = 0; t0 < Tmax; t0 += KTILE)
        for (int i = 0; i < QH; i++) {
            const int T = past + s0 + i / group + 1;
            if (T > t0)
                pv_range(scores + (size_t)i * stride, V, t0, T < t0 + KTILE ? T : t0 + KTILE, nc, acc + (size_t)i * D);
        }
    for (int i = 0; i < QH; i++) {
        const int s = s0 + i / group, h = kv * group + i % group;
        float* out = j->out + (((size_t)b * j->S + s) * j->H + h) * D;
        const __m256 scale = _mm256_set1_ps(inv[i]);
        for (int c = 0; c < D; c += 8)
            _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)i * D + c), scale));
    }
}

static void run_item(void* data, size_t index) {
    Job* j = data;
    const int items_per_row = j->KV * j->blocks;
    const int b = (int)index / items_per_row, rest = (int)index % items_per_row;
    const int kv = rest / j->blocks, block = rest % j->blocks;
    const int s0 = block * QBLOCK, s1 = s0 + QBLOCK < j->S ? s0 + QBLOCK : j->S;
    const size_t QH = (size_t)(s1 - s0) * (j->H / j->KV);
    float* work = malloc(sizeof(float) * QH * (2 * (size_t)j->D + 1 + (size_t)((j->C + 7) & ~7)));
    if (work == NULL) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    if (j->D == 64)
        run_block(j, b, kv, s0, s1, 8, work);
    else
        run_block(j, b, kv, s0, s1, j->D / 8, work);
    free(work);
}

#define TRY(call)                             \
    do {                                      \
        OrtStatus* status_ = (call);          \
        if (status_ != NULL) return status_;  \
    } while (0)

static OrtStatus* fail(const OrtApi* api, const char* message) { return api->CreateStatus(ORT_FAIL, message); }

static OrtStatus* dims_of(const OrtApi* api, const OrtValue* value, int64_t* dims, size_t* rank) {
    OrtTensorTypeAndShapeInfo* shape;
    TRY(api->GetTensorTypeAndShape(value, &shape));
    OrtStatus* status = api->GetDimensionsCount(shape, rank);
    if (status == NULL && *rank > 4) status = fail(api, "meshserve Attention: an input has more than 4 dimensions");
    if (status == NULL) status = api->GetDimensions(shape, dims, *rank);
    api->ReleaseTensorTypeAndShapeInfo(shape);
    return status;
}

static OrtStatus* create_kernel2(const OrtCustomOp* op, const OrtApi* a, const OrtKernelInfo* info, void** out) {
    (void)op;
    Kernel* k = calloc(1, sizeof(Kernel));
    if (k == NULL) return a->CreateStatus(ORT_FAIL, "meshserve Attention: out of memory");
    k->api = a;
    OrtStatus* status = a->KernelInfoGetAttribute_int64(info, "num_heads", &k->heads);
    if (status == NULL) status = a->KernelInfoGetAttribute_int64(info, "kv_num_heads", &k->kv_heads);
    if (status == NULL) status = a->KernelInfoGetAttribute_float(info, "scale", &k->scale);
    if (status == NULL && (k->heads <= 0 || k->kv_heads <= 0 || k->heads % k->kv_heads))
        status = fail(a, "meshserve Attention: num_heads must be a positive multiple of kv_num_heads");
    if (status != NULL) {
        free(k);
        return status;
    }
    *out = k;
    return NULL;
}

static void* create_kernel(const OrtCustomOp* op, const OrtApi* a, const OrtKernelInfo* info) {
    void* k = NULL;
    OrtStatus* status = create_kernel2(op, a, info, &k);
    if (status != NULL) a->ReleaseStatus(status);
    return k;
}

static OrtStatus* compute2(void* kernel, OrtKernelContext* context) {
    const Kernel* k = kernel;
    const OrtApi* api = k->api;
    const OrtValue* in[7];
    int64_t dims[7][4];
    size_t rank[7];
    for (size_t i = 0; i < 7; i++) {
        TRY(api->KernelContext_GetInput(context, i, &in[i]));
        if (in[i] == NULL) return fail(api, "meshserve Attention: all 7 inputs are required");
        TRY(dims_of(api, in[i], dims[i], &rank[i]));
    }
    const int64_t H = k->heads, KV = k->kv_heads;
    if (rank[0] != 3 || dims[0][2] % (H + 2 * KV))
        return fail(api, "meshserve Attention: qkv must be [batch, sequence, (num_heads + 2 kv_num_heads) * head_size]");
    const int64_t B = dims[0][0], S = dims[0][1], D = dims[0][2] / (H + 2 * KV);
    if (D % 16 || D > MAX_HEAD) return fail(api, "meshserve Attention: head_size must be a multiple of 16 up to 256");
    for (int i = 1; i <= 2; i++)
        if (rank[i] != 4 || dims[i][0] != B || dims[i][1] != KV || dims[i][3] != D || dims[i][2] != dims[1][2])
            return fail(api, "meshserve Attention: past_key and past_value must be [batch, kv_num_heads, capacity, "
                             "head_size], the same for both");
    const int64_t C = dims[1][2];
    if (rank[3] != 1 || dims[3][0] != B) return fail(api, "meshserve Attention: seqlens_k must be int32 [batch]");
    if (!(rank[4] == 0 || (rank[4] == 1 && dims[4][0] == 1)))
        return fail(api, "meshserve Attention: total_sequence_length must hold one int32");
    for (int i = 5; i <= 6; i++)
        if (rank[i] != 2 || dims[i][1] * 2 != D || dims[i][0] != dims[5][0])
            return fail(api, "meshserve Attention: cos_cache and sin_cache must be [positions, head_size / 2] (rotary "
                             "over the whole head)");
    const int64_t P = dims[5][0];
    float *qkv, *past_key, *past_value, *cos, *sin, *out, *key, *value;
    int32_t *seqlens, *total;
    TRY(api->GetTensorMutableData((OrtValue*)in[0], (void**)&qkv));
    TRY(api->GetTensorMutableData((OrtValue*)in[1], (void**)&past_key));
    TRY(api->GetTensorMutableData((OrtValue*)in[2], (void**)&past_value));
    TRY(api->GetTensorMutableData((OrtValue*)in[3], (void**)&seqlens));
    TRY(api->GetTensorMutableData((OrtValue*)in[4], (void**)&total));
    TRY(api->GetTensorMutableData((OrtValue*)in[5], (void**)&cos));
    TRY(api->GetTensorMutableData((OrtValue*)in[6], (void**)&sin));
    const int64_t out_dims[3] = {B, S, H * D};
    OrtValue *out_value, *key_value, *value_value;
    TRY(api->KernelContext_GetOutput(context, 0, out_dims, 3, &out_value));
    TRY(api->KernelContext_GetOutput(context, 1, dims[1], 4, &key_value));
    TRY(api->KernelContext_GetOutput(context, 2, dims[2], 4, &value_value));
    TRY(api->GetTensorMutableData(out_value, (void**)&out));
    TRY(api->GetTensorMutableData(key_value, (void**)&key));
    TRY(api->GetTensorMutableData(value_value, (void**)&value));
    if (B * C > 0 && (key != past_key || value != past_value))
        return fail(api, "meshserve Attention: present_key/present_value must be the same buffers as past_key/"
                         "past_value (bind one OrtValue as both, as the edge engine's KvSlots do)");
    if (B == 0 || S == 0) return NULL;
    if (*total > C) return fail(api, "meshserve Attention: total_sequence_length exceeds the KV buffer's capacity");
    for (int64_t b = 0; b < B; b++) {
        const int64_t T = (int64_t)seqlens[b] + 1;
        if (T < S || T > *total)
            return fail(api, "meshserve Attention: each seqlens_k + 1 must be at least the query length and at most "
                             "total_sequence_length (right-padded or left-padded rows are not supported)");
        if (T > P) return fail(api, "meshserve Attention: a position is past the end of cos_cache");
    }
    // the chunk's keys (rotated) and values into the shared buffers first: its queries attend to them
    const int half = (int)D / 2, width = (int)((H + 2 * KV) * D);
    for (int64_t b = 0; b < B; b++) {
        const int64_t past = (int64_t)seqlens[b] + 1 - S;
        for (int64_t s = 0; s < S; s++) {
            const float* row = qkv + (b * S + s) * width;
            const int64_t pos = past + s;
            for (int64_t j = 0; j < KV; j++) {
                const size_t at = (size_t)(((b * KV + j) * C + pos) * D);
                rotate(row + (H + j) * D, cos + pos * half, sin + pos * half, half, key + at);
                memcpy(value + at, row + (H + KV + j) * D, sizeof(float) * (size_t)D);
            }
        }
    }
    const int blocks = (int)((S + QBLOCK - 1) / QBLOCK);
    const size_t items = (size_t)(B * KV * blocks);
    Job job = {qkv, key, value, out, cos, sin, seqlens, (int)S, (int)H, (int)KV, (int)D, (int)C, blocks,
               k->scale != 0.f ? k->scale : 1.0f / sqrtf((float)D), 0};
    int64_t pairs = 0;  // (query head, key) pairs: the work, to decide whether waking the pool pays
    for (int64_t b = 0; b < B; b++) pairs += H * S * ((int64_t)seqlens[b] + 1);
    if (pairs < SERIAL_PAIRS) {
        for (size_t i = 0; i < items; i++) run_item(&job, i);
    } else {
        TRY(api->KernelContext_ParallelFor(context, run_item, items, 0, &job));
    }
    if (__atomic_load_n(&job.failed, __ATOMIC_RELAXED))
        return fail(api, "meshserve Attention: out of memory for the attention scores");
    return NULL;
}

static void compute(void* kernel, OrtKernelContext* context) {
    const Kernel* k = kernel;
    OrtStatus* status = compute2(kernel, context);
    if (status != NULL) {
        fprintf(stderr, "%s\n", k->api->GetErrorMessage(status));
        k->api->ReleaseStatus(status);
    }
}

static void destroy(void* kernel) { free(kernel); }
static const char* op_name(const OrtCustomOp* op) { (void)op; return "Attention"; }
static int input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 3 || i == 4 ? ELEM_INT32 : ELEM_FLOAT; }
static size_t input_count(const OrtCustomOp* op) { (void)op; return 7; }
static size_t output_count(const OrtCustomOp* op) { (void)op; return 3; }

static OrtCustomOp attention_op = {
    OP_VERSION, create_kernel, op_name, op_provider, input_type, input_count, output_type, output_count, compute,
    destroy, required, required, default_memory, one, one, one, one, create_kernel2, compute2, NULL, start_version,
    end_version, no_pairs, release_pairs, no_pairs, release_pairs};

// For RegisterCustomOps (int4op.c), which adds it to the "meshserve.edge" domain.
OrtCustomOp* meshserve_attention_op(void) { return &attention_op; }
