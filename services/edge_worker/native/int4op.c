// onnxruntime custom op "meshserve.edge:Int4MatMul" over kq4.c: Y[..., N] = A[..., K] @ W^T + bias, W packed by
// services/edge_worker/native/kernel.py (pack_weights). Inputs: A float32 [..., K] (leading dims flattened to M
// rows), W uint8 (the packed layout), bias float32 [N]. Attributes: K, N, threads (the session's, >= 1), bits
// (4 or 8, the weights' width and so their packed layout; absent means 4, as in graphs edited before it existed),
// act (absent or 0: as above; 1: SwiGLU, the MLP's gate and up projections in one op, their 8-column groups
// alternating in W and bias, Y [..., N/2] = silu(gate) * up).
// Built into one library with kq4.c (kernel.py); onnxruntime loads it through
// SessionOptions.register_custom_ops_library, which calls RegisterCustomOps below.
//
// The onnxruntime C API declarations are our own (ortapi.h, shared with attn.c): no header ships with the wheel.
// Threads: KernelContext_ParallelFor hands chunks of the N/8 column groups to the session's intra-op threads;
// every output element is computed whole by one thread, so a row's values do not depend on M or on the
// thread count. (A pool of the op's own threads was tried first: about as fast, more code, docs/edge.md.)
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void quantize_rows(const float* A, int M, int K, int8_t* qa, float* sa, float* sasum);
void gemm_q_groups(const int8_t* qa, const float* sa, const float* sasum, int M, int K, const uint8_t* pw, int N,
                   float* C, int g0, int g1);
void gemm_q8_groups(const int8_t* qa, const float* sa, const float* sasum, int M, int K, const uint8_t* pw, int N,
                    float* C, int g0, int g1);
int grp_bytes(void);
int grp8_bytes(void);

typedef void (*GemmGroups)(const int8_t* qa, const float* sa, const float* sasum, int M, int K, const uint8_t* pw,
                           int N, float* C, int g0, int g1);

#include "ortapi.h"
#include "avxmath.h"

#define API_VERSION 18  // of the OrtApi table: KernelContext_ParallelFor came with 18, the rest with 1
#define MAX_DIMS 8

static const OrtApi* api;

// ---- the op ----

typedef struct {
    int64_t K, N, threads;  // threads: the session's intra-op threads (the columns go out in 4 chunks per thread)
    int64_t bits;           // 4 or 8
    GemmGroups gemm;        // gemm_q_groups (4 bits) or gemm_q8_groups (8 bits)
    int64_t w_bytes;        // the packed weights' size: N/8 * K/32 blocks of grp_bytes() or grp8_bytes()
    int64_t act;            // 0: Y = A W^T + bias; 1 (SwiGLU): column groups alternate gate and up (8 columns
                            // each), Y [.., N/2] = silu(gate) * up, each with its bias (the MLP's gate and up
                            // projections and their activation in one op)
} Kernel;

typedef struct {
    const int8_t* qa;
    const float *sa, *sasum;
    const uint8_t* pw;
    float* C;
    int M, K, N, groups, chunk;
    GemmGroups gemm;
    float* out;         // act 1: the [M, N/2] output (C is then a scratch buffer)
    const float* bias;  // added by each chunk to its own columns (act 1: in the SwiGLU epilogue)
} PoolJob;

// SwiGLU epilogue over the group pairs [g0/2, g1/2) (g0, g1 even): out = silu(gate + bias) * (up + bias), in the
// order of the graph it replaces (Sigmoid, then Mul(gate, sigmoid), then Mul(that, up)); row by row, 8 columns
// (one group) at a time.
static void swiglu_groups(const PoolJob* j, int g0, int g1) {
    const int N = j->N, half = N / 2;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < j->M; m++) {
        const float* row = j->C + (size_t)m * N;
        float* out = j->out + (size_t)m * half;
        for (int p = g0 / 2; p < g1 / 2; p++) {
            __m256 g = _mm256_add_ps(_mm256_loadu_ps(row + 16 * p), _mm256_loadu_ps(j->bias + 16 * p));
            __m256 u = _mm256_add_ps(_mm256_loadu_ps(row + 16 * p + 8), _mm256_loadu_ps(j->bias + 16 * p + 8));
            __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign))));
            _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(_mm256_mul_ps(g, s), u));
        }
    }
}

