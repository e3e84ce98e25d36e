// Row-invariant int4-weight x int8-activation matmul (AVX2 + FMA, one thread): Y[M,N] = A[M,K] @ W[N,K]^T
// for onnxruntime MatMulNBits weights (4 bits, blocks of 32 along K, scales, 4-bit zero points; 8-bit
// weights too, below).
// Build: gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fPIC -shared (services/edge_worker/native/kernel.py).
//
// Weight layout: columns in groups of 8 (N % 8 == 0), each group's K/32 blocks in K order, one block of
// 8 columns x 32 k in GRP_BYTES = 148 bytes:
//   [0..127]   4 chunks c = 0..3 of 32 bytes; byte i: col = i/4, kk = i%4;
//              low nibble = q[col][4c+kk], high nibble = q[col][16+4c+kk]   (q in 0..15)
//   [128..143] fp16 sw[8]    weight scale per column: the model's fp32 scale rounded to the nearest fp16
//                            (relative change <= 2^-11)
//   [144..147] zero points, 4 bits per column: byte j holds column 2j (low nibble) and 2j+1 (high nibble)
// (fp32 scales and byte zero points took 168 bytes: a one-row decode step, which streams the weights from
// memory, reads 12 % more.)
// sw below is that fp16 value, converted exactly to fp32.
// Activation quantization (per row, per block of 32 k), the same as MLAS' int8 path:
//   amax = max|a|; inv = amax > 0 ? 127.f/amax : 0; qa = rint(a*inv) (nearest-even, fp32 multiply);
//   sa = amax/127.f; sasum = sa * (float)sum(qa).
// Result, in fp32, blocks b ascending:
//   Y[m,n] = sum_b cvt(dot_b) * (sw_b*sa_b)  +  sum_b -(sw_b*z_b) * sasum_b
//   where dot_b = sum_k q*qa (exact, int32), each sum one FMA chain, the two chains added at the end.
// 8-bit weights (MatMulNBits bits=8, blocks of 32, u8 zero points), one block of 8 columns x 32 k in
// GRP8_BYTES = 296 bytes:
//   [0..255]   8 chunks c = 0..7 of 32 bytes; byte i: col = i/4, kk = i%4; the byte = q[col][4c+kk] (0..255)
//   [256..287] float sw[8]; [288..295] uint8 z[8] (0..255)
// maddubs (u8 x s8, pair sums saturated to int16) cannot take full bytes times activations exactly
// (2 x 255 x 127 > 32767), so the weights are shifted to w = q - 128 (-128..127) and the products taken as
// |w| (0..128, unsigned) x sign(a, w) (a in -127..127, so its negation fits): pair sums <= 32512, exact.
// dot_b = sum w*qa, exact in int32, and the zero-point term uses (z - 128) in place of z:
//   Y[m,n] = sum_b cvt(dot_b) * (sw_b*sa_b)  +  sum_b -(sw_b*(z_b-128)) * sasum_b   (same fp32 steps as 4 bits)
// Row invariance: every row is computed by the same instruction sequence whatever M is; the row tiles
// (4, 3, 2 or 1 rows, one or two groups of 8 columns at a time) only interleave independent rows, they never
// share a sum. So a row's output is bit-identical whether it is computed alone or with other rows.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define BLK 32
#define GRP_BYTES 148
#define GRP8_BYTES 296
// Prefetch distance, bytes ahead in the weight stream: the value the experiment that produced this kernel
// settled on for a decode step's weights (30 layers x 7 matmuls, larger than L3) on the build machine.
#define PF_DIST 3072

int grp_bytes(void) { return GRP_BYTES; }
int grp8_bytes(void) { return GRP8_BYTES; }

void quantize_rows(const float* A, int M, int K, int8_t* qa, float* sa, float* sasum) {
    const int nb = K / BLK;
    const __m256 signmask = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int m = 0; m < M; m++) {
        for (int b = 0; b < nb; b++) {
            const float* a = A + (size_t)m * K + b * BLK;
            __m256 v0 = _mm256_loadu_ps(a), v1 = _mm256_loadu_ps(a + 8);
            __m256 v2 = _mm256_loadu_ps(a + 16), v3 = _mm256_loadu_ps(a + 24);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(signmask, v0), _mm256_andnot_ps(signmask, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(signmask, v2), _mm256_andnot_ps(signmask, v3)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float amax = _mm_cvtss_f32(h);
            float inv = amax > 0.f ? 127.f / amax : 0.f;
            float s = amax / 127.f;
            __m256 iv = _mm256_set1_ps(inv);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            int isum = _mm_cvtsi128_si32(s4);
            __m256i p01 = _mm256_packs_epi32(i0, i1);  // lanes: i0[0..3] i1[0..3] | i0[4..7] i1[4..7]
            __m256i p23 = _mm256_packs_epi32(i2, i3);
            __m256i p = _mm256_packs_epi16(p01, p23);  // 32-bit groups: i0lo i1lo i2lo i3lo | i0hi i1hi i2hi i3hi
            p = _mm256_permutevar8x32_epi32(p, perm);  // back to k order
            _mm256_storeu_si256((__m256i*)(qa + (size_t)m * K + b * BLK), p);
            sa[m * nb + b] = s;
            sasum[m * nb + b] = s * (float)isum;
        }
    }
}

// A 4-bit block's 8 scales (fp16 -> fp32, exact) and zero points (nibbles -> fp32, exact).
static inline __m256 block_scales(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 128))); }
static inline __m256 block_zeros(const uint8_t* p) {
    int32_t z4;
    memcpy(&z4, p + 144, 4);
    const __m128i v = _mm_cvtsi32_si128(z4), mask = _mm_set1_epi8(0x0F);
    const __m128i z = _mm_unpacklo_epi8(_mm_and_si128(v, mask), _mm_and_si128(_mm_srli_epi16(v, 4), mask));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z));  // columns 0..7
}