static void pool_chunk(void* data, size_t index) {
    const PoolJob* j = data;
    int g0 = (int)index * j->chunk;
    int g1 = g0 + j->chunk < j->groups ? g0 + j->chunk : j->groups;
    if (g0 < g1) {
        j->gemm(j->qa, j->sa, j->sasum, j->M, j->K, j->pw, j->N, j->C, g0, g1);
        if (j->out != NULL) {
            swiglu_groups(j, g0, g1);
        } else {  // Y = (A W^T) + bias, the sum after the product as before, on the chunk's own columns
            for (int m = 0; m < j->M; m++) {
                float* row = j->C + (size_t)m * j->N;
                for (int n = 8 * g0; n < 8 * g1; n += 8)
                    _mm256_storeu_ps(row + n, _mm256_add_ps(_mm256_loadu_ps(row + n), _mm256_loadu_ps(j->bias + n)));
            }
        }
    }
}

static OrtStatus* fail(const char* message) { return api->CreateStatus(ORT_FAIL, message); }

#define TRY(call)                             \
    do {                                      \
        OrtStatus* status_ = (call);          \
        if (status_ != NULL) return status_;  \
    } while (0)

static OrtStatus* create_kernel2(const OrtCustomOp* op, const OrtApi* a, const OrtKernelInfo* info, void** out) {
    (void)op;
    Kernel* k = calloc(1, sizeof(Kernel));
    if (k == NULL) return fail("meshserve Int4MatMul: out of memory");
    OrtStatus* status = a->KernelInfoGetAttribute_int64(info, "K", &k->K);
    if (status == NULL) status = a->KernelInfoGetAttribute_int64(info, "N", &k->N);
    if (status == NULL) status = a->KernelInfoGetAttribute_int64(info, "threads", &k->threads);
    if (status == NULL) {
        OrtStatus* absent = a->KernelInfoGetAttribute_int64(info, "bits", &k->bits);
        if (absent != NULL) {
            a->ReleaseStatus(absent);
            k->bits = 4;
        }
    }
    if (status == NULL) {
        OrtStatus* absent = a->KernelInfoGetAttribute_int64(info, "act", &k->act);
        if (absent != NULL) {
            a->ReleaseStatus(absent);
            k->act = 0;
        }
    }
    if (status == NULL && (k->K <= 0 || k->K % 32 || k->N <= 0 || k->N % 8))
        status = fail("meshserve Int4MatMul: K must be a positive multiple of 32 and N of 8");
    if (status == NULL && k->act != 0 && (k->act != 1 || k->N % 16))
        status = fail("meshserve Int4MatMul: act must be 0, or 1 (SwiGLU) with N a multiple of 16");
    if (status == NULL && k->bits != 4 && k->bits != 8) status = fail("meshserve Int4MatMul: bits must be 4 or 8");
    if (status != NULL) {
        free(k);
        return status;
    }
    if (k->threads < 1) k->threads = 1;
    k->gemm = k->bits == 8 ? gemm_q8_groups : gemm_q_groups;
    k->w_bytes = k->N / 8 * (k->K / 32) * (k->bits == 8 ? grp8_bytes() : grp_bytes());
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
    const OrtValue *a_value, *w_value, *bias_value;
    TRY(api->KernelContext_GetInput(context, 0, &a_value));
    TRY(api->KernelContext_GetInput(context, 1, &w_value));
    TRY(api->KernelContext_GetInput(context, 2, &bias_value));
    OrtTensorTypeAndShapeInfo* shape;
    TRY(api->GetTensorTypeAndShape(a_value, &shape));
    size_t rank = 0;
    int64_t dims[MAX_DIMS];
    OrtStatus* status = api->GetDimensionsCount(shape, &rank);
    if (status == NULL && (rank < 1 || rank > MAX_DIMS)) status = fail("meshserve Int4MatMul: A must have 1 to 8 dims");
    if (status == NULL) status = api->GetDimensions(shape, dims, rank);
    api->ReleaseTensorTypeAndShapeInfo(shape);
    if (status != NULL) return status;
    // the weights must hold exactly the packed layout of K, N and bits (a mismatch would read out of bounds)
    int64_t w_dims[MAX_DIMS], w_size = 1;
    size_t w_rank = 0;
    TRY(api->GetTensorTypeAndShape(w_value, &shape));
    status = api->GetDimensionsCount(shape, &w_rank);
    if (status == NULL && (w_rank < 1 || w_rank > MAX_DIMS))
        status = fail("meshserve Int4MatMul: W must have 1 to 8 dims");
    if (status == NULL) status = api->GetDimensions(shape, w_dims, w_rank);
    api->ReleaseTensorTypeAndShapeInfo(shape);
    if (status != NULL) return status;
    for (size_t i = 0; i < w_rank; i++) w_size *= w_dims[i];
    if (w_size != k->w_bytes) return fail("meshserve Int4MatMul: W's size is not the packed size of K, N and bits");
    int64_t M = 1;
    for (size_t i = 0; i + 1 < rank; i++) M *= dims[i];
    if (dims[rank - 1] != k->K) return fail("meshserve Int4MatMul: A's last dimension is not the weights' K");
    dims[rank - 1] = k->act ? k->N / 2 : k->N;
    OrtValue* out_value;
    TRY(api->KernelContext_GetOutput(context, 0, dims, rank, &out_value));
    float *A, *C, *bias;
    uint8_t* W;
    TRY(api->GetTensorMutableData((OrtValue*)a_value, (void**)&A));
    TRY(api->GetTensorMutableData((OrtValue*)w_value, (void**)&W));
    TRY(api->GetTensorMutableData((OrtValue*)bias_value, (void**)&bias));
    TRY(api->GetTensorMutableData(out_value, (void**)&C));
    if (M == 0) return NULL;
    const int K = (int)k->K, N = (int)k->N, nb = K / 32;
    int8_t* qa = malloc((size_t)M * K);
    float* sa = malloc(sizeof(float) * (size_t)M * nb * 2);
    float* scratch = k->act ? malloc(sizeof(float) * (size_t)M * N) : NULL;
    if (qa == NULL || sa == NULL || (k->act && scratch == NULL)) {
        free(qa);
        free(sa);
        free(scratch);
        return fail("meshserve Int4MatMul: out of memory for the quantized activations");
    }
    quantize_rows(A, (int)M, K, qa, sa, sa + M * nb);
    // the column groups in chunks on onnxruntime's intra-op threads (the calling thread included)
    int groups = N / 8, chunks = 4 * (int)k->threads;
    int chunk = (groups + chunks - 1) / chunks;
    if (k->act) chunk += chunk % 2;  // a chunk holds whole (gate, up) group pairs: its epilogue needs both
    PoolJob job = {qa, sa, sa + M * nb, W, k->act ? scratch : C, (int)M, K, N, groups, chunk, k->gemm,
                   k->act ? C : NULL, bias};
    status = api->KernelContext_ParallelFor(context, pool_chunk, (size_t)((groups + chunk - 1) / chunk), 0, &job);
    free(qa);
    free(sa);
    free(scratch);
    return status;
}