// R rows (m0..m0+R-1) x G groups (g..g+G-1, G = 1 or 2) of 8 columns; pw points at group g's first block
// (group g+1 follows it). With two groups the activations' broadcasts serve 16 columns. The integer part of
// a block is exact (int16 sums of at most 16 products <= 30480, then int32), so the order in which the
// compiler adds it up does not change a bit; the float steps run in the order documented above.
static inline __attribute__((always_inline)) void tile(const int8_t* qa, const float* sa, const float* sasum,
                                                       int K, const uint8_t* pw, int N, float* C, int m0, int R,
                                                       int G, int g) {
    const int nb = K / BLK;
    const __m256i lomask = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][4], zt[2][4];
    // zero-point term: its own FMA chain (same order for every row), added at the end
    const int fused = R * G <= 2;  // few accumulators: the zero-point chain runs in the main loop (one pass)
    for (int h = 0; h < G; h++) {
        const uint8_t* q = pw + (size_t)h * nb * GRP_BYTES;
        for (int r = 0; r < R; r++) zt[h][r] = _mm256_setzero_ps();
        for (int b = 0; b < nb && !fused; b++) {
            const uint8_t* pz = q + (size_t)b * GRP_BYTES;
            const __m256 swz = _mm256_mul_ps(block_scales(pz), block_zeros(pz));
            for (int r = 0; r < R; r++)
                zt[h][r] = _mm256_fnmadd_ps(swz, _mm256_broadcast_ss(sasum + (m0 + r) * nb + b), zt[h][r]);
        }
        for (int r = 0; r < R; r++) acc[h][r] = _mm256_setzero_ps();
    }
    const int32_t* arow[4];
    for (int r = 0; r < R; r++) arow[r] = (const int32_t*)(qa + (size_t)(m0 + r) * K);
    for (int b = 0; b < nb; b++) {
        const uint8_t* p[2];
        for (int h = 0; h < G; h++) {
            p[h] = pw + ((size_t)h * nb + b) * GRP_BYTES;
            // one group: PF_DIST ahead in the stream; two groups: the same block of the next pair, which
            // the next tile of rows (or the next pair) reads
            const char* ahead = (const char*)p[h] + (G == 2 ? 2 * (size_t)nb * GRP_BYTES : PF_DIST);
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0);
        }
        __m256i s[2][4];
        for (int c = 0; c < 4; c++) {
            // chunk c: low nibbles are k = 4c..4c+3, high nibbles k = 16+4c..16+4c+3 (8 columns x 4 k each)
            __m256i wl[2], wh[2];
            for (int h = 0; h < G; h++) {
                const __m256i cc = _mm256_loadu_si256((const __m256i*)(p[h] + 32 * c));
                wl[h] = _mm256_and_si256(cc, lomask);
                wh[h] = _mm256_and_si256(_mm256_srli_epi16(cc, 4), lomask);
            }
            for (int r = 0; r < R; r++) {
                // the row's 4 activations of each half, broadcast to every column
                const int32_t* a = arow[r] + b * 8;
                const __m256i al = _mm256_set1_epi32(a[c]), ah = _mm256_set1_epi32(a[c + 4]);
                __m256i t[2];
                for (int h = 0; h < G; h++)
                    t[h] = _mm256_add_epi16(_mm256_maddubs_epi16(wl[h], al), _mm256_maddubs_epi16(wh[h], ah));
                for (int h = 0; h < G; h++) s[h][r] = c == 0 ? t[h] : _mm256_add_epi16(s[h][r], t[h]);
                // keeps gcc from hoisting every maddubs of the block first and spilling the products
                if (G == 2) __asm__("" : "+x"(s[0][r]), "+x"(s[1][r]));
                else __asm__("" : "+x"(s[0][r]));
            }
        }
        for (int h = 0; h < G; h++) {
            const __m256 sw = block_scales(p[h]);
            if (fused) {
                const __m256 swz = _mm256_mul_ps(sw, block_zeros(p[h]));
                for (int r = 0; r < R; r++)
                    zt[h][r] = _mm256_fnmadd_ps(swz, _mm256_broadcast_ss(sasum + (m0 + r) * nb + b), zt[h][r]);
            }
            for (int r = 0; r < R; r++) {
                const __m256i d = _mm256_madd_epi16(s[h][r], ones);
                const __m256 scale = _mm256_mul_ps(sw, _mm256_broadcast_ss(sa + (m0 + r) * nb + b));
                acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc[h][r]);
            }
        }
    }
    for (int h = 0; h < G; h++)
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(C + (size_t)(m0 + r) * N + (g + h) * 8, _mm256_add_ps(acc[h][r], zt[h][r]));
}

// The 8-bit version of tile: R rows x one group g of 8 columns, pw at the group's first 8-bit block.
static inline __attribute__((always_inline)) void tile8(const int8_t* qa, const float* sa, const float* sasum,
                                                        int K, const uint8_t* pw, int N, float* C, int m0, int R,
                                                        int g) {
    const int nb = K / BLK;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4], zt[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t* p = pw + (size_t)b * GRP8_BYTES;
        _mm_prefetch((const char*)p + PF_DIST, _MM_HINT_T0);
        _mm_prefetch((const char*)p + PF_DIST + 64, _MM_HINT_T0);
        _mm_prefetch((const char*)p + PF_DIST + 128, _MM_HINT_T0);
        _mm_prefetch((const char*)p + PF_DIST + 192, _MM_HINT_T0);
        _mm_prefetch((const char*)p + PF_DIST + 256, _MM_HINT_T0);
        __m256i d[4];
        for (int r = 0; r < R; r++) d[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 32 * c)), flip);  // q - 128
            const __m256i u = _mm256_abs_epi8(w);  // 0..128, read unsigned
            for (int r = 0; r < R; r++) {
                // the row's 4 activations k = 4c..4c+3 of this block, broadcast, with the weights' signs
                const __m256i a = _mm256_set1_epi32(((const int32_t*)(qa + (size_t)(m0 + r) * K + b * BLK))[c]);
                const __m256i s = _mm256_sign_epi8(a, w);
                // |u0*s0 + u1*s1| <= 2 x 128 x 127 = 32512 < 32767: maddubs cannot saturate
                d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
                __asm__("" : "+x"(d[r]));  // as in tile: no block-wide hoisting, no spilled products
            }
        }
        const __m256 sw = _mm256_loadu_ps((const float*)(p + 256));
        for (int r = 0; r < R; r++) {
            __m256 scale = _mm256_mul_ps(sw, _mm256_broadcast_ss(sa + (m0 + r) * nb + b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), scale, acc[r]);
        }
    }
    // zero-point term, with z - 128 for the shifted weights: its own FMA chain, added at the end
    const __m256 f128 = _mm256_set1_ps(128.f);
    for (int r = 0; r < R; r++) zt[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t* pz = pw + (size_t)b * GRP8_BYTES;
        const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(pz + 288)));
        const __m256 zf = _mm256_sub_ps(_mm256_cvtepi32_ps(z), f128);  // z - 128, exact
        const __m256 swz = _mm256_mul_ps(_mm256_loadu_ps((const float*)(pz + 256)), zf);
        for (int r = 0; r < R; r++)
            zt[r] = _mm256_fnmadd_ps(swz, _mm256_broadcast_ss(sasum + (m0 + r) * nb + b), zt[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(C + (size_t)(m0 + r) * N + g * 8, _mm256_add_ps(acc[r], zt[r]));
}

static void tile8_4(const int8_t* qa, const float* sa, const float* sasum, int K, const uint8_t* pw, int N,
                    float* C, int m0, int g) { tile8(qa, sa, sasum, K, pw, N, C, m0, 4, g); }
static void tile8_3(const int8_t* qa, const float* sa, const float* sasum, int K, const uint8_t* pw, int N,
                    float* C, int m0, int g) { tile8(qa, sa, sasum, K, pw, N, C, m0, 3, g); }
static void tile8_2(const int8_t* qa, const float* sa, const float* sasum, int K, const uint8_t* pw, int N,
                    float* C, int m0, int g) { tile8(qa, sa, sasum, K, pw, N, C, m0, 2, g); }
static void tile8_1(const int8_t* qa, const float* sa, const float* sasum, int K, const uint8_t* pw, int N,
                    float* C, int m0, int g) { tile8(qa, sa, sasum, K, pw, N, C, m0, 1, g); }

#define TILE(name, R, G)                                                                                   \
    static void name(const int8_t* qa, const float* sa, const float* sasum, int K, const uint8_t* pw, int N, \
                     float* C, int m0, int g) {                                                            \
        tile(qa, sa, sasum, K, pw, N, C, m0, R, G, g);                                                     \
    }
TILE(tile4, 4, 1)
TILE(tile3, 3, 1)
TILE(tile2, 2, 1)
TILE(tile1, 1, 1)
TILE(tile4x2, 4, 2)
TILE(tile3x2, 3, 2)

// Column groups [g0, g1) of the product (a thread's share: every output element is computed whole by one call).
void gemm_q_groups(const int8_t* qa, const float* sa, const float* sasum, int M, int K, const uint8_t* pw, int N,
                   float* C, int g0, int g1) {
    const int nb = K / BLK;
    int g = g0;
    // from 3 rows on, two groups at a time (16 columns per tile); the rows left over go one group at a time
    if (M >= 3)
        for (; g + 2 <= g1; g += 2) {
            const uint8_t* p = pw + (size_t)g * nb * GRP_BYTES;
            int m = 0;
            for (; m + 4 <= M; m += 4) tile4x2(qa, sa, sasum, K, p, N, C, m, g);
            if (M - m == 3) tile3x2(qa, sa, sasum, K, p, N, C, m, g);
            else
                for (int h = 0; h < 2 && m < M; h++) {
                    const uint8_t* q = p + (size_t)h * nb * GRP_BYTES;
                    if (M - m == 2) tile2(qa, sa, sasum, K, q, N, C, m, g + h);
                    else tile1(qa, sa, sasum, K, q, N, C, m, g + h);
                }
        }
    for (; g < g1; g++) {
        const uint8_t* p = pw + (size_t)g * nb * GRP_BYTES;
        int m = 0;
        for (; m + 4 <= M; m += 4) tile4(qa, sa, sasum, K, p, N, C, m, g);
        switch (M - m) {
            case 3: tile3(qa, sa, sasum, K, p, N, C, m, g); break;
            case 2: tile2(qa, sa, sasum, K, p, N, C, m, g); break;
            case 1: tile1(qa, sa, sasum, K, p, N, C, m, g); break;
        }
    }
}

// The same for 8-bit weights (the GRP8_BYTES layout).
void gemm_q8_groups(const int8_t* qa, const float* sa, const float* sasum, int M, int K, const uint8_t* pw, int N,
                    float* C, int g0, int g1) {
    const int nb = K / BLK;
    for (int g = g0; g < g1; g++) {
        const uint8_t* p = pw + (size_t)g * nb * GRP8_BYTES;
        int m = 0;
        for (; m + 4 <= M; m += 4) tile8_4(qa, sa, sasum, K, p, N, C, m, g);
        switch (M - m) {
            case 3: tile8_3(qa, sa, sasum, K, p, N, C, m, g); break;
            case 2: tile8_2(qa, sa, sasum, K, p, N, C, m, g); break;
            case 1: tile8_1(qa, sa, sasum, K, p, N, C, m, g); break;
        }
    }
}

void gemm_q(const int8_t* qa, const float* sa, const float* sasum, int M, int K, const uint8_t* pw, int N, float* C) {
    gemm_q_groups(qa, sa, sasum, M, K, pw, N, C, 0, N / 8);
}

// Workspace: qa [M*K] int8, sa and sasum [M*K/32] floats. K % 32 == 0, N % 8 == 0.
void matmul_q4(const float* A, int M, int K, const uint8_t* pw, int N, float* C, int8_t* qa, float* sa,
               float* sasum) {
    quantize_rows(A, M, K, qa, sa, sasum);
    gemm_q(qa, sa, sasum, M, K, pw, N, C);
}

void matmul_q8(const float* A, int M, int K, const uint8_t* pw, int N, float* C, int8_t* qa, float* sa,
               float* sasum) {
    quantize_rows(A, M, K, qa, sa, sasum);
    gemm_q8_groups(qa, sa, sasum, M, K, pw, N, C, 0, N / 8);
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

// Benchmark loops (no Python between calls): ns per matmul_q4 call, averaged over reps.
double time_matmul_q4(int reps, const float* A, int M, int K, const uint8_t* pw, int N, float* C, int8_t* qa,
                      float* sa, float* sasum) {
    double t0 = now_ns();
    for (int i = 0; i < reps; i++) matmul_q4(A, M, K, pw, N, C, qa, sa, sasum);
    return (now_ns() - t0) / reps;
}

double time_matmul_q8(int reps, const float* A, int M, int K, const uint8_t* pw, int N, float* C, int8_t* qa,
                      float* sa, float* sasum) {
    double t0 = now_ns();
    for (int i = 0; i < reps; i++) matmul_q8(A, M, K, pw, N, C, qa, sa, sasum);
    return (now_ns() - t0) / reps;
}

// ns per pass over a list of n matmuls (one decode step's worth), averaged over reps.
double time_matmul_q4_list(int reps, int n, const int* Ks, const int* Ns, const uint8_t* const* pws,
                           const float* const* As, float* const* Cs, int M, int8_t* qa, float* sa, float* sasum) {
    double t0 = now_ns();
    for (int i = 0; i < reps; i++)
        for (int j = 0; j < n; j++) matmul_q4(As[j], M, Ks[j], pws[j], Ns[j], Cs[j], qa, sa, sasum);
    return (now_ns() - t0) / reps;
}