static void compute(void* kernel, OrtKernelContext* context) {
    OrtStatus* status = compute2(kernel, context);
    if (status != NULL) {
        fprintf(stderr, "%s\n", api->GetErrorMessage(status));
        api->ReleaseStatus(status);
    }
}

static void destroy(void* kernel) { free(kernel); }
static const char* op_name(const OrtCustomOp* op) { (void)op; return "Int4MatMul"; }
static int input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 1 ? ELEM_UINT8 : ELEM_FLOAT; }
static size_t input_count(const OrtCustomOp* op) { (void)op; return 3; }
static size_t output_count(const OrtCustomOp* op) { (void)op; return 1; }

static OrtCustomOp int4_matmul = {
    OP_VERSION, create_kernel, op_name, op_provider, input_type, input_count, output_type, output_count, compute,
    destroy, required, required, default_memory, one, one, one, one, create_kernel2, compute2, NULL, start_version,
    end_version, no_pairs, release_pairs, no_pairs, release_pairs};

OrtCustomOp* meshserve_attention_op(void);  // attn.c: "meshserve.edge:Attention"

OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
    api = base->GetApi(API_VERSION);
    if (api == NULL) return NULL;  // cannot happen: every onnxruntime serves version 1
    OrtCustomOpDomain* domain;
    OrtStatus* status = api->CreateCustomOpDomain("meshserve.edge", &domain);
    if (status == NULL) status = api->CustomOpDomain_Add(domain, &int4_matmul);
    if (status == NULL) status = api->CustomOpDomain_Add(domain, meshserve_attention_op());
    if (status == NULL) status = api->AddCustomOpDomain(options, domain);
    return status;  // the domain is kept for the life of the process (sessions hold it)
}

// Smoke test of the table positions used (tests): CreateStatus (0) and GetErrorMessage (2) round trip.
int ort_api_check(const OrtApiBase* base) {
    const OrtApi* a = base->GetApi(API_VERSION);
    OrtStatus* s = a->CreateStatus(ORT_FAIL, "meshserve");
    int good = strcmp(a->GetErrorMessage(s), "meshserve") == 0;
    a->ReleaseStatus(s);
    return good;
}
