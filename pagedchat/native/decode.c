/* One step of a Llama-family model on CPU, in one call, for steps whose every token is sampled: decode steps
 * (one new token per sequence), speculative decoding's verify steps (k + 1 tokens per sequence, causal among
 * themselves) and beam steps. Every token's K/V is written into the paged pool, then attention reads the pool
 * through the block tables.
 *
 * Why native: at batch 1 a small model's step is ~450 eager torch calls, and their dispatch cost (not the
 * arithmetic) is what separates pagedchat from llama.cpp. Here the step is a few dozen loops over memory the
 * torch side owns (weights, caches, rotary tables: pointers, nothing copied). The arithmetic is the torch
 * path's, in fp32, in another summation order (as one GEMM shape already differs from another).
 *
 * Linear layers keep the checkpoint's [out, in] layout: fp32, int8 with one fp32 scale per output row
 * (pagedchat/model/quantize.py), int4 in groups of 32 (pagedchat/model/int4.py), or a GGUF file's formats as
 * the file stores them (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: pagedchat/model/gguf; see
 * "GGUF block formats" below; F16 and BF16: see tile_f16). A tile of rows x sequences
 * shares every load: at batch 1 the weights stream once at the memory-bandwidth floor; at batch 16 each weight
 * load feeds several sequences. The pool holds fp32 K/V, or int8 with one float16 scale per (slot, kv head)
 * (kernels/kv_quant.py), written here exactly as quantize_kv writes them.
 * Threads claim the row tiles of every linear layer and the (sequence, kv head) pairs of attention,
 * inside one OpenMP region per step (the same libgomp torch loaded: one thread pool, no oversubscription);
 * how many threads a step gets is the caller's choice (pagedchat/native/step.py ThreadChoice).
 *
 * Built with the machine's C compiler on first use (pagedchat/native/build.py); GCC/clang vector extensions
 * keep it portable, and the tile shapes follow the instruction set (below).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define API __attribute__((visibility("default")))
#define INLINE static inline __attribute__((always_inline))
#define STR_(x) #x
#define STR(x) STR_(x)

/* A GGUF format is FMT_GGML + its ggml type number (pagedchat/model/gguf/reader.py GGMLType). */
enum { FMT_F32 = 0, FMT_I8 = 1, FMT_I4 = 2, FMT_GGML = 100 };
enum { GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q2_K = 10,
       GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30 };

typedef struct Linear {
    const void *weight;    /* [out, in] float or int8; int4: [out, in / 2] packed bytes; GGUF: the file's rows */
    const void *scales;    /* int8: float [out]; int4: float16 [out, in / 32]; fp32, GGUF: NULL */
    const float *bias;     /* [out] or NULL */
    int64_t out, in, format;
    /* A layer whose rows come in several formats (a GGUF file keeps q, k and v, or gate and up, apart, each in
     * its own type): the first `rows` rows are `weight` in `format`, the rest are `next`'s (its rows, weight
     * and format; its out and bias unused). Otherwise rows == out and next == NULL. */
    int64_t rows;
    const struct Linear *next;
} Linear;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden]: before attention, before the MLP */
    const float *q_norm, *k_norm;         /* [head_dim] (Qwen3, Gemma 3) or NULL */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;              /* [num_blocks, block_size, kv_heads, head_dim]: float, or int8 */
    uint16_t *k_scales, *v_scales;        /* int8 caches: float16 [num_blocks, block_size, kv_heads]; else NULL */
    /* Gemma: the attention's and the MLP's outputs are normed before the residual add ([hidden], or NULL) */
    const float *attn_out_norm, *mlp_out_norm;
    const float *cos, *sin;               /* this layer's rotary tables, or NULL: the model's */
    int64_t window;                       /* sliding window W (keys p-W+1..p), or 0: every key */
    int64_t group;                        /* the block tables it reads: 0 global, g > 0 window group g */
} Layer;

typedef struct {
    int64_t hidden, num_layers, num_heads, num_kv_heads, head_dim, vocab, block_size;
    float eps, scale;
    const void *embed;                    /* [vocab, hidden] float, or a GGUF table's rows (embed_format) */
    const float *norm;                    /* [hidden] */
    Linear lm_head;
    const float *cos, *sin;               /* [max_positions, head_dim] */
    const Layer *layers;
    float embed_scale;                    /* the embedding rows are multiplied by it (Gemma: sqrt(hidden)) */
    int64_t gelu;                         /* the MLP's activation: 0 SiLU, 1 GELU (tanh approximation) */
    int64_t embed_format, embed_row_bytes;  /* FMT_F32, or FMT_GGML + type: rows of embed_row_bytes bytes */
} Model;

/* ---- Vectors and tile shapes, per instruction set --------------------------------------------------------
 *
 * VW floats make one vector: a register of the target (AVX-512: 16, AVX/AVX2: 8, SSE, NEON and the rest: 4).
 * A linear layer's tile is TILE_R rows x up to TILE_NB sequences of vector accumulators, sized so that the
 * accumulators, one input vector per sequence and a weight vector all stay in registers:
 *   AVX-512 (32 zmm): 4 x 6 = 24 accumulators + 6 inputs + 1 weight = 31;
 *   AVX2+FMA (16 ymm): 4 x 3 = 12 accumulators + 3 inputs + 1 weight = 16, inputs and weight pinned in
 *     registers (below): 7 loads per 12 multiply-adds. Chosen by measurement on Zen 3 (AMD EPYC, AVX2, one
 *     thread, a shared machine, best of 60 runs of one layer): 1536x512 at 64 sequences 60-73 GFLOP/s
 *     against 42-54 for 2 x 6, 36-41 for 3 x 4 unpinned, 58-69 for 3 x 3 and 2 x 4 pinned; 4 x 6, the
 *     AVX-512 shape, spills and reached 43-46. End to end, small llama, 16 sequences: 32 ms a step against
 *     168 ms with the AVX-512 shape.
 *   the portable fallback (SSE: 16 xmm; NEON has 32): 3 x 4 of 4-float vectors, correct everywhere.
 * -DPC_ISA_GENERIC forces the fallback on any CPU and -DPC_TILE_R / -DPC_TILE_NB override the shape (the
 * tests build each; PAGEDCHAT_NATIVE_CFLAGS passes them). */
#if defined(PC_ISA_GENERIC)
#define VW 4
#define ISA_NAME "generic"
#elif defined(__AVX512F__)
#define VW 16
#define ISA_NAME "avx512"
#elif defined(__AVX__)
#define VW 8
#define ISA_NAME "avx2"
#else
#define VW 4
#define ISA_NAME "generic"
#endif
#if !defined(PC_TILE_R) && VW == 16
#define PC_TILE_R 4
#define PC_TILE_NB 6
#elif !defined(PC_TILE_R)
#define PC_TILE_R 4
#define PC_TILE_NB 3
#endif
#define TILE_R PC_TILE_R
#define MAX_NB PC_TILE_NB
#if TILE_R < 1 || TILE_R > 8 || MAX_NB < 1 || MAX_NB > 8
#error "tile shapes run from 1 to 8 rows and sequences"
#endif
/* One sequence alone (batch-1 decode) streams the weights once: ROWS_1 rows a tile keep that many multiply-add
 * chains in flight. Software prefetch (PC_FETCH) helps the AVX-512 machine it was measured on and hurts Zen 3,
 * whose hardware prefetchers keep up with 8 rows: one thread streaming a 64 MB layer there (best of 40, a
 * shared machine) reached 16-17.6 GB/s with 8 rows and no prefetch, 13.6-15.6 with 4 rows and none,
 * 9.4-12 with 4 rows and prefetch (the former shape). */
#if !defined(PC_ROWS_1) && VW == 16
#define PC_ROWS_1 TILE_R
#elif !defined(PC_ROWS_1)
#define PC_ROWS_1 8
#endif
#if !defined(PC_FETCH)
#define PC_FETCH (VW == 16)
#endif
#define ROWS_1 PC_ROWS_1
#define ROWS_MAX (ROWS_1 > TILE_R ? ROWS_1 : TILE_R)
#if ROWS_1 < 1 || ROWS_1 > 8
#error "tile shapes run from 1 to 8 rows"
#endif
/* The intrinsics below are taken only where the vector width is the register's. */
#if defined(__AVX512F__) && VW == 16
#define X86_512 1
#else
#define X86_512 0
#endif
#if defined(__AVX2__) && VW == 8
#define X86_256 1
#else
#define X86_256 0
#endif

typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));  /* a vf's lanes as bits: masks, exponents */
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4)));
typedef int8_t vqu __attribute__((vector_size(VW), aligned(1)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));
#if defined(__clang__)
#define SHUFFLE(a, b, T, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, T, ...) __builtin_shuffle(a, b, (T){__VA_ARGS__})
#endif

INLINE vf loadv(const float *p) { return *(const vfu *)p; }
INLINE void storev(float *p, vf v) { *(vfu *)p = v; }
/* int8 -> float, VW at a time. GCC 12 scalarizes __builtin_convertvector for this on x86, so the two x86
 * paths are spelled out (sign-extend, then convert); other CPUs take the generic form. */
#if X86_512
INLINE vf loadq(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif X86_256
INLINE vf loadq(const int8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
INLINE vf loadq(const int8_t *p) { return __builtin_convertvector(*(const vqu *)p, vf); }
#endif

/* v4 of the sums of four 4-float vectors: one shuffle tree serves all four. */
INLINE v4 sums4_of4(v4 q0, v4 q1, v4 q2, v4 q3) {
    const v4 t01 = SHUFFLE(q0, q1, v4i, 0, 4, 1, 5) + SHUFFLE(q0, q1, v4i, 2, 6, 3, 7);  /* q0 q1 q0 q1 */
    const v4 t23 = SHUFFLE(q2, q3, v4i, 0, 4, 1, 5) + SHUFFLE(q2, q3, v4i, 2, 6, 3, 7);
    return SHUFFLE(t01, t23, v4i, 0, 1, 4, 5) + SHUFFLE(t01, t23, v4i, 2, 3, 6, 7);
}

#if VW == 16
INLINE v8 halves16(vf v) {  /* the two 8-float halves added */
    v8 a, b;
    memcpy(&a, &v, 32);
    memcpy(&b, (const char *)&v + 32, 32);
    return a + b;
}
#endif

/* v4 of the sums of four 8-float vectors. */
INLINE v4 sums4_of8(v8 q0, v8 q1, v8 q2, v8 q3) {
    const v8 t01 = SHUFFLE(q0, q1, v8i, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(q0, q1, v8i, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 t23 = SHUFFLE(q2, q3, v8i, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(q2, q3, v8i, 4, 5, 6, 7, 12, 13, 14, 15);
    /* t01: 4 partial sums of q0, then 4 of q1; t23 likewise */
    const v8 u = SHUFFLE(t01, t23, v8i, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(t01, t23, v8i, 2, 3, 10, 11, 6, 7, 14, 15);
    /* u: 2 partial sums each of q0, q2, q1, q3 */
    const v8 w = SHUFFLE(u, u, v8i, 0, 4, 2, 6, 1, 5, 3, 7);  /* q0 q1 q2 q3, twice */
    v4 a, b;
    memcpy(&a, &w, 16);
    memcpy(&b, (const char *)&w + 16, 16);
    return a + b;
}

/* The sums of p0..p3, in one vector. A batch's tiles end in 16 sums each; reducing them one by one, a
 * batch-16 step of the small llama took 25-26 ms on AVX-512, with this 21 ms. */
INLINE v4 hsum4(vf p0, vf p1, vf p2, vf p3) {
#if VW == 4
    return sums4_of4(p0, p1, p2, p3);
#elif VW == 16
    return sums4_of8(halves16(p0), halves16(p1), halves16(p2), halves16(p3));
#else
    return sums4_of8(p0, p1, p2, p3);
#endif
}

INLINE float hsum(vf v) {  /* the same tree as hsum4's, lane for lane */
#if VW == 4
    v4 c = v;
#else
#if VW == 16
    const v8 a = halves16(v);
#else
    const v8 a = v;
#endif
    v4 c, d;
    memcpy(&c, &a, 16);
    memcpy(&d, (const char *)&a + 16, 16);
    c += d;
#endif
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* Whether a tile's inputs and weight fit in registers beside its accumulators (16 vector registers, which
 * all but AVX-512 have). Where they fit they are pinned there: left alone, GCC folds every input load into its
 * multiply-add (R * NB loads a step instead of R + NB), and a tile becomes load-bound. */
#if defined(PC_PIN)
#define PIN_INPUTS PC_PIN
#else
#define PIN_INPUTS (VW != 16 && TILE_R * MAX_NB + MAX_NB + 1 <= 16)
#endif
#if defined(__x86_64__) || defined(__i386__)
#define PIN(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define PIN(v) __asm__("" : "+w"(v))
#else
#define PIN(v) ((void)0)
#endif

/* acc[r * MAX_NB + b] = the sum of a[r][b]'s lanes, four accumulators to a shuffle tree (rows and sequences
 * taken in order: a 4 x 3 tile is three trees). */
INLINE void reduce_tile(vf a[ROWS_MAX][MAX_NB], int R, int NB, float *acc) {
    if (R > ROWS_MAX || NB > MAX_NB) __builtin_unreachable();
    int k = 0;
#pragma GCC unroll 12
    for (; k + 4 <= R * NB; k += 4) {
        const v4 sums = hsum4(a[k / NB][k % NB], a[(k + 1) / NB][(k + 1) % NB], a[(k + 2) / NB][(k + 2) % NB],
                              a[(k + 3) / NB][(k + 3) % NB]);
        for (int j = 0; j < 4; j++) acc[(k + j) / NB * MAX_NB + (k + j) % NB] = sums[j];
    }
    for (int left = 3; left > 0 && k < R * NB; left--, k++) acc[k / NB * MAX_NB + k % NB] = hsum(a[k / NB][k % NB]);
}

/* y[b, r] = sum_i x[b, i] * w[r, i] for R rows from w (rstride apart; rows of a linear layer are `in` apart,
 * keys in the pool kv_heads * head_dim) and NB sequences (xstride apart): every weight vector loaded once feeds
 * NB accumulators, every input vector R. R and NB are constants after inlining: the accumulators stay in
 * registers. fetch: prefetch the next tile's rows (a linear layer's, which follow these). */
#define TILE(NAME, WTYPE, LOAD, SCALAR)                                                                      \
    INLINE void NAME(const WTYPE *w, const float *x, int64_t in, int64_t rstride, int64_t xstride, int R,    \
                     int NB, int fetch, float *acc) {                                                       \
        vf a[ROWS_MAX][MAX_NB];                                                                             \
        for (int r = 0; r < R; r++)                                                                         \
            for (int b = 0; b < NB; b++) a[r][b] = (vf){0};                                                 \
        int64_t i = 0;                                                                                      \
        /* While these rows stream, the next tile's are fetched into L1 and the tile 4 ahead into L2 (once:  \
         * later sequences find them in cache). The far fetch keeps more of the stream in flight: the       \
         * matrix-vector pass over the small llama's weights, 8 alternations, 7.2-8.7 ms against 8.2-10.0. */ \
        const char *next = (const char *)(w + R * in), *far = (const char *)(w + 4 * R * in);             \
        const int lines = fetch && PC_FETCH ? (R * (int)sizeof(WTYPE) * VW + 63) / 64 : 0;                  \
        for (; i + VW <= in; i += VW) {                                                                     \
            for (int c = 0; c < lines; c++) {                                                               \
                __builtin_prefetch(next + (i * R * (int64_t)sizeof(WTYPE)) + c * 64, 0, 3);                 \
                __builtin_prefetch(far + (i * R * (int64_t)sizeof(WTYPE)) + c * 64, 0, 1);                  \
            }                                                                                               \
            vf xv[MAX_NB];                                                                                  \
            for (int b = 0; b < NB; b++) {                                                                  \
                xv[b] = loadv(x + b * xstride + i);                                                         \
                if (PIN_INPUTS) PIN(xv[b]);                                                                 \
            }                                                                                               \
            for (int r = 0; r < R; r++) {                                                                   \
                vf wv = LOAD(w + r * rstride + i);                                                          \
                if (PIN_INPUTS) PIN(wv);                                                                    \
                for (int b = 0; b < NB; b++) a[r][b] += wv * xv[b];                                         \
            }                                                                                               \
        }                                                                                                   \
        reduce_tile(a, R, NB, acc);                                                                         \
        for (int r = 0; r < R; r++)                                                                         \
            for (int b = 0; b < NB; b++)                                                                    \
                for (int64_t j = i; j < in; j++) acc[r * MAX_NB + b] += SCALAR(w[r * rstride + j]) * x[b * xstride + j]; \
    }
#define AS_FLOAT(v) (v)
#define INT8_TO_FLOAT(v) ((float)(v))
TILE(tile_f32, float, loadv, AS_FLOAT)
TILE(tile_i8, int8_t, loadq, INT8_TO_FLOAT)

/* ---- float16: an int8 pool's scales, an int4 layer's --------------------------------------------------------
 * Rounded to nearest, ties to even, as torch's .to(float16): F16C where the CPU has it, else the same rounding
 * spelled out (the tests compare the two builds). */
#if defined(__F16C__) && !defined(PC_ISA_GENERIC)
INLINE uint16_t f32_to_f16(float f) { return _cvtss_sh(f, 0); }
INLINE float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff;
    uint32_t mant = x & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    const int32_t e = (int32_t)exp - 112;  /* the float16 exponent field */
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {  /* a float16 subnormal (or zero): mant * 2^(e - 14) units of 2^-24 */
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000;
        const int shift = 14 - e;
        uint32_t half = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = sign | ((uint32_t)e << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;  /* a carry moves into the exponent, as it should */
    return (uint16_t)h;
}
static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t x;
    float f;
    if (e == 0) {
        f = (float)mant * (1.f / 16777216.f);  /* exact: mant * 2^-24 */
        memcpy(&x, &f, 4);
        x |= sign;
    } else if (e == 31) {
        x = sign | 0x7f800000 | (mant << 13);
    } else {
        x = sign | ((e + 112) << 23) | (mant << 13);
    }
    memcpy(&f, &x, 4);
    return f;
}
#endif

/* ---- F16 and BF16 weights: a GGUF file's float parts ------------------------------------------------------
 * Widened to fp32 in registers and multiplied with the fp32 input: tile_f32's arithmetic on half its weight
 * bytes, as tile_i8 reads int8. Not the block formats' 8-bit input: a file keeps a tensor in F16 or BF16 for its
 * accuracy, and rounding the input to 8 bits a block would add the error Q8_0 has. Nor llama.cpp's float16
 * input (its F16 dot products round the input to float16 first): widening is exact, so these layers compute
 * what the torch path does (GGUFLinear dequantizes F16 and BF16 exactly and multiplies in fp32), in another
 * summation order, and the tests' torch twin is the torch path itself. At batch 1 the step streams the
 * weights, whose 2 bytes a value are the same either way. */
INLINE float bf16_to_f32(uint16_t h) {
    const uint32_t x = (uint32_t)h << 16;  /* bfloat16 is a float32's top half */
    float f;
    memcpy(&f, &x, 4);
    return f;
}
#if X86_512
INLINE vf loadh(const uint16_t *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf loadbf(const uint16_t *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#elif X86_256 && defined(__F16C__)
INLINE vf loadh(const uint16_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE vf loadbf(const uint16_t *p) {
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
#else
#define LOAD_EACH(NAME, SCALAR)                                                                              \
    INLINE vf NAME(const uint16_t *p) {                                                                     \
        vf v;                                                                                               \
        for (int i = 0; i < VW; i++) v[i] = SCALAR(p[i]);                                                   \
        return v;                                                                                           \
    }
LOAD_EACH(loadh, f16_to_f32)
LOAD_EACH(loadbf, bf16_to_f32)
#endif
TILE(tile_f16, uint16_t, loadh, f16_to_f32)
TILE(tile_bf16, uint16_t, loadbf, bf16_to_f32)

/* ---- int8 weights: integer dot products -----------------------------------------------------------------
 * An int8 layer's input is quantized too, per block of 32 values of a row: d = max|x| / 127, q = round(x / d)
 * (ties to even). A block's dot product with a weight row is then exact in int32, scaled by d, summed in fp32
 * over the blocks, and the row's scale applied at the end: what llama.cpp does for Q8_0 weights against its
 * Q8 activations (there the weights' scales are per block too; here per row, so they wait for the end). On
 * x86 with AVX2 a block pair is sign-fixed bytes (|x|, w * sign(x)) through maddubs and madd (or one VNNI
 * dpbusd): 32 multiply-adds in 4-5 instructions, on a quarter of fp32's weight bytes. Without AVX2 the same
 * arithmetic runs in plain C. The numbers change against the fp32-activation product: a block's values move
 * by up to half a step (d / 2) each; tests/test_native_decode.py holds the step to a torch emulation of this
 * arithmetic and reports its distance from the fp32-activation int8 path and from fp32. */
#define QBLOCK 32
#if defined(__AVX2__) && !defined(PC_ISA_GENERIC)
#define Q8_SIMD 1
#else
#define Q8_SIMD 0
#endif
#if !defined(PC_Q8_R) && VW == 16
#define PC_Q8_R 4
#define PC_Q8_NB 4  /* 16 accumulators + 4 inputs + a few temporaries of 32 registers */
#elif !defined(PC_Q8_R)
#define PC_Q8_R 4
#define PC_Q8_NB 2  /* 8 accumulators + 2 inputs + weight, sign-fixed weight, product, ones: 14 of 16 */
#endif
#if !defined(PC_Q8_ROWS_1)
#define PC_Q8_ROWS_1 8
#endif
/* Q4_K, Q5_K and Q6_K at batch 1 (k1_tile): -DPC_K1=0 keeps GGML_TILE for them (to measure one against the
 * other); K1_ROWS rows a tile. Measured on the Xeon (Sapphire Rapids), one thread, a Llama-3.2-1B-shaped Q4_K_M
 * step, steps of each build alternating in one process: 4 rows ran 1.06x 8 rows with AVX-512 and 1.04x with
 * the AVX2 build (-march=haswell). */
#if !defined(PC_K1)
#define PC_K1 1
#endif
#if !defined(PC_K1_ROWS)
#define PC_K1_ROWS 4
#endif
#define K1_ROWS PC_K1_ROWS
#define Q8_R PC_Q8_R
#define Q8_NB PC_Q8_NB
#define Q8_ROWS_1 PC_Q8_ROWS_1
#define Q8_ROWS_MAX (Q8_ROWS_1 > Q8_R ? Q8_ROWS_1 : Q8_R)
#define ACC_ROWS 8  /* rows of a tile's results, whatever its shape */
#if Q8_NB > MAX_NB || Q8_ROWS_MAX > ACC_ROWS || ROWS_MAX > ACC_ROWS || K1_ROWS > Q8_ROWS_MAX || K1_ROWS < 1
#error "an int8 tile must fit the results of a float tile"
#endif

/* An input to a linear layer: the rows x [B, in], and (for integer layers) their int8 blocks, scales and sums:
 * per block, or for an int4 layer on AVX2 per pair of blocks (quantize_pairs). */
typedef struct {
    const float *x;
    const int8_t *q;     /* [B, in] */
    const float *d;      /* [B, in / QBLOCK], or [B, 4 * in / QBLOCK] */
    const int32_t *sum;  /* [B, in / QBLOCK]: the sum of a block's q; or [B, 4 * in / QBLOCK], see quantize_pairs */
    const int32_t *sum16;  /* batch 1, in a multiple of 256: the sum of each 16 q (k1_tile's), else NULL */
} Input;

/* The formats k1_tile reads (a Linear's format) */
INLINE int k1_format(int64_t format) {
    return format == FMT_GGML + GGML_Q4_K || format == FMT_GGML + GGML_Q5_K || format == FMT_GGML + GGML_Q6_K;
}

/* The largest |v[i]|; not fmaxf, which without -ffast-math is a call into libm per value. */
INLINE float max_abs(const float *v, int64_t n) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

INLINE void quantize_block(const float *v, int8_t *q, float *d, int32_t *sum) {
    const float amax = max_abs(v, QBLOCK);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    for (int j = 0; j < QBLOCK; j++) {
        q[j] = (int8_t)rintf(v[j] * inv);
        total += q[j];
    }
    *d = amax / 127.f;
    *sum = total;
}

/* out[i] = the sum of q[16 i .. 16 i + 15], n values */
static void sums16(const int8_t *q, int64_t n, int32_t *out) {
    for (int64_t i = 0; i < n / 16; i++) {
        int32_t total = 0;
        for (int j = 0; j < 16; j++) total += q[16 * i + j];
        out[i] = total;
    }
}

static void quantize_blocks(const float *x, int64_t n_blocks, int8_t *q, float *d, int32_t *sum) {
    for (int64_t i = 0; i < n_blocks; i++) quantize_block(x + i * QBLOCK, q + i * QBLOCK, d + i, sum + i);
}

/* The same blocks laid out for tile_q4p, pair by pair: the low halves of both blocks, then their high halves
 * (as an int4 pair's low and high nibbles come out of one 32-byte load), each block's scale four times and
 * -2 x its sum four times (one of the 4 lanes its dot product lands in, each taking a quarter of the -8 x sum
 * that the nibbles' offset owes). */
static void quantize_pairs(const float *x, int64_t n_pairs, int8_t *q, float *d4, int32_t *s4) {
    for (int64_t i = 0; i < n_pairs; i++) {
        int8_t a[QBLOCK], b[QBLOCK];
        float da, db;
        int32_t sa, sb;
        quantize_block(x + 2 * i * QBLOCK, a, &da, &sa);
        quantize_block(x + (2 * i + 1) * QBLOCK, b, &db, &sb);
        int8_t *out = q + 2 * i * QBLOCK;
        memcpy(out, a, 16), memcpy(out + 16, b, 16), memcpy(out + 32, a + 16, 16), memcpy(out + 48, b + 16, 16);
        for (int j = 0; j < 4; j++) {
            d4[8 * i + j] = da, d4[8 * i + 4 + j] = db;
            s4[8 * i + j] = -2 * sa, s4[8 * i + 4 + j] = -2 * sb;
        }
    }
}

/* GGUF blocks' fields, in any build */
INLINE float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* Q4_K and Q5_K's 6-bit scale and min of sub-block j (0-7) from their 12 packed bytes: sub-blocks 0-3 in the low
 * 6 bits of bytes j (scale) and j + 4 (min); 4-7 take their low 4 bits from byte j + 4's nibbles and their top 2
 * from the top of bytes j - 4 and j. */
INLINE void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63, *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K's 6-bit scale of sub-block j (0-15) from its 12 packed bytes, less its offset of 32: the low 4 bits are
 * byte j % 8's low (j < 8) or high nibble, the top 2 bits field j / 4 of byte 8 + j % 4. */
INLINE int q3_k_scale(const uint8_t *s, int j) {
    return (((s[j % 8] >> (4 * (j / 8))) & 0x0f) | ((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32;
}

/* Block k (values 32k .. 32k + 31) of a GGUF row as value i = s[i / 16] * q[i] + m[i / 16]: the AVX2 unpackers'
 * fields (wb_q8_0 and the rest say each layout), one value at a time: the portable tiles and the embedding
 * lookup. */
static void ggml_block(int64_t type, const uint8_t *row, int64_t k, int8_t q[QBLOCK], float s[2], float m[2]) {
    const uint8_t *b;
    uint32_t high = 0;
    int j = (int)(k % 8), sc = 0, mn = 0;
    m[0] = m[1] = s[0] = s[1] = 0.f;  /* (a type the Python side never binds: zeros) */
    switch (type) {
    case GGML_Q8_0:
        b = row + k * 34;
        memcpy(q, b + 2, QBLOCK);
        s[0] = s[1] = f16_at(b);
        return;
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: {
        static const int size[] = {[GGML_Q4_0] = 18, [GGML_Q4_1] = 20, [GGML_Q5_0] = 22, [GGML_Q5_1] = 24};
        const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
        b = row + k * size[type];
        const uint8_t *nib = b + 2 + 2 * has_min + 4 * five;
        if (five) memcpy(&high, b + 2 + 2 * has_min, 4);
        const int offset = has_min ? 0 : five ? 16 : 8;
        for (int i = 0; i < QBLOCK; i++) {
            const int v = (i < 16 ? nib[i] & 0x0f : nib[i - 16] >> 4) | (int)((high >> i) & 1) << 4;
            q[i] = (int8_t)(v - offset);
        }
        s[0] = s[1] = f16_at(b);
        if (has_min) m[0] = m[1] = f16_at(b + 2);
        return;
    }
    case GGML_Q2_K: {
        b = row + k / 8 * 84;
        for (int i = 0; i < QBLOCK; i++) q[i] = (int8_t)((b[16 + 32 * (j / 4) + i] >> (2 * (j % 4))) & 3);
        for (int h = 0; h < 2; h++) {
            s[h] = f16_at(b + 80) * (float)(b[2 * j + h] & 0x0f);
            m[h] = -(f16_at(b + 82) * (float)(b[2 * j + h] >> 4));
        }
        return;
    }
    case GGML_Q3_K: {
        b = row + k / 8 * 110;
        for (int i = 0; i < QBLOCK; i++)
            q[i] = (int8_t)((((b[32 + 32 * (j / 4) + i] >> (2 * (j % 4))) & 3) | ((b[i] >> j) & 1) << 2) - 4);
        for (int h = 0; h < 2; h++) s[h] = f16_at(b + 108) * (float)q3_k_scale(b + 96, 2 * j + h);
        return;
    }
    case GGML_Q4_K: case GGML_Q5_K: {
        const int five = type == GGML_Q5_K;
        b = row + k / 8 * (five ? 176 : 144);
        k_scale_min(b + 4, j, &sc, &mn);
        const uint8_t *nib = b + (five ? 48 : 16) + 32 * (j / 2);
        for (int i = 0; i < QBLOCK; i++)
            q[i] = (int8_t)(((nib[i] >> (4 * (j & 1))) & 0x0f) | (five ? ((b[16 + i] >> j) & 1) << 4 : 0));
        s[0] = s[1] = f16_at(b) * (float)sc;
        m[0] = m[1] = -(f16_at(b + 2) * (float)mn);
        return;
    }
    case GGML_Q6_K: {
        b = row + k / 8 * 210;
        const int h = j / 4, run = j % 4;
        for (int i = 0; i < QBLOCK; i++) {
            const int low = (b[64 * h + 32 * (run & 1) + i] >> (4 * (run >> 1))) & 0x0f;
            q[i] = (int8_t)((low | ((b[128 + 32 * h + i] >> (2 * run)) & 3) << 4) - 32);
        }
        const float d = f16_at(b + 208);
        s[0] = d * (float)(int8_t)b[192 + 2 * j], s[1] = d * (float)(int8_t)b[192 + 2 * j + 1];
        return;
    }
    }
}

#if Q8_SIMD
/* 8 int32 partial sums of |a| * b for 32 unsigned and 32 signed bytes (|a| <= 127: no int16 saturation) */
INLINE __m256i dot_u8i8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

#define PIN256(v) __asm__("" : "+x"(v))

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
/* acc + the 8 int32 sums of 4 products of unsigned a and signed b bytes */
INLINE __m256i dot_acc_u8i8(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, a, b);
#else
    return _mm256_dpbusd_avx_epi32(acc, a, b);
#endif
}
#endif

/* acc[r * MAX_NB + b] = the sum of a[r][b]'s 8 lanes (reduce_tile's tree, for the integer tiles' 8-float
 * accumulators whatever VW is). */
INLINE void reduce_q(v8 a[Q8_ROWS_MAX][Q8_NB], int R, int NB, float *acc) {
    if (R > Q8_ROWS_MAX || NB > Q8_NB) __builtin_unreachable();
    int k = 0;
#pragma GCC unroll 8
    for (; k + 4 <= R * NB; k += 4) {  /* (unrolled: an index left to run time keeps the tile in memory) */
        const v4 sums = sums4_of8(a[k / NB][k % NB], a[(k + 1) / NB][(k + 1) % NB], a[(k + 2) / NB][(k + 2) % NB],
                                  a[(k + 3) / NB][(k + 3) % NB]);
        for (int j = 0; j < 4; j++) acc[(k + j) / NB * MAX_NB + (k + j) % NB] = sums[j];
    }
    for (int left = 3; left > 0 && k < R * NB; left--, k++) {
        v4 lo, hi;
        memcpy(&lo, &a[k / NB][k % NB], 16);
        memcpy(&hi, (const char *)&a[k / NB][k % NB] + 16, 16);
        lo += hi;
        acc[k / NB * MAX_NB + k % NB] = (lo[0] + lo[2]) + (lo[1] + lo[3]);
    }
}

/* Integer tiles stream their weights from the next tile's start while they compute this one's: a tile's R rows
 * are contiguous, so `bytes` a block step ahead of `next` cover the whole next tile by the end. Zen 3's
 * prefetchers do not: a batch-1 tile reads 8 rows of 512 bytes side by side, 8 streams of 8 cache lines each,
 * too short for them to pick up. Measured on AMD EPYC (Zen 3, AVX2, one thread): the small llama's int8 weights
 * (28 MB, a batch-1 step's matrix-vector products alone) in 4.3-4.5 ms without, 1.8-2.3 ms with. On the Xeon
 * (Sapphire Rapids, AVX-512) a Llama-3.2-1B-shaped Q4_K_M step took 1.6x as long without; fetching two or four
 * tiles ahead, or into L2 only, measured no faster, and a non-temporal fetch took 2x as long.
 * -DPC_Q_FETCH=0 turns it off. */
#if !defined(PC_Q_FETCH)
#define PC_Q_FETCH 1
#endif
INLINE void fetch_ahead(const void *next, int64_t offset, int bytes) {
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)next + offset + c, 0, 3);
}

/* acc[r * MAX_NB + b] = sum over blocks of d[b, block] * (q[b, block] . w[r, block]), R rows (in apart), NB
 * inputs; R and NB constant after inlining. */
INLINE void tile_q8(const int8_t *w, const Input *in_, int64_t b0, int64_t in, int R, int NB, float *acc) {
    const int64_t blocks = in / QBLOCK;
    const int8_t *q = in_->q + b0 * in;
    const float *d = in_->d + b0 * blocks;
    v8 a[Q8_ROWS_MAX][Q8_NB];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) a[r][b] = (v8){0};
    const int fetch = PC_Q_FETCH && b0 == 0;
    for (int64_t k = 0; k < blocks; k++) {
        if (fetch) fetch_ahead(w + R * in, k * R * QBLOCK, R * QBLOCK);
        __m256i xabs[Q8_NB];
        for (int b = 0; b < NB; b++) {
            xabs[b] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(q + b * in + k * QBLOCK)));
            PIN256(xabs[b]);
        }
        for (int r = 0; r < R; r++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * in + k * QBLOCK));
            for (int b = 0; b < NB; b++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + b * in + k * QBLOCK));
                const __m256i p = dot_u8i8(xabs[b], _mm256_sign_epi8(wv, xv));
                a[r][b] = (v8)_mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(d + b * blocks + k),
                                              (__m256)a[r][b]);
            }
        }
    }
    reduce_q(a, R, NB, acc);
}

/* acc[r * MAX_NB + b] = sum over groups of scale[r, group] * d[b, group] * ((u - 8) . q[b, group]) for an int4
 * layer (pagedchat/model/int4.py: a group's 16 bytes hold its 32 values u + 8 as low nibbles then high), R rows
 * of packed bytes (in / 2 apart) and their float16 scales (in / 32 apart). The nibbles are unsigned, so maddubs
 * takes them as they are (15 x 127 x 2 cannot saturate); the 8 is taken off as 8 x the block's sum of q, one
 * lane's share from each of the 8 lanes. */
INLINE void tile_q4(const uint8_t *w, const uint16_t *ws, const Input *in_, int64_t b0, int64_t in, int R, int NB,
                    float *acc) {
    const int64_t blocks = in / QBLOCK;
    const int8_t *q = in_->q + b0 * in;
    const float *d = in_->d + b0 * blocks;
    const int32_t *sum = in_->sum + b0 * blocks;
    const __m256i low = _mm256_set1_epi8(0x0f);
    v8 a[Q8_ROWS_MAX][Q8_NB];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) a[r][b] = (v8){0};
    const int fetch = PC_Q_FETCH && b0 == 0;
    for (int64_t k = 0; k < blocks; k++) {
        if (fetch) fetch_ahead(w + R * (in / 2), k * R * (QBLOCK / 2), R * (QBLOCK / 2));
        for (int r = 0; r < R; r++) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + r * (in / 2) + k * (QBLOCK / 2)));
            const __m256i u = _mm256_and_si256(
                _mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1), low);
            const __m256 scale = _mm256_set1_ps(f16_to_f32(ws[r * blocks + k]));
            for (int b = 0; b < NB; b++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + b * in + k * QBLOCK));
                const __m256i p = _mm256_sub_epi32(dot_u8i8(u, xv), _mm256_set1_epi32(sum[b * blocks + k]));
                const __m256 s = _mm256_mul_ps(scale, _mm256_broadcast_ss(d + b * blocks + k));
                a[r][b] = (v8)_mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, (__m256)a[r][b]);
            }
        }
    }
    reduce_q(a, R, NB, acc);
}

/* tile_q4 two groups at a time (in a multiple of 64, the input from quantize_pairs): one 32-byte load holds
 * both groups' nibbles, and the low and high nibbles meet the inputs' low and high halves directly, so a pair
 * costs 2 maddubs, an add and a madd (or 2 VNNI dpbusd) where two single groups cost twice that plus the
 * unpacking; the result's lanes 0-3 are the first group's, 4-7 the second's, scaled lane by lane. */
INLINE void tile_q4p(const uint8_t *w, const uint16_t *ws, const Input *in_, int64_t b0, int64_t in, int R, int NB,
                     float *acc) {
    const int64_t blocks = in / QBLOCK, pairs = blocks / 2;
    const int8_t *q = in_->q + b0 * in;
    const float *d4 = in_->d + b0 * blocks * 4;
    const int32_t *s4 = in_->sum + b0 * blocks * 4;
    const __m256i low = _mm256_set1_epi8(0x0f);
    v8 a[Q8_ROWS_MAX][Q8_NB];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) a[r][b] = (v8){0};
    const int fetch = PC_Q_FETCH && b0 == 0;
    for (int64_t k0 = 0; k0 < pairs; k0 += 4) {
        /* the scales of 4 pairs, each pair's as [s0 x 4, s1 x 4]: 8 float16 converted at once */
        const int n = pairs - k0 < 4 ? (int)(pairs - k0) : 4;
        __m256 scales[Q8_ROWS_MAX][4];
        for (int r = 0; r < R; r++) {
#if defined(__F16C__)
            if (n == 4) {
                const __m256 eight = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ws + r * blocks + 2 * k0)));
                for (int j = 0; j < 4; j++)
                    scales[r][j] = _mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1,
                                                                                     2 * j + 1, 2 * j + 1, 2 * j + 1));
                continue;
            }
#endif
            for (int j = 0; j < n; j++) {
                const float s0 = f16_to_f32(ws[r * blocks + 2 * (k0 + j)]), s1 = f16_to_f32(ws[r * blocks + 2 * (k0 + j) + 1]);
                scales[r][j] = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
            }
        }
        if (fetch) fetch_ahead(ws + R * blocks, k0 * 2 * R * 2, 8 * R * 2);  /* the next tile's scales */
        for (int j = 0; j < n; j++) {
            const int64_t k = k0 + j;
            if (fetch) fetch_ahead(w + R * (in / 2), k * R * QBLOCK, R * QBLOCK);
            for (int r = 0; r < R; r++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + r * (in / 2) + k * QBLOCK));
                const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
                for (int b = 0; b < NB; b++) {
                    const int8_t *x = q + b * in + k * 2 * QBLOCK;
                    const __m256i xlo = _mm256_loadu_si256((const __m256i *)x);
                    const __m256i xhi = _mm256_loadu_si256((const __m256i *)(x + 32));
                    const __m256i offset = _mm256_loadu_si256((const __m256i *)(s4 + b * blocks * 4 + k * 8));
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
                    const __m256i p = dot_acc_u8i8(dot_acc_u8i8(offset, lo, xlo), hi, xhi);
#else
                    const __m256i pairs16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(pairs16, _mm256_set1_epi16(1)), offset);
#endif
                    const __m256 sc = _mm256_mul_ps(scales[r][j], _mm256_loadu_ps(d4 + b * blocks * 4 + k * 8));
                    a[r][b] = (v8)_mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, (__m256)a[r][b]);
                }
            }
        }
    }
    reduce_q(a, R, NB, acc);
}

/* ---- GGUF block formats (AVX2; AVX-512 takes the same 256-bit code, with VNNI as the int8 and int4 tiles) ------
 * Read in the file's layout, nothing repacked: each block of 32 weights (a K-quant's sub-block, or two of Q6_K's
 * 16-value ones) is unpacked in registers to 32 integers q and a scale s per lane of dot_u8i8 (lanes 0-3 hold
 * values 0-15, lanes 4-7 values 16-31), and meets the input's block as tile_q8 and tile_q4 meet theirs: value =
 * s * (q - offset) + m. Signed q (Q8_0, Q3_K, Q6_K) go through the sign trick with the weight on the unsigned
 * side, as llama.cpp does, |w| . (x * sign(w)): a Q8_0 block may hold -128, whose |w| = 128 fits a byte (and
 * 2 x 128 x 127 an int16), while x never is -128 (quantize_block's range is +-127). Unsigned q take offset x the
 * input block's sum off the exact dot product (tile_q4's way); a min m adds m x dx x sum, an eighth in each
 * lane, or (Q2_K, a min per 16 values) each lane's m x dx x that lane's own sum. */
typedef struct {
    __m256i q;  /* 32 weights: unsigned, or signed (WSIGNED formats) */
    __m256 s;   /* their scale, per lane of dot_u8i8's result */
    __m256 m;   /* added to every value, per lane as s (Q4_1, Q5_1 and the K-quants' mins; else 0) */
} WBlock;

/* 16 bytes of nibbles in value order: byte j's low nibble is value j, its high nibble value j + 16. */
INLINE __m256i nibbles32(const uint8_t *p) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1),
                            _mm256_set1_epi8(0x0f));
}

/* A little-endian u32's bit j as byte j, 0x10 or 0: value j's fifth bit (Q5_0, Q5_1). */
INLINE __m256i fifth_bits32(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i byte_of_bit = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), byte_of_bit);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);  /* byte j: bit j % 8 */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

INLINE __m256i shift_right16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }

/* Block k (values 32k .. 32k + 31) of one row in each format. */
INLINE WBlock wb_q8_0(const uint8_t *row, int64_t k) {  /* d | 32 int8 */
    const uint8_t *b = row + k * 34;
    const WBlock w = {_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_ps(f16_at(b)), _mm256_setzero_ps()};
    return w;
}
INLINE WBlock wb_q4_0(const uint8_t *row, int64_t k) {  /* d | 16 bytes of nibbles; value d * (q - 8) */
    const uint8_t *b = row + k * 18;
    const WBlock w = {nibbles32(b + 2), _mm256_set1_ps(f16_at(b)), _mm256_setzero_ps()};
    return w;
}
/* d and m, side by side at p: each in every lane */
INLINE __m256 d_and_m(const uint8_t *p, __m256 *m) {
#if defined(__F16C__)
    int32_t both;
    memcpy(&both, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(both));  /* one conversion for the two */
    *m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    return _mm256_broadcastss_ps(dm);
#else
    *m = _mm256_set1_ps(f16_at(p + 2));
    return _mm256_set1_ps(f16_at(p));
#endif
}
INLINE WBlock wb_q4_1(const uint8_t *row, int64_t k) {  /* d, m | nibbles; value d * q + m */
    const uint8_t *b = row + k * 20;
    WBlock w;
    w.s = d_and_m(b, &w.m);
    w.q = nibbles32(b + 4);
    return w;
}
INLINE WBlock wb_q5_0(const uint8_t *row, int64_t k) {  /* d | fifth bits | nibbles; value d * (q - 16) */
    const uint8_t *b = row + k * 22;
    const WBlock w = {_mm256_or_si256(nibbles32(b + 6), fifth_bits32(b + 2)), _mm256_set1_ps(f16_at(b)),
                      _mm256_setzero_ps()};
    return w;
}
INLINE WBlock wb_q5_1(const uint8_t *row, int64_t k) {  /* d, m | fifth bits | nibbles; value d * q + m */
    const uint8_t *b = row + k * 24;
    WBlock w;
    w.s = d_and_m(b, &w.m);
    w.q = _mm256_or_si256(nibbles32(b + 8), fifth_bits32(b + 4));
    return w;
}
/* A K-quant super-block's sub-block scales (and mins) for one row, decoded once for its 8 blocks of 32. */
typedef struct {
    float s[16];  /* Q4_K, Q5_K: d * sc per sub-block of 32; Q2_K, Q3_K, Q6_K: d * sc per sub-block of 16 */
    float m[16];  /* Q4_K, Q5_K: -dmin * m per sub-block (of 32); Q2_K: per sub-block of 16 */
} KScales;

INLINE void no_prep(const uint8_t *block, KScales *ks) { (void)block, (void)ks; }

/* Q4_K and Q5_K: d, dmin | 12 bytes of 6-bit scales and mins (k_scale_min's layout), taken as three 32-bit words:
 * sub-blocks 0-3 are the low 6 bits of words 0 (scales) and 1 (mins), bytes in order; 4-7 the nibbles of word 2
 * below the top 2 bits of the bytes of words 0 and 1. */
INLINE __m256 q4_k_scales(const uint8_t *b, __m256 *minus_mins) {
    uint32_t w[3];
    memcpy(w, b + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, nib = 0x0f0f0f0f, top2 = 0x03030303;
    const uint32_t sc[2] = {w[0] & low6, (w[2] & nib) | (((w[0] >> 6) & top2) << 4)};
    const uint32_t mn[2] = {w[1] & low6, ((w[2] >> 4) & nib) | (((w[1] >> 6) & top2) << 4)};
    const __m256 d = _mm256_set1_ps(f16_at(b)), minus_dmin = _mm256_set1_ps(-f16_at(b + 2));
    const __m256 sc8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    const __m256 mn8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    *minus_mins = _mm256_mul_ps(mn8, minus_dmin);
    return _mm256_mul_ps(sc8, d);
}
INLINE void prep_q4_k(const uint8_t *b, KScales *ks) {
    __m256 m;
    _mm256_storeu_ps(ks->s, q4_k_scales(b, &m));
    _mm256_storeu_ps(ks->m, m);
}
/* out[i] = d * the int8 bytes[i], 16 sub-blocks' scales (or mins) */
INLINE void scales16(__m128i bytes, float d, float *out) {
    const __m256 dv = _mm256_set1_ps(d);
    for (int h = 0; h < 2; h++, bytes = _mm_srli_si128(bytes, 8))
        _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), dv));
}
/* Q6_K: 16 int8 scales at 192, d at 208 */
INLINE void prep_q6_k(const uint8_t *b, KScales *ks) {
    scales16(_mm_loadu_si128((const __m128i *)(b + 192)), f16_at(b + 208), ks->s);
}
/* Q2_K: 16 bytes, a sub-block's scale in the low nibble and its min in the high one | ... | d, dmin at 80 */
INLINE void prep_q2_k(const uint8_t *b, KScales *ks) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)b), low = _mm_set1_epi8(0x0f);
    scales16(_mm_and_si128(bytes, low), f16_at(b + 80), ks->s);
    scales16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), -f16_at(b + 82), ks->m);
}
/* Q3_K: 12 bytes of 6-bit scales at 96 (q3_k_scale's layout), d at 108, decoded 8 scales to a 64-bit word:
 * scales 0-7 are the low nibbles of bytes 0-7, 8-15 their high nibbles, each below 2 bits of bytes 8-11
 * (fields 0 and 1 for scales 0-7, 2 and 3 for 8-15); each less 32. Built in registers: as four 4-byte stores
 * read back in one 16-byte load they missed store forwarding (a 2048 x 2048 layer at batch 1, one thread,
 * AVX-512: 0.48 ms against 0.36). */
INLINE void prep_q3_k(const uint8_t *b, KScales *ks) {
    uint64_t low;
    uint32_t top;
    memcpy(&low, b + 96, 8);
    memcpy(&top, b + 104, 4);
    const uint64_t nib = 0x0f0f0f0f0f0f0f0full, two = 0x0303030303030303ull;
    const uint64_t top01 = top | (uint64_t)(top >> 2) << 32, top23 = (top >> 4) | (uint64_t)(top >> 6) << 32;
    const __m128i bytes = _mm_set_epi64x((int64_t)(((low >> 4) & nib) | (top23 & two) << 4),
                                         (int64_t)((low & nib) | (top01 & two) << 4));
    scales16(_mm_sub_epi8(bytes, _mm_set1_epi8(32)), f16_at(b + 108), ks->s);
}

/* pair[0] in lanes 0-3 (values 0-15), pair[1] in lanes 4-7: a block's two sub-blocks of 16 */
INLINE __m256 per_half(const float *pair) {
    const __m128 both = _mm_castpd_ps(_mm_load_sd((const double *)pair));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(both), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* Q4_K: d, dmin | scales | 128 bytes: a run of 32 bytes holds sub-block 2i in its low nibbles and 2i + 1 in its
 * high ones; value (d * sc) * q - dmin * m. */
INLINE WBlock wb_q4_k(const uint8_t *row, int64_t k, const KScales *ks) {
    const int j = (int)(k % 8);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + k / 8 * 144 + 16 + 32 * (j / 2)));
    const WBlock w = {_mm256_and_si256(shift_right16(bytes, 4 * (j & 1)), _mm256_set1_epi8(0x0f)),
                      _mm256_set1_ps(ks->s[j]), _mm256_set1_ps(ks->m[j])};
    return w;
}
/* Q5_K: as Q4_K, with 32 bytes of fifth bits (bit j of byte i: value i of sub-block j) before the nibbles. */
INLINE WBlock wb_q5_k(const uint8_t *row, int64_t k, const KScales *ks) {
    const uint8_t *b = row + k / 8 * 176;
    const int j = (int)(k % 8);
    const __m256i low = _mm256_and_si256(shift_right16(_mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (j / 2))),
                                                       4 * (j & 1)), _mm256_set1_epi8(0x0f));
    const __m256i high = _mm256_and_si256(shift_right16(_mm256_loadu_si256((const __m256i *)(b + 16)), j),
                                          _mm256_set1_epi8(0x01));
    const WBlock w = {_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_ps(ks->s[j]),
                      _mm256_set1_ps(ks->m[j])};
    return w;
}
/* Q6_K: 128 bytes of low nibbles | 64 of high 2 bits | 16 int8 scales | d. Each half of the block (128 values):
 * 64 nibble bytes (values 0-63 low nibbles, 64-127 high) and 32 high bytes (four 2-bit fields, a run of 32
 * values each); value (d * sc) * (q - 32), a scale per 16 values. */
INLINE WBlock wb_q6_k(const uint8_t *row, int64_t k, const KScales *ks) {
    const uint8_t *b = row + k / 8 * 210;
    const int j = (int)(k % 8), h = j / 4, run = j % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (run & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m256i low = _mm256_and_si256(shift_right16(ql, 4 * (run >> 1)), _mm256_set1_epi8(0x0f));
    const __m256i high = _mm256_and_si256(shift_right16(qh, 2 * run), _mm256_set1_epi8(0x03));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    const WBlock w = {q, per_half(ks->s + 2 * j), _mm256_setzero_ps()};
    return w;
}
/* Q2_K: 16 bytes of scales and mins | 64 bytes of q, in two runs of 32 whose bytes hold four blocks of 32 in
 * their 2-bit fields, lowest first | d, dmin; value (d * sc) * q - dmin * m, a scale and a min per 16 values. */
INLINE WBlock wb_q2_k(const uint8_t *row, int64_t k, const KScales *ks) {
    const int j = (int)(k % 8);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + k / 8 * 84 + 16 + 32 * (j / 4)));
    const WBlock w = {_mm256_and_si256(shift_right16(bytes, 2 * (j % 4)), _mm256_set1_epi8(0x03)),
                      per_half(ks->s + 2 * j), per_half(ks->m + 2 * j)};
    return w;
}
/* Q3_K: 32 bytes of high bits (bit j of byte i: value i of block j) | 64 bytes of 2-bit fields as Q2_K's | scales
 * | d; value (d * (sc - 32)) * q, q the 2 low bits less 4 where the high bit is clear (-4 .. 3), a scale per 16
 * values. */
INLINE WBlock wb_q3_k(const uint8_t *row, int64_t k, const KScales *ks) {
    const uint8_t *b = row + k / 8 * 110;
    const int j = (int)(k % 8);
    const __m256i low = _mm256_and_si256(shift_right16(_mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (j / 4))),
                                                       2 * (j % 4)), _mm256_set1_epi8(0x03));
    const __m256i high = _mm256_and_si256(shift_right16(_mm256_loadu_si256((const __m256i *)b), j),
                                          _mm256_set1_epi8(0x01));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), _mm256_set1_epi8(4));
    const WBlock w = {q, per_half(ks->s + 2 * j), _mm256_setzero_ps()};
    return w;
}
/* (the formats of 32-value blocks, to the K-quants' signature) */
#define BLOCK32(FN)                                                                                          \
    INLINE WBlock FN##_(const uint8_t *row, int64_t k, const KScales *ks) { (void)ks; return FN(row, k); }
BLOCK32(wb_q8_0) BLOCK32(wb_q4_0) BLOCK32(wb_q4_1) BLOCK32(wb_q5_0) BLOCK32(wb_q5_1)

/* acc + the exact dot products of unsigned a and signed b bytes, 8 int32 lanes */
INLINE __m256i dot_from(__m256i acc, __m256i a, __m256i b) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return dot_acc_u8i8(acc, a, b);
#else
    return _mm256_add_epi32(acc, dot_u8i8(a, b));
#endif
}

/* acc[r * MAX_NB + b] = sum over blocks of d[b, block] * (w[r, block] . q[b, block]) for R rows of a GGUF format
 * (row_bytes apart) and NB inputs. UNPACK reads a block of 32; a super-block of SUB blocks (BYTES256 bytes per
 * 256 values: the K-quants' blocks) has its scales decoded by PREP first, for each row. WSIGNED says whether q
 * are signed, OFFSET is what unsigned q lose (8 for Q4_0, 16 for Q5_0), WMIN whether there is a min: 1 one a
 * block, 2 one per 16 values (Q2_K: each lane meets its own share of the input's sum, dot_u8i8 of ones and x).
 * R and NB are constant after inlining. */
#define GGML_TILE(NAME, PREP, UNPACK, SUB, BYTES256, WSIGNED, OFFSET, WMIN)                                   \
    INLINE void NAME(const uint8_t *w, int64_t row_bytes, const Input *in_, int64_t b0, int64_t in, int R,   \
                     int NB, float *acc) {                                                                  \
        const int64_t blocks = in / QBLOCK, tile_bytes = R * row_bytes;                                     \
        const int8_t *q = in_->q + b0 * in;                                                                 \
        const float *d = in_->d + b0 * blocks;                                                              \
        const int32_t *sum = in_->sum + b0 * blocks;                                                        \
        v8 a[Q8_ROWS_MAX][Q8_NB];                                                                           \
        for (int r = 0; r < R; r++)                                                                         \
            for (int b = 0; b < NB; b++) a[r][b] = (v8){0};                                                 \
        const int fetch = PC_Q_FETCH && b0 == 0;                                                            \
        KScales ks[SUB > 1 ? Q8_ROWS_MAX : 1];                                                              \
        for (int64_t k = 0; k < blocks; k++) {                                                              \
            if (SUB > 1 && k % SUB == 0)                                                                    \
                for (int r = 0; r < R; r++) PREP(w + r * row_bytes + k / SUB * (BYTES256 * SUB / 8), &ks[r]); \
            if (fetch) { /* the next tile's bytes, this block's share (Q6_K's are not whole bytes) */      \
                const int64_t from = R * BYTES256 * k / 8;                                                  \
                fetch_ahead(w + tile_bytes, from, (int)(R * BYTES256 * (k + 1) / 8 - from));                \
            }                                                                                               \
            __m256i x[Q8_NB];                                                                               \
            __m256 xm[Q8_NB];                                                                               \
            float xd[Q8_NB];                                                                                \
            int32_t xo[Q8_NB];                                                                              \
            for (int b = 0; b < NB; b++) {                                                                  \
                x[b] = _mm256_loadu_si256((const __m256i *)(q + b * in + k * QBLOCK));                      \
                PIN256(x[b]);                                                                               \
                xd[b] = d[b * blocks + k];                                                                  \
                /* each lane's dx x sum of its q, or its share of dx x the block's */                      \
                xm[b] = WMIN == 2 ? _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8i8(_mm256_set1_epi8(1), x[b])),  \
                                                  _mm256_set1_ps(xd[b]))                                    \
                                  : _mm256_set1_ps(xd[b] * (float)sum[b * blocks + k] * 0.125f);            \
                xo[b] = -(OFFSET / 8) * sum[b * blocks + k];         /* a lane's share of -OFFSET x sum */  \
            }                                                                                               \
            for (int r = 0; r < R; r++) {                                                                   \
                const WBlock wb = UNPACK(w + r * row_bytes, k, &ks[SUB > 1 ? r : 0]);                       \
                const __m256i wu = WSIGNED ? _mm256_abs_epi8(wb.q) : wb.q;                                  \
                for (int b = 0; b < NB; b++) {                                                              \
                    const __m256i xv = WSIGNED ? _mm256_sign_epi8(x[b], wb.q) : x[b];                       \
                    const __m256i p = OFFSET ? dot_from(_mm256_set1_epi32(xo[b]), wu, xv) : dot_u8i8(wu, xv); \
                    __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(wb.s, _mm256_set1_ps(xd[b])), \
                                               (__m256)a[r][b]);                                            \
                    if (WMIN) t = _mm256_fmadd_ps(wb.m, xm[b], t);                                          \
                    a[r][b] = (v8)t;                                                                        \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        reduce_q(a, R, NB, acc);                                                                            \
    }
GGML_TILE(tile_q8_0, no_prep, wb_q8_0_, 1, 272, 1, 0, 0)
GGML_TILE(tile_q4_0, no_prep, wb_q4_0_, 1, 144, 0, 8, 0)
GGML_TILE(tile_q4_1, no_prep, wb_q4_1_, 1, 160, 0, 0, 1)
GGML_TILE(tile_q5_0, no_prep, wb_q5_0_, 1, 176, 0, 16, 0)
GGML_TILE(tile_q5_1, no_prep, wb_q5_1_, 1, 192, 0, 0, 1)
GGML_TILE(tile_q2_k, prep_q2_k, wb_q2_k, 8, 84, 0, 0, 2)
GGML_TILE(tile_q3_k, prep_q3_k, wb_q3_k, 8, 110, 1, 0, 0)
GGML_TILE(tile_q4_k, prep_q4_k, wb_q4_k, 8, 144, 0, 0, 1)
GGML_TILE(tile_q5_k, prep_q4_k, wb_q5_k, 8, 176, 0, 0, 1)
GGML_TILE(tile_q6_k, prep_q6_k, wb_q6_k, 8, 210, 1, 0, 0)

/* ---- Q4_K, Q5_K and Q6_K at batch 1 ---------------------------------------------------------------------
 * One sequence decoding streams every weight once per token, and GGML_TILE's per-block work then sets the pace
 * (measured: a Llama-3.2-1B-shaped Q4_K_M step, one thread, tracked a CPU-bound probe and not a copy-bandwidth
 * one): per 32 values and row it builds the block's scale vectors, converts, scales and adds twice, and Q6_K
 * also fixes signs. Here what does not depend on the values moves out to once per super-block and row: the
 * sub-block scales times the input's block scales (sd: the same products GGML_TILE forms), and the part that
 * does not depend on q at all, the mins (Q4_K, Q5_K: -dmin m x dx x the input block's sum) or Q6_K's offset
 * (-32 x dx x each 16 inputs' sum, from Input.sum16), added with one multiply-add. What is left per block is
 * unsigned q (Q6_K's too: q + 32, 0..63), one byte dot product, one conversion and one multiply-add; with
 * AVX-512 two blocks go through one 512-bit register (a Q4_K byte run's two nibbles are two blocks). The
 * arithmetic is GGML_TILE's: the same int32 block dot products (q + 32 against x is x's sum x 32 more, exactly),
 * scaled by the same float products, summed in another order. */
#if X86_512 && defined(__AVX512BW__)
typedef __m512 k1_acc;   /* lanes 0-7: a pair's first block, 8-15 its second */
typedef __m512 k1_scale;
INLINE k1_acc k1_zero(void) { return _mm512_setzero_ps(); }
INLINE __m512i k1_dot(__m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
#endif
}
/* acc + blocks a and b (unsigned q) . the 64 input bytes at x, lane by lane times scale */
INLINE k1_acc k1_pair(k1_acc acc, __m256i a, __m256i b, const int8_t *x, k1_scale scale) {
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(k1_dot(w, _mm512_loadu_si512(x))), scale, acc);
}
/* pair p's scales: a sub-block of 32 per block (sd[2p], sd[2p + 1]), or of 16 (sd16[4p .. 4p + 3]) */
INLINE k1_scale k1_scale32(__m256 sd, int p) {
    const __m512i idx = _mm512_set_epi32(2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                         2 * p + 1, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(sd));
}
INLINE k1_scale k1_scale16(__m256 lo, __m256 hi, int p) {
    const __m512 sd16 = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    const int i = 4 * p;
    const __m512i idx = _mm512_set_epi32(i + 3, i + 3, i + 3, i + 3, i + 2, i + 2, i + 2, i + 2, i + 1, i + 1, i + 1,
                                         i + 1, i, i, i, i);
    return _mm512_permutexvar_ps(idx, sd16);
}
INLINE k1_acc k1_fma8(__m256 a, __m256 b, k1_acc acc) {
    return _mm512_fmadd_ps(_mm512_zextps256_ps512(a), _mm512_zextps256_ps512(b), acc);
}
INLINE float k1_sum(k1_acc acc) { return _mm512_reduce_add_ps(acc); }
#else
typedef __m256 k1_acc;
typedef struct { __m256 a, b; } k1_scale;
INLINE k1_acc k1_zero(void) { return _mm256_setzero_ps(); }
INLINE k1_acc k1_pair(k1_acc acc, __m256i a, __m256i b, const int8_t *x, k1_scale scale) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8i8(a, _mm256_loadu_si256((const __m256i *)x))), scale.a, acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8i8(b, _mm256_loadu_si256((const __m256i *)(x + 32)))), scale.b,
                           acc);
}
INLINE k1_scale k1_scale32(__m256 sd, int p) {
    const k1_scale s = {_mm256_permutevar8x32_ps(sd, _mm256_set1_epi32(2 * p)),
                        _mm256_permutevar8x32_ps(sd, _mm256_set1_epi32(2 * p + 1))};
    return s;
}
INLINE k1_scale k1_scale16(__m256 lo, __m256 hi, int p) {
    const __m256 v = p < 2 ? lo : hi;
    const int i = 4 * (p % 2);
    const k1_scale s = {_mm256_permutevar8x32_ps(v, _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1)),
                        _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(i + 2, i + 2, i + 2, i + 2, i + 3, i + 3,
                                                                      i + 3, i + 3))};
    return s;
}
INLINE k1_acc k1_fma8(__m256 a, __m256 b, k1_acc acc) { return _mm256_fmadd_ps(a, b, acc); }
INLINE float k1_sum(k1_acc acc) {
    v4 lo, hi;
    memcpy(&lo, &acc, 16);
    memcpy(&hi, (const char *)&acc + 16, 16);
    lo += hi;
    return (lo[0] + lo[2]) + (lo[1] + lo[3]);
}
#endif

/* Blocks 2p and 2p + 1 of a super-block at b, q unsigned (wb_q4_k, wb_q5_k and wb_q6_k say each layout). */
INLINE void k1_q4_k(const uint8_t *b, int p, __m256i *lo, __m256i *hi) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * p)), low = _mm256_set1_epi8(0x0f);
    *lo = _mm256_and_si256(bytes, low);
    *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
}
INLINE void k1_q5_k(const uint8_t *b, int p, __m256i *lo, __m256i *hi) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * p)), low = _mm256_set1_epi8(0x0f);
    const __m256i high = _mm256_loadu_si256((const __m256i *)(b + 16)), one = _mm256_set1_epi8(0x01);
    *lo = _mm256_or_si256(_mm256_and_si256(bytes, low),
                          _mm256_slli_epi16(_mm256_and_si256(shift_right16(high, 2 * p), one), 4));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
                          _mm256_slli_epi16(_mm256_and_si256(shift_right16(high, 2 * p + 1), one), 4));
}
INLINE void k1_q6_k(const uint8_t *b, int p, __m256i *lo, __m256i *hi) {
    const uint8_t *ql = b + 64 * (p / 2);
    const int nib = 4 * (p % 2), run = 2 * (p % 2);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * (p / 2)));
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x03);
    *lo = _mm256_or_si256(_mm256_and_si256(shift_right16(_mm256_loadu_si256((const __m256i *)ql), nib), low),
                          _mm256_slli_epi16(_mm256_and_si256(shift_right16(qh, 2 * run), two), 4));
    *hi = _mm256_or_si256(_mm256_and_si256(shift_right16(_mm256_loadu_si256((const __m256i *)(ql + 32)), nib), low),
                          _mm256_slli_epi16(_mm256_and_si256(shift_right16(qh, 2 * run + 2), two), 4));
}

/* acc[r * MAX_NB] = row r . the input, R rows (row_bytes apart) of a K-quant with a scale (and min) per 32
 * values (Q4_K, Q5_K; SIXTEENS 0: BYTES a super-block, PAIR its unpacker) or per 16 (Q6_K; SIXTEENS 1). */
#define K1_TILE(NAME, PAIR, BYTES, SIXTEENS)                                                                 \
    INLINE void NAME(const uint8_t *w, int64_t row_bytes, const Input *in_, int64_t in, int R, float *acc) {  \
        k1_acc a[Q8_ROWS_MAX];                                                                              \
        for (int r = 0; r < R; r++) a[r] = k1_zero();                                                       \
        for (int64_t k = 0; k < in / 256; k++) {                                                            \
            if (PC_Q_FETCH) fetch_ahead(w + R * row_bytes, k * R * BYTES, R * BYTES);                      \
            const int8_t *x = in_->q + 256 * k;                                                             \
            const __m256 dx = _mm256_loadu_ps(in_->d + 8 * k);                                              \
            __m256 fixed[2]; /* what q does not change, per sub-block: Q4_K's dx x sum, Q6_K's -32 dx x sum */ \
            __m256 dx16[2];  /* Q6_K: each sub-block of 16's input scale (its block's) */                   \
            if (SIXTEENS) {                                                                                 \
                dx16[0] = _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));          \
                dx16[1] = _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));          \
                const __m256 m32 = _mm256_set1_ps(-32.f);                                                   \
                for (int h = 0; h < 2; h++)                                                                 \
                    fixed[h] = _mm256_mul_ps(_mm256_mul_ps(dx16[h], m32), _mm256_cvtepi32_ps(                \
                        _mm256_loadu_si256((const __m256i *)(in_->sum16 + 16 * k + 8 * h))));               \
            } else {                                                                                        \
                fixed[0] = _mm256_mul_ps(dx, _mm256_cvtepi32_ps(                                            \
                    _mm256_loadu_si256((const __m256i *)(in_->sum + 8 * k))));                              \
            }                                                                                               \
            for (int r = 0; r < R; r++) {                                                                   \
                const uint8_t *b = w + r * row_bytes + k * BYTES;                                           \
                __m256 sd, sd_hi;                                                                           \
                if (SIXTEENS) {                                                                             \
                    KScales ks;                                                                             \
                    prep_q6_k(b, &ks);                                                                      \
                    const __m256 s_lo = _mm256_loadu_ps(ks.s), s_hi = _mm256_loadu_ps(ks.s + 8);           \
                    a[r] = k1_fma8(s_hi, fixed[1], k1_fma8(s_lo, fixed[0], a[r]));                          \
                    sd = _mm256_mul_ps(s_lo, dx16[0]), sd_hi = _mm256_mul_ps(s_hi, dx16[1]);               \
                } else {                                                                                    \
                    __m256 minus_mins;                                                                      \
                    const __m256 s = q4_k_scales(b, &minus_mins);                                           \
                    a[r] = k1_fma8(minus_mins, fixed[0], a[r]);                                             \
                    sd = _mm256_mul_ps(s, dx), sd_hi = sd;                                                  \
                }                                                                                           \
                for (int p = 0; p < 4; p++) {                                                               \
                    __m256i lo, hi;                                                                         \
                    PAIR(b, p, &lo, &hi);                                                                   \
                    a[r] = k1_pair(a[r], lo, hi, x + 64 * p, SIXTEENS ? k1_scale16(sd, sd_hi, p) : k1_scale32(sd, p)); \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++) acc[r * MAX_NB] = k1_sum(a[r]);                                         \
    }
K1_TILE(k1_tile_q4_k, k1_q4_k, 144, 0)
K1_TILE(k1_tile_q5_k, k1_q5_k, 176, 0)
K1_TILE(k1_tile_q6_k, k1_q6_k, 210, 1)

/* Whether a batch-1 tile of this format takes k1_tile: its input has the 16-value sums (input_for's say). */
INLINE int k1_takes(int64_t type, const Input *x, int NB) {
    return NB == 1 && x->sum16 != NULL && k1_format(FMT_GGML + type);
}
#define K1_CASE(FN)                                                                                          \
    if (R == K1_ROWS) FN(w, row_bytes, x, in, K1_ROWS, acc);                                                \
    else FN(w, row_bytes, x, in, R, acc);

/* The specialisations: Q8_R rows x 1..Q8_NB inputs, Q8_ROWS_1 rows x 1; anything else generic. */
#define Q_CASE(FN, K) case K: FN(w, ws, x, b0, in, Q8_R, (K) <= Q8_NB ? (K) : Q8_NB, acc); break;
#define Q_DISPATCH(FN)                                                                                       \
    if (R == Q8_ROWS_1 && NB == 1 && Q8_ROWS_1 != Q8_R)                                                     \
        FN(w, ws, x, b0, in, Q8_ROWS_1, 1, acc);                                                            \
    else switch (R == Q8_R ? NB : 0) {                                                                      \
        Q_CASE(FN, 1) Q_CASE(FN, 2) Q_CASE(FN, 3) Q_CASE(FN, 4)                                             \
        default: FN(w, ws, x, b0, in, R, NB, acc); break;                                                   \
    }
INLINE void tile_q8_(const int8_t *w, const void *ws, const Input *x, int64_t b0, int64_t in, int R, int NB,
                     float *acc) {
    (void)ws;
    tile_q8(w, x, b0, in, R, NB, acc);
}
INLINE void tile_q8_any(const int8_t *w, const Input *x, int64_t b0, int64_t in, int R, int NB, float *acc) {
    const void *ws = NULL;
    Q_DISPATCH(tile_q8_)
}
INLINE void tile_q4_any(const uint8_t *w, const uint16_t *ws, const Input *x, int64_t b0, int64_t in, int R,
                        int NB, float *acc) {
    if (in % (2 * QBLOCK) == 0) {
        Q_DISPATCH(tile_q4p)
    } else {
        Q_DISPATCH(tile_q4)
    }
}
/* R rows of GGUF type `type` (row_bytes apart) against NB inputs. Called once a tile, so kept out of line:
 * inlined into tile()'s callers it added a fifth or more to the library's compile time (10 s -> 12-15 s). */
static __attribute__((noinline)) void tile_ggml_any(int64_t type, const uint8_t *w, int64_t row_bytes,
                                                    const Input *x, int64_t b0, int64_t in, int R, int NB, float *acc) {
    const int64_t ws = row_bytes;  /* (the name Q_DISPATCH passes on) */
    if (k1_takes(type, x, NB)) {
        if (type == GGML_Q4_K) { K1_CASE(k1_tile_q4_k) }
        else if (type == GGML_Q5_K) { K1_CASE(k1_tile_q5_k) }
        else { K1_CASE(k1_tile_q6_k) }
        return;
    }
    switch (type) {
    case GGML_Q8_0: Q_DISPATCH(tile_q8_0) break;
    case GGML_Q4_0: Q_DISPATCH(tile_q4_0) break;
    case GGML_Q4_1: Q_DISPATCH(tile_q4_1) break;
    case GGML_Q5_0: Q_DISPATCH(tile_q5_0) break;
    case GGML_Q5_1: Q_DISPATCH(tile_q5_1) break;
    case GGML_Q2_K: Q_DISPATCH(tile_q2_k) break;
    case GGML_Q3_K: Q_DISPATCH(tile_q3_k) break;
    case GGML_Q4_K: Q_DISPATCH(tile_q4_k) break;
    case GGML_Q5_K: Q_DISPATCH(tile_q5_k) break;
    case GGML_Q6_K: Q_DISPATCH(tile_q6_k) break;
    }
}

/* ---- GGUF formats at batch: one output row per vector lane -------------------------------------------------
 * With several sequences the tiles above spend most of their instructions per (row, sequence, block): a
 * conversion, a scale and a share of a horizontal sum for every 32 products. Here each lane of a vector is an
 * output row instead. A block's weights of RL rows are unpacked once into 8 vectors, vector j holding values
 * 4j .. 4j + 3 of every row; each sequence's block then meets them in 8 dot-product instructions whose 4-byte
 * operand is its own, broadcast, and one conversion and one scale serve RL rows. The 32-value formats gather
 * their fields from the RL rows and unpack them there, as do Q4_K, Q5_K and Q6_K; Q2_K and Q3_K's blocks are
 * unpacked row by row (the unpackers above) and transposed. The weights take the unsigned side of the byte dot
 * products (rl_dots4): AVX-512 with VNNI runs 16 rows a vector, AVX2 8 (with AVX-VNNI's instruction, or two:
 * VPMADDUBSW, VPMADDWD). */
/* 4 input bytes as one int32, read where they lie (the dot product's broadcast operand, folded into it) */
typedef int32_t i32u __attribute__((may_alias, aligned(1)));
#if defined(__AVX512VNNI__) && X86_512
#define RL 16
#define RL_VNNI 1
typedef __m512i rl_i;
typedef __m512 rl_f;
INLINE rl_i rl_set1(int32_t v) { return _mm512_set1_epi32(v); }
INLINE rl_i rl_add(rl_i a, rl_i b) { return _mm512_add_epi32(a, b); }
INLINE rl_i rl_and(rl_i a, rl_i b) { return _mm512_and_si512(a, b); }
INLINE rl_i rl_or(rl_i a, rl_i b) { return _mm512_or_si512(a, b); }
INLINE rl_i rl_xor(rl_i a, rl_i b) { return _mm512_xor_si512(a, b); }
INLINE rl_i rl_abs8(rl_i a) { return _mm512_abs_epi8(a); }
INLINE rl_i rl_shr(rl_i a, int n) { return _mm512_srli_epi32(a, n); }
INLINE rl_i rl_shl(rl_i a, int n) { return _mm512_slli_epi32(a, n); }
INLINE rl_i rl_sar(rl_i a, int n) { return _mm512_srai_epi32(a, n); }
INLINE rl_i rl_sub8(rl_i a, rl_i b) { return _mm512_sub_epi8(a, b); }
INLINE rl_i rl_mullo(rl_i a, rl_i b) { return _mm512_mullo_epi32(a, b); }
INLINE rl_i rl_lane_index(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
INLINE rl_i rl_min(rl_i a, rl_i b) { return _mm512_min_epi32(a, b); }
/* the 4 bytes at base + at[lane] (any alignment) */
INLINE rl_i rl_gather(const void *base, rl_i at) { return _mm512_i32gather_epi32(at, base, 1); }
/* the float16 in the low half of each lane, as float */
INLINE rl_f rl_half_low(rl_i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
INLINE rl_f rl_cvt(rl_i v) { return _mm512_cvtepi32_ps(v); }
INLINE rl_f rl_fma(rl_f a, rl_f b, rl_f c) { return _mm512_fmadd_ps(a, b, c); }
INLINE rl_f rl_mul(rl_f a, rl_f b) { return _mm512_mul_ps(a, b); }
INLINE rl_f rl_sub_f(rl_f a, rl_f b) { return _mm512_sub_ps(a, b); }
INLINE rl_f rl_setf(float v) { return _mm512_set1_ps(v); }
INLINE rl_f rl_load(const float *p) { return _mm512_load_ps(p); }
INLINE void rl_put(float *p, rl_f v) { _mm512_store_ps(p, v); }
#else
/* AVX2: 8 rows a vector, with VNNI's 256-bit dot product where there is one, else VPMADDUBSW's (see rl_dots4) */
#define RL 8
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define RL_VNNI 1
#else
#define RL_VNNI 0
#endif
typedef __m256i rl_i;
typedef __m256 rl_f;
INLINE rl_i rl_set1(int32_t v) { return _mm256_set1_epi32(v); }
INLINE rl_i rl_add(rl_i a, rl_i b) { return _mm256_add_epi32(a, b); }
INLINE rl_i rl_and(rl_i a, rl_i b) { return _mm256_and_si256(a, b); }
INLINE rl_i rl_or(rl_i a, rl_i b) { return _mm256_or_si256(a, b); }
INLINE rl_i rl_xor(rl_i a, rl_i b) { return _mm256_xor_si256(a, b); }
INLINE rl_i rl_shr(rl_i a, int n) { return _mm256_srli_epi32(a, n); }
INLINE rl_i rl_shl(rl_i a, int n) { return _mm256_slli_epi32(a, n); }
INLINE rl_i rl_sar(rl_i a, int n) { return _mm256_srai_epi32(a, n); }
INLINE rl_i rl_sub8(rl_i a, rl_i b) { return _mm256_sub_epi8(a, b); }
INLINE rl_i rl_mullo(rl_i a, rl_i b) { return _mm256_mullo_epi32(a, b); }
INLINE rl_i rl_abs8(rl_i a) { return _mm256_abs_epi8(a); }
INLINE rl_i rl_lane_index(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
INLINE rl_i rl_min(rl_i a, rl_i b) { return _mm256_min_epi32(a, b); }
INLINE rl_i rl_gather(const void *base, rl_i at) { return _mm256_i32gather_epi32((const int *)base, at, 1); }
INLINE rl_f rl_half_low(rl_i v) {
    const __m256i low = _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
}
INLINE rl_f rl_cvt(rl_i v) { return _mm256_cvtepi32_ps(v); }
INLINE rl_f rl_fma(rl_f a, rl_f b, rl_f c) { return _mm256_fmadd_ps(a, b, c); }
INLINE rl_f rl_mul(rl_f a, rl_f b) { return _mm256_mul_ps(a, b); }
INLINE rl_f rl_sub_f(rl_f a, rl_f b) { return _mm256_sub_ps(a, b); }
INLINE rl_f rl_setf(float v) { return _mm256_set1_ps(v); }
INLINE rl_f rl_load(const float *p) { return _mm256_load_ps(p); }
INLINE void rl_put(float *p, rl_f v) { _mm256_store_ps(p, v); }
#endif

#if !defined(PC_RL_NB)
#define PC_RL_NB 16
#endif
#define RL_NB PC_RL_NB  /* sequences a tile: the weights of a tile are unpacked once for this many */
/* The smallest batch that takes these tiles: the 32-value formats from 2 sequences, the K-quants from 3. Measured
 * on Gemma 3 270M's layers (Q8_0 16384 x 640, Q5_0 2048 x 640, Q4_K 640 x 1024, Q6_K 640 x 2048), one thread,
 * AVX-512, time per sequence against batch 1's: at 2 sequences Q8_0 and Q5_0 took 0.43-0.67 here against
 * 0.71-0.81 on the per-row tiles, the K-quants 0.59-0.83 against 0.66-0.91 (a draw, when every K-quant was still
 * unpacked row by row); from 3 every format, 0.33-0.58 against 0.56-0.74. */
#if !defined(PC_RL_MIN)
#define PC_RL_MIN 2
#endif
#define RL_MIN PC_RL_MIN

/* The sum of the first 16 of a block's 32 input bytes (a Q2_K, Q3_K or Q6_K scale covers 16 values). */
INLINE int32_t half_sum(const int8_t *x) {
    const __m128i biased = _mm_xor_si128(_mm_loadu_si128((const __m128i *)x), _mm_set1_epi8((char)0x80));
    const __m128i sums = _mm_sad_epu8(biased, _mm_setzero_si128());
    return _mm_cvtsi128_si32(sums) + _mm_extract_epi16(sums, 4) - 16 * 128;
}

/* Block k of RL rows: wt[j] = values 4j .. 4j + 3 of each row, as bytes (unsigned, or signed for the WSIGNED
 * formats until rl_signed makes them what rl_dots4 takes), and per row the scale and min of values 0-15 (s[0],
 * m[0]) and 16-31 (s[1], m[1]). */
typedef struct {
    rl_i wt[8];
#if !RL_VNNI
    rl_i wabs[8];  /* signed formats: |wt|, VPMADDUBSW's unsigned side (rl_dots4) */
#endif
    rl_f s[2], m[2];
} LaneBlock;

/* A signed format's block as rl_dots4 takes it: with VNNI w + 128 (unsigned, the dot product's 128 x the
 * input's sum taken off again by the caller); without, |w| beside w (the sign trick: |w| . (x * sign(w))). */
INLINE void rl_signed(LaneBlock *lb) {
    for (int j = 0; j < 8; j++)
#if RL_VNNI
        lb->wt[j] = rl_xor(lb->wt[j], rl_set1((int32_t)0x80808080));
#else
        lb->wabs[j] = rl_abs8(lb->wt[j]);
#endif
}

/* t + the dot products of values 4 j0 .. 4 j0 + 15 of each row with the input block xb's, every lane exact.
 * VNNI: one VPDPBUSD per 4 values, the input's 4 bytes broadcast. Without: VPMADDUBSW's pairs are int16 and
 * saturate, so `group` (1, 2 or 4) of them are summed before VPMADDWD widens them: as many as a weight of at most
 * WMAX allows (group x 2 x WMAX x 127 <= 32767; Q8_0's -128 allows one). */
INLINE rl_i rl_dots4(rl_i t, const LaneBlock *lb, const int8_t *xb, int j0, int wsigned, int group) {
#if RL_VNNI
    (void)wsigned, (void)group;
    for (int j = j0; j < j0 + 4; j++) {
#if RL == 16
        t = _mm512_dpbusd_epi32(t, lb->wt[j], _mm512_set1_epi32(*(const i32u *)(xb + 4 * j)));
#else
        t = dot_acc_u8i8(t, lb->wt[j], _mm256_set1_epi32(*(const i32u *)(xb + 4 * j)));
#endif
    }
#else
    for (int g = j0; g < j0 + 4; g += group) {
        __m256i pairs = _mm256_setzero_si256();
        for (int j = g; j < g + group; j++) {
            const __m256i x = _mm256_set1_epi32(*(const i32u *)(xb + 4 * j));
            pairs = _mm256_add_epi16(pairs, wsigned ? _mm256_maddubs_epi16(lb->wabs[j], _mm256_sign_epi8(x, lb->wt[j]))
                                                    : _mm256_maddubs_epi16(lb->wt[j], x));
        }
        t = _mm256_add_epi32(t, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
#endif
    return t;
}

/* Where a tile's rows are: the byte offset of each lane's row (lanes from R on repeat row R - 1), and for the
 * K-quants their sub-block scales and a block's unpacked rows before the transposition. */
typedef struct {
    rl_i at;
    int64_t row_bytes;
    int R;
    KScales ks[RL];
    uint8_t rows[RL][QBLOCK] __attribute__((aligned(64)));
    float s[2][RL] __attribute__((aligned(64))), m[2][RL] __attribute__((aligned(64)));
    rl_i kscales[3];  /* Q4_K, Q5_K: a super-block's 12 bytes of scales and mins, per row */
    rl_f kd, kdmin;   /*   and its d and dmin */
} LaneRows;

/* 16 bytes of nibbles at p in each row: low nibbles are values 0-15, high ones 16-31 */
INLINE void lane_nibbles(const uint8_t *p, const LaneRows *lr, LaneBlock *lb) {
    const rl_i low = rl_set1(0x0f0f0f0f);
    for (int j = 0; j < 4; j++) {
        const rl_i g = rl_gather(p + 4 * j, lr->at);
        lb->wt[j] = rl_and(g, low), lb->wt[4 + j] = rl_and(rl_shr(g, 4), low);
    }
}
/* Q5_0 and Q5_1's fifth bits (bit i of the u32 at p: value i) as 0x10 in the bytes of each wt[j]: bits 4j .. 4j+3
 * spread to bytes 0-3 by one multiplication (shifts 4, 11, 18 and 25: no two copies overlap) */
INLINE void lane_fifth_bits(const uint8_t *p, const LaneRows *lr, LaneBlock *lb) {
    const rl_i bits = rl_gather(p, lr->at), four = rl_set1(0x0f), spread = rl_set1(0x02040810);
    for (int j = 0; j < 8; j++)
        lb->wt[j] = rl_or(lb->wt[j], rl_and(rl_mullo(rl_and(rl_shr(bits, 4 * j), four), spread), rl_set1(0x10101010)));
}
/* the float16 pair at p of each row (d, or d and m) */
INLINE void lane_scale(const uint8_t *p, const LaneRows *lr, LaneBlock *lb, int has_min) {
    const rl_i both = rl_gather(p, lr->at);
    lb->s[0] = lb->s[1] = rl_half_low(both);
    lb->m[0] = lb->m[1] = has_min ? rl_half_low(rl_shr(both, 16)) : rl_setf(0.f);
}
INLINE void lane_q8_0(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {  /* d | 32 int8 */
    const uint8_t *b = w + k * 34;
    for (int j = 0; j < 8; j++) lb->wt[j] = rl_gather(b + 2 + 4 * j, lr->at);
    lane_scale(b, lr, lb, 0);
}
INLINE void lane_q4_0(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {  /* d | nibbles */
    const uint8_t *b = w + k * 18;
    lane_nibbles(b + 2, lr, lb);
    lane_scale(b, lr, lb, 0);
}
INLINE void lane_q4_1(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {  /* d, m | nibbles */
    const uint8_t *b = w + k * 20;
    lane_nibbles(b + 4, lr, lb);
    lane_scale(b, lr, lb, 1);
}
INLINE void lane_q5_0(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {  /* d | fifth bits | nibbles */
    const uint8_t *b = w + k * 22;
    lane_nibbles(b + 6, lr, lb);
    lane_fifth_bits(b + 2, lr, lb);
    lane_scale(b, lr, lb, 0);
}
INLINE void lane_q5_1(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {  /* d, m | fifth bits | nibbles */
    const uint8_t *b = w + k * 24;
    lane_nibbles(b + 8, lr, lb);
    lane_fifth_bits(b + 4, lr, lb);
    lane_scale(b, lr, lb, 1);
}
/* Q4_K and Q5_K: sub-block j's scale and min (k_scale_min's fields, from the three words of 12 bytes gathered
 * once a super-block), as d * scale and -dmin * min */
INLINE void lane_k_scale_min(const uint8_t *sb, int j, LaneRows *lr, LaneBlock *lb) {
    if (j == 0) {
        for (int i = 0; i < 3; i++) lr->kscales[i] = rl_gather(sb + 4 + 4 * i, lr->at);
        const rl_i dm = rl_gather(sb, lr->at);
        lr->kd = rl_half_low(dm), lr->kdmin = rl_half_low(rl_shr(dm, 16));
    }
    const rl_i *w = lr->kscales, six = rl_set1(63), four = rl_set1(15), two = rl_set1(3);
    rl_i sc, mn;
    if (j < 4) {
        sc = rl_and(rl_shr(w[0], 8 * j), six), mn = rl_and(rl_shr(w[1], 8 * j), six);
    } else {
        const int b = 8 * (j - 4);
        sc = rl_or(rl_and(rl_shr(w[2], b), four), rl_shl(rl_and(rl_shr(w[0], b + 6), two), 4));
        mn = rl_or(rl_and(rl_shr(w[2], b + 4), four), rl_shl(rl_and(rl_shr(w[1], b + 6), two), 4));
    }
    lb->s[0] = lb->s[1] = rl_mul(rl_cvt(sc), lr->kd);
    lb->m[0] = lb->m[1] = rl_mul(rl_cvt(mn), rl_sub_f(rl_setf(0.f), lr->kdmin));
}
/* Q4_K: d, dmin | 12 bytes of scales | 128 bytes, a run of 32 holding sub-block 2i in its low nibbles and 2i + 1
 * in its high ones (value i of the sub-block in byte i) */
INLINE void lane_q4_k(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {
    const uint8_t *sb = w + k / 8 * 144;
    const int j = (int)(k % 8);
    const rl_i low = rl_set1(0x0f0f0f0f);
    for (int i = 0; i < 8; i++)
        lb->wt[i] = rl_and(rl_shr(rl_gather(sb + 16 + 32 * (j / 2) + 4 * i, lr->at), 4 * (j & 1)), low);
    lane_k_scale_min(sb, j, lr, lb);
}
/* Q5_K: as Q4_K, with 32 bytes of fifth bits at 16 (bit j of byte i: value i of sub-block j), the nibbles at 48 */
INLINE void lane_q5_k(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {
    const uint8_t *sb = w + k / 8 * 176;
    const int j = (int)(k % 8);
    const rl_i low = rl_set1(0x0f0f0f0f), one = rl_set1(0x01010101);
    for (int i = 0; i < 8; i++) {
        const rl_i nib = rl_and(rl_shr(rl_gather(sb + 48 + 32 * (j / 2) + 4 * i, lr->at), 4 * (j & 1)), low);
        const rl_i fifth = rl_and(rl_shr(rl_gather(sb + 16 + 4 * i, lr->at), j), one);
        lb->wt[i] = rl_or(nib, rl_shl(fifth, 4));
    }
    lane_k_scale_min(sb, j, lr, lb);
}
/* Q6_K (wb_q6_k's layout): 128 bytes of low nibbles | 64 of high 2-bit fields | 16 int8 scales | d; a value is
 * (d * scale) * (q - 32), a scale per 16 values. Every gather stays inside the 210-byte block: d is read as the
 * high half of the 4 bytes at 206. */
INLINE void lane_q6_k(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {
    const uint8_t *sb = w + k / 8 * 210;
    const int j = (int)(k % 8), h = j / 4, run = j % 4;
    const rl_i low = rl_set1(0x0f0f0f0f), two = rl_set1(0x03030303), offset = rl_set1(0x20202020);
    for (int i = 0; i < 8; i++) {
        const rl_i nib = rl_and(rl_shr(rl_gather(sb + 64 * h + 32 * (run & 1) + 4 * i, lr->at), 4 * (run >> 1)), low);
        const rl_i top = rl_and(rl_shr(rl_gather(sb + 128 + 32 * h + 4 * i, lr->at), 2 * run), two);
        lb->wt[i] = rl_sub8(rl_or(nib, rl_shl(top, 4)), offset);
    }
    const rl_f d = rl_half_low(rl_shr(rl_gather(sb + 206, lr->at), 16));
    const rl_i scales = rl_gather(sb + 192 + 2 * j, lr->at);   /* bytes 2j and 2j + 1: the two halves' */
    lb->s[0] = rl_mul(rl_cvt(rl_sar(rl_shl(scales, 24), 24)), d);
    lb->s[1] = rl_mul(rl_cvt(rl_sar(rl_shl(scales, 16), 24)), d);
    lb->m[0] = lb->m[1] = rl_setf(0.f);
}
/* Q2_K and Q3_K: each row's block by its unpacker (its super-block's scales decoded first), then transposed */
#define LANE_BY_ROWS(NAME, PREP, UNPACK, BYTES256)                                                            \
    INLINE void NAME(const uint8_t *w, int64_t k, LaneRows *lr, LaneBlock *lb) {                            \
        if (k % 8 == 0)                                                                                     \
            for (int r = 0; r < lr->R; r++) PREP(w + r * lr->row_bytes + k / 8 * BYTES256, &lr->ks[r]);     \
        for (int r = 0; r < RL; r++) {                                                                      \
            const int from = r < lr->R ? r : lr->R - 1;                                                     \
            const WBlock wb = UNPACK(w + from * lr->row_bytes, k, &lr->ks[from]);                           \
            _mm256_store_si256((__m256i *)lr->rows[r], wb.q);                                               \
            lr->s[0][r] = wb.s[0], lr->s[1][r] = wb.s[4], lr->m[0][r] = wb.m[0], lr->m[1][r] = wb.m[4];     \
        }                                                                                                   \
        const rl_i rows = rl_mullo(rl_lane_index(), rl_set1(QBLOCK));                                       \
        for (int j = 0; j < 8; j++) lb->wt[j] = rl_gather(lr->rows, rl_add(rows, rl_set1(4 * j)));        \
        for (int h = 0; h < 2; h++) lb->s[h] = rl_load(lr->s[h]), lb->m[h] = rl_load(lr->m[h]);             \
    }
LANE_BY_ROWS(lane_q2_k, prep_q2_k, wb_q2_k, 84)
LANE_BY_ROWS(lane_q3_k, prep_q3_k, wb_q3_k, 110)

/* out[b * RL + r] = sum over blocks of d[b, block] * (w[r, block] . q[b, block]) for R <= RL rows (row_bytes
 * apart) and NB <= RL_NB inputs. LOAD unpacks a block of the rows; WSIGNED, OFFSET and WMIN mean what
 * GGML_TILE's do, and HALVES says whether a block has one scale (1) or one per 16 values (2). */
#define GGML_ROWS(NAME, LOAD, WSIGNED, OFFSET, WMIN, HALVES, WMAX)                                             \
    static void NAME(const uint8_t *w, int64_t row_bytes, const Input *in_, int64_t b0, int64_t in, int R,    \
                     int NB, float *out) {                                                                  \
        const int64_t blocks = in / QBLOCK;                                                                 \
        const int8_t *q = in_->q + b0 * in;                                                                 \
        const float *d = in_->d + b0 * blocks;                                                              \
        const int32_t *sum = in_->sum + b0 * blocks;                                                        \
        const int group = 4 * 254 * WMAX <= 32767 ? 4 : 2 * 254 * WMAX <= 32767 ? 2 : 1;                   \
        LaneRows lr;                                                                                        \
        lr.at = rl_mullo(rl_min(rl_lane_index(), rl_set1(R - 1)), rl_set1((int32_t)row_bytes));             \
        lr.row_bytes = row_bytes, lr.R = R;                                                                 \
        lr.kscales[0] = lr.kscales[1] = lr.kscales[2] = rl_set1(0), lr.kd = lr.kdmin = rl_setf(0.f);        \
        for (int b = 0; b < NB; b++) rl_put(out + b * RL, rl_setf(0.f));                                    \
        for (int64_t k = 0; k < blocks; k++) {                                                              \
            LaneBlock lb;                                                                                   \
            LOAD(w, k, &lr, &lb);                                                                           \
            if (WSIGNED) rl_signed(&lb);                                                                    \
            for (int b = 0; b < NB; b++) {                                                                  \
                const int8_t *xb = q + b * in + k * QBLOCK;                                                 \
                const float xd = d[b * blocks + k];                                                         \
                const int32_t xs = sum[b * blocks + k];                                                     \
                rl_f a = rl_load(out + b * RL);                                                             \
                if (HALVES == 1) {                                                                          \
                    /* two chains of four: a chain of eight waits out eight latencies */                    \
                    rl_i t = rl_set1((WSIGNED ? -128 * RL_VNNI : -OFFSET) * xs);                             \
                    t = rl_dots4(t, &lb, xb, 0, WSIGNED, group);                                             \
                    const rl_i u = rl_dots4(rl_set1(0), &lb, xb, 4, WSIGNED, group);                         \
                    a = rl_fma(rl_cvt(rl_add(t, u)), rl_mul(lb.s[0], rl_setf(xd)), a);                      \
                    if (WMIN) a = rl_fma(lb.m[0], rl_setf(xd * (float)xs), a);                              \
                } else {                                                                                    \
                    const int32_t h = half_sum(xb);                                                         \
                    const rl_i t0 = rl_dots4(rl_set1(WSIGNED ? -128 * RL_VNNI * h : 0), &lb, xb, 0, WSIGNED, group); \
                    const rl_i t1 = rl_dots4(rl_set1(WSIGNED ? -128 * RL_VNNI * (xs - h) : 0), &lb, xb, 4, WSIGNED,  \
                                             group);                                                        \
                    a = rl_fma(rl_cvt(t0), rl_mul(lb.s[0], rl_setf(xd)), a);                                \
                    a = rl_fma(rl_cvt(t1), rl_mul(lb.s[1], rl_setf(xd)), a);                                \
                    if (WMIN) {                                                                             \
                        a = rl_fma(lb.m[0], rl_setf(xd * (float)h), a);                                     \
                        a = rl_fma(lb.m[1], rl_setf(xd * (float)(xs - h)), a);                              \
                    }                                                                                       \
                }                                                                                           \
                rl_put(out + b * RL, a);                                                                    \
            }                                                                                               \
        }                                                                                                   \
    }
GGML_ROWS(rows_q8_0, lane_q8_0, 1, 0, 0, 1, 128)
GGML_ROWS(rows_q4_0, lane_q4_0, 0, 8, 0, 1, 15)
GGML_ROWS(rows_q4_1, lane_q4_1, 0, 0, 1, 1, 15)
GGML_ROWS(rows_q5_0, lane_q5_0, 0, 16, 0, 1, 31)
GGML_ROWS(rows_q5_1, lane_q5_1, 0, 0, 1, 1, 31)
GGML_ROWS(rows_q2_k, lane_q2_k, 0, 0, 2, 2, 3)
GGML_ROWS(rows_q3_k, lane_q3_k, 1, 0, 0, 2, 4)
GGML_ROWS(rows_q4_k, lane_q4_k, 0, 0, 1, 1, 15)
GGML_ROWS(rows_q5_k, lane_q5_k, 0, 0, 1, 1, 31)
GGML_ROWS(rows_q6_k, lane_q6_k, 1, 0, 0, 2, 32)

static void rows_ggml_any(int64_t type, const uint8_t *w, int64_t row_bytes, const Input *x, int64_t b0,
                          int64_t in, int R, int NB, float *out) {
    switch (type) {
    case GGML_Q8_0: rows_q8_0(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q4_0: rows_q4_0(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q4_1: rows_q4_1(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q5_0: rows_q5_0(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q5_1: rows_q5_1(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q2_K: rows_q2_k(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q3_K: rows_q3_k(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q4_K: rows_q4_k(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q5_K: rows_q5_k(w, row_bytes, x, b0, in, R, NB, out); break;
    case GGML_Q6_K: rows_q6_k(w, row_bytes, x, b0, in, R, NB, out); break;
    }
}
#else
INLINE void tile_q8_any(const int8_t *w, const Input *x, int64_t b0, int64_t in, int R, int NB, float *acc) {
    const int64_t blocks = in / QBLOCK;
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) {
            const int8_t *q = x->q + (b0 + b) * in, *wr = w + r * in;
            float total = 0.f;
            for (int64_t k = 0; k < blocks; k++) {
                int32_t dot = 0;
                for (int j = 0; j < QBLOCK; j++) dot += (int32_t)q[k * QBLOCK + j] * wr[k * QBLOCK + j];
                total += (float)dot * x->d[(b0 + b) * blocks + k];
            }
            acc[r * MAX_NB + b] = total;
        }
}
INLINE void tile_q4_any(const uint8_t *w, const uint16_t *ws, const Input *x, int64_t b0, int64_t in, int R,
                        int NB, float *acc) {
    const int64_t blocks = in / QBLOCK;
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) {
            const int8_t *q = x->q + (b0 + b) * in;
            const uint8_t *wr = w + r * (in / 2);
            float total = 0.f;
            for (int64_t k = 0; k < blocks; k++) {
                int32_t dot = 0;
                for (int j = 0; j < QBLOCK / 2; j++) {
                    const uint8_t byte = wr[k * QBLOCK / 2 + j];
                    dot += ((byte & 0x0f) - 8) * (int32_t)q[k * QBLOCK + j];
                    dot += ((byte >> 4) - 8) * (int32_t)q[k * QBLOCK + QBLOCK / 2 + j];
                }
                total += (float)dot * (f16_to_f32(ws[r * blocks + k]) * x->d[(b0 + b) * blocks + k]);
            }
            acc[r * MAX_NB + b] = total;
        }
}
INLINE void tile_ggml_any(int64_t type, const uint8_t *w, int64_t row_bytes, const Input *x, int64_t b0, int64_t in,
                          int R, int NB, float *acc) {
    const int64_t blocks = in / QBLOCK;
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r * MAX_NB + b] = 0.f;
    for (int r = 0; r < R; r++)
        for (int64_t k = 0; k < blocks; k++) {
            int8_t q[QBLOCK];
            float s[2], m[2];
            ggml_block(type, w + r * row_bytes, k, q, s, m);
            for (int b = 0; b < NB; b++) {
                const int8_t *xq = x->q + (b0 + b) * in + k * QBLOCK;
                int32_t lo = 0, hi = 0, xlo = 0;  /* the two halves' dot products, the first half's sum of q */
                for (int i = 0; i < QBLOCK / 2; i++)
                    lo += (int32_t)q[i] * xq[i], hi += (int32_t)q[i + 16] * xq[i + 16], xlo += xq[i];
                const int64_t at = (b0 + b) * blocks + k;
                const float mins = m[0] * (float)xlo + m[1] * (float)(x->sum[at] - xlo);
                acc[r * MAX_NB + b] += x->d[at] * (((float)lo * s[0] + (float)hi * s[1]) + mins);
            }
        }
}
#endif

/* The threads of a step: who I am, and the barrier between phases that need each other's results.
 *
 * Not OpenMP's barrier: pagedchat runs OpenMP with passive waiting (threads.py: spinning threads beside a
 * busy process slowed decode 20-100x), and a passive barrier sleeps and wakes at every one of a step's ~50
 * phases (measured: a 2-thread int8 step of the small llama took 5.4 ms with OpenMP's barriers, 1.7 ms with
 * this one and the phases it fuses: norms per thread, residuals in the matmul, SiLU in gate-up). It spins
 * briefly (on a free machine the other threads arrive within microseconds), then sleeps
 * on a futex: beside a busy process a thread of ours is often preempted, and a waiter that kept the core
 * (spinning or sched_yield) would keep it from the very thread it waits for. */
typedef struct {
    _Atomic int arrived, generation, sleepers;
    _Atomic int64_t next_tile;  /* the next unclaimed row tile of the running linear layer */
} Barrier;

typedef struct {
    int tid, n;
    Barrier *barrier;
} Team;

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif
#define SPINS_BEFORE_SLEEP 1000

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
static void sleep_while(_Atomic int *word, int value) {
    syscall(SYS_futex, (int *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}
static void wake_all(_Atomic int *word) { syscall(SYS_futex, (int *)word, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0); }
#else
static void sleep_while(_Atomic int *word, int value) { (void)word; (void)value; sched_yield(); }
static void wake_all(_Atomic int *word) { (void)word; }
#endif

static void sync_team(const Team *t) {
    Barrier *b = t->barrier;
    if (t->n == 1) {
        atomic_store_explicit(&b->next_tile, 0, memory_order_relaxed);
        return;
    }
    const int generation = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == t->n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->next_tile, 0, memory_order_relaxed);  /* everyone is here: the next phase's */
        /* seq_cst, as the sleeper's side: its (sleepers++, read generation) and this (generation++, read
         * sleepers) must not both miss the other's write */
        atomic_fetch_add(&b->generation, 1);
        if (atomic_load(&b->sleepers) > 0) wake_all(&b->generation);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == generation; spins++) {
        if (spins < SPINS_BEFORE_SLEEP) {
            CPU_RELAX();
            continue;
        }
        atomic_fetch_add(&b->sleepers, 1);
        /* returns at once if the generation moved since the load: no lost wake-up */
        sleep_while(&b->generation, generation);
        atomic_fetch_sub_explicit(&b->sleepers, 1, memory_order_acq_rel);
    }
}

/* This thread's contiguous share [*lo, *hi) of n items. */
INLINE void share(const Team *t, int64_t n, int64_t *lo, int64_t *hi) {
    const int64_t chunk = (n + t->n - 1) / t->n;
    *lo = t->tid * chunk < n ? t->tid * chunk : n;
    *hi = *lo + chunk < n ? *lo + chunk : n;
}

/* The specialisations the inliner keeps apart: TILE_R rows x 1..MAX_NB sequences (a case above MAX_NB is
 * never taken) and ROWS_1 rows x 1 sequence; a tail of rows goes generic. */
#define NB_CASE(FN, W, K)                                                                                    \
    case K: FN(W, x, in, rstride, xstride, TILE_R, (K) <= MAX_NB ? (K) : MAX_NB, fetch, acc); break;
#define DISPATCH(FN, W)                                                                                      \
    if (R == ROWS_1 && NB == 1 && ROWS_1 != TILE_R)                                                         \
        FN(W, x, in, rstride, xstride, ROWS_1, 1, fetch, acc);                                              \
    else switch (R == TILE_R ? NB : 0) {                                                                    \
        NB_CASE(FN, W, 1) NB_CASE(FN, W, 2) NB_CASE(FN, W, 3) NB_CASE(FN, W, 4)                             \
        NB_CASE(FN, W, 5) NB_CASE(FN, W, 6) NB_CASE(FN, W, 7) NB_CASE(FN, W, 8)                             \
        default: FN(W, x, in, rstride, xstride, R, NB, fetch, acc); break;                                  \
    }

/* Whether a GGUF part is in a float type (F16, BF16), read with the fp32 input as fp32 weights are. */
INLINE int ggml_float(int64_t format) { return format == FMT_GGML + GGML_F16 || format == FMT_GGML + GGML_BF16; }

/* Whether layer l runs on integer dot products (its input quantized per block; the parts of a layer of several
 * formats are all GGUF block formats, which read the same blocks, or all float ones: step.py binds no mix). */
INLINE int integer_path(const Linear *l) {
    return (l->format == FMT_I8 || l->format == FMT_I4 || (l->format > FMT_GGML && !ggml_float(l->format)))
        && l->in % QBLOCK == 0;
}

/* Whether layer l's batch-1 tiles are k1_tile's (some part of it in Q4_K, Q5_K or Q6_K; whole super-blocks). */
INLINE int k1_layer(const Linear *l) {
    if (!Q8_SIMD || !PC_K1 || l->in % 256 != 0) return 0;
    for (const Linear *part = l; part != NULL; part = part->next)
        if (k1_format(part->format)) return 1;
    return 0;
}

/* Bytes of a row of `in` values in a GGUF format (whole blocks: the Python side checked). */
INLINE int64_t ggml_row_bytes(int64_t type, int64_t in) {
    switch (type) {
    case GGML_Q8_0: return in / 32 * 34;
    case GGML_Q4_0: return in / 32 * 18;
    case GGML_Q4_1: return in / 32 * 20;
    case GGML_Q5_0: return in / 32 * 22;
    case GGML_Q5_1: return in / 32 * 24;
    case GGML_F16: case GGML_BF16: return in * 2;
    case GGML_Q2_K: return in / 256 * 84;
    case GGML_Q3_K: return in / 256 * 110;
    case GGML_Q4_K: return in / 256 * 144;
    case GGML_Q5_K: return in / 256 * 176;
    default: return in / 256 * 210;  /* GGML_Q6_K */
    }
}

/* A linear layer's tile shape at batch B: rows a tile, most sequences a tile. */
INLINE void tile_shape(const Linear *l, int64_t B, int *rows, int *seqs) {
    if (integer_path(l)) {
        *rows = B == 1 ? (k1_layer(l) ? K1_ROWS : Q8_ROWS_1) : Q8_R;
        *seqs = Q8_NB;
    } else {
        *rows = B == 1 ? ROWS_1 : TILE_R;
        *seqs = MAX_NB;
    }
}

/* acc[r * MAX_NB + b] = rows r0 .. r0+R of one part of a layer (scaled) against sequences b0 .. b0+NB. */
static void part_tile(const Linear *l, int64_t r0, int R, const Input *input, int64_t b0, int NB, float *acc) {
    const int64_t in = l->in, rstride = in, xstride = in;
    const int fetch = b0 == 0;
    const float *x = input->x + b0 * in;
    if (ggml_float(l->format)) {
        const uint16_t *w = (const uint16_t *)l->weight + r0 * in;
        if (l->format == FMT_GGML + GGML_F16) {
            DISPATCH(tile_f16, w)
        } else {
            DISPATCH(tile_bf16, w)
        }
    } else if (l->format > FMT_GGML) {
        const int64_t type = l->format - FMT_GGML, row_bytes = ggml_row_bytes(type, in);
        tile_ggml_any(type, (const uint8_t *)l->weight + r0 * row_bytes, row_bytes, input, b0, in, R, NB, acc);
    } else if (l->format == FMT_I4) {
        tile_q4_any((const uint8_t *)l->weight + r0 * (in / 2), (const uint16_t *)l->scales + r0 * (in / QBLOCK),
                    input, b0, in, R, NB, acc);
    } else if (integer_path(l)) {
        tile_q8_any((const int8_t *)l->weight + r0 * in, input, b0, in, R, NB, acc);
    } else if (l->format == FMT_I8) {
        const int8_t *w = (const int8_t *)l->weight + r0 * in;
        DISPATCH(tile_i8, w)
    } else {
        const float *w = (const float *)l->weight + r0 * in;
        DISPATCH(tile_f32, w)
    }
    if (l->format == FMT_I8)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < NB; b++) acc[r * MAX_NB + b] *= ((const float *)l->scales)[r0 + r];
}

/* acc[r * MAX_NB + b] = rows r0 .. r0+R of l (scaled, biased) against sequences b0 .. b0+NB of the input. A tile
 * across two parts of a layer of several formats runs as two (one tile per part boundary: the split tiles
 * take the unspecialised shapes, at no measurable cost). */
static void tile(const Linear *l, int64_t r0, int R, const Input *input, int64_t b0, int NB, float *acc) {
    const Linear *part = l;
    int64_t at = r0;
    for (int done = 0; done < R;) {
        while (at >= part->rows) at -= part->rows, part = part->next;
        const int n = (int)(R - done < part->rows - at ? R - done : part->rows - at);
        part_tile(part, at, n, input, b0, NB, acc + done * MAX_NB);
        done += n, at += n;
    }
    if (l->bias)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < NB; b++) acc[r * MAX_NB + b] += l->bias[r0 + r];
}

/* Claims the next GRAB row tiles of the running linear layer into [*lo, *hi); false when none are left.
 *
 * Rows are claimed, not split in fixed shares: a thread that runs slower (its core shared with another
 * process) does fewer tiles instead of holding every phase up until its fixed half is done. */
#define GRAB 8
static int claim_n(const Team *t, int64_t tiles, int64_t grab, int64_t *lo, int64_t *hi) {
    *lo = atomic_fetch_add_explicit(&t->barrier->next_tile, grab, memory_order_relaxed);
    *hi = *lo + grab < tiles ? *lo + grab : tiles;
    return *lo < tiles;
}
INLINE int claim(const Team *t, int64_t tiles, int64_t *lo, int64_t *hi) { return claim_n(t, tiles, GRAB, lo, hi); }

/* The input of layer l: the rows, and for an integer layer their blocks, quantized into this thread's buffers
 * (each thread quantizes for itself: B x in values instead of a barrier). */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *sum;
} QuantBuffers;

INLINE Input input_for(const Linear *l, const float *x, int64_t B, const QuantBuffers *buf) {
    Input input = {x, NULL, NULL, NULL, NULL};
    if (Q8_SIMD && l->format == FMT_I4 && l->in % (2 * QBLOCK) == 0)
        quantize_pairs(x, B * l->in / (2 * QBLOCK), buf->q, buf->d, buf->sum);
    else if (integer_path(l))
        quantize_blocks(x, B * l->in / QBLOCK, buf->q, buf->d, buf->sum);
    else
        return input;
    input.q = buf->q, input.d = buf->d, input.sum = buf->sum;
    if (B == 1 && k1_layer(l)) {
        /* the batch-1 K-quant tiles' 16-value sums, in the room quantize_pairs' layout leaves behind the sums */
        int32_t *sum16 = buf->sum + l->in / QBLOCK;
        sums16(buf->q, l->in, sum16);
        input.sum16 = sum16;
    }
    return input;
}

#if defined(RL)
/* Whether layer l takes the row-per-lane tiles at batch B: GGUF block formats (all its parts: step.py binds no
 * mix of block and float formats) and enough sequences to share a tile's unpacking. */
INLINE int rows_path(const Linear *l, int64_t B) {
    const int k_quant = l->format >= FMT_GGML + GGML_Q2_K && l->format <= FMT_GGML + GGML_Q6_K;
    return B >= RL_MIN + k_quant && l->format > FMT_GGML && integer_path(l);
}

/* out[b * RL + r] = rows r0 .. r0+R (R <= RL) of l (biased) against sequences b0 .. b0+NB; a tile across two
 * parts of a layer runs as one tile per part, as tile() does. */
static void rows_tile(const Linear *l, int64_t r0, int R, const Input *input, int64_t b0, int NB, float *out) {
    float part_out[RL_NB * RL] __attribute__((aligned(64)));
    const Linear *part = l;
    int64_t at = r0;
    for (int done = 0; done < R;) {
        while (at >= part->rows) at -= part->rows, part = part->next;
        const int n = (int)(R - done < part->rows - at ? R - done : part->rows - at);
        const int64_t type = part->format - FMT_GGML, row_bytes = ggml_row_bytes(type, l->in);
        const uint8_t *w = (const uint8_t *)part->weight + at * row_bytes;
        if (n == R) {
            rows_ggml_any(type, w, row_bytes, input, b0, l->in, n, NB, out);
        } else {
            rows_ggml_any(type, w, row_bytes, input, b0, l->in, n, NB, part_out);
            for (int b = 0; b < NB; b++) memcpy(out + b * RL + done, part_out + b * RL, n * sizeof(float));
        }
        done += n, at += n;
    }
    if (l->bias)
        for (int b = 0; b < NB; b++)
            for (int r = 0; r < R; r++) out[b * RL + r] += l->bias[r0 + r];
}

#endif

/* How a layer's tiles run at batch B: rows and sequences a tile, and where result (row r, sequence b) lands in a
 * tile's output: per-row tiles (tile(), acc[r * MAX_NB + b]) or row-per-lane ones (rows_tile(), acc[b * RL + r]). */
typedef struct {
    int rows, seqs, by_lane;
    int64_t rstride, bstride;
} TileKind;

#if defined(RL)
#define TILE_ACC (RL * RL_NB > ACC_ROWS * MAX_NB ? RL * RL_NB : ACC_ROWS * MAX_NB)
#define TILE_ROWS (RL > ACC_ROWS ? RL : ACC_ROWS)
#else
#define TILE_ACC (ACC_ROWS * MAX_NB)
#define TILE_ROWS ACC_ROWS
#endif

INLINE TileKind tile_kind(const Linear *l, int64_t B) {
#if defined(RL)
    if (rows_path(l, B)) {
        const TileKind k = {RL, RL_NB, 1, 1, RL};
        return k;
    }
#endif
    TileKind k = {0, 0, 0, MAX_NB, 1};
    tile_shape(l, B, &k.rows, &k.seqs);
    return k;
}

INLINE void run_tile(const TileKind *k, const Linear *l, int64_t r0, int R, const Input *input, int64_t b0, int NB,
                     float *acc) {
#if defined(RL)
    if (k->by_lane) {
        rows_tile(l, r0, R, input, b0, NB, acc);
        return;
    }
#endif
    (void)k;
    tile(l, r0, R, input, b0, NB, acc);
}

/* y [B, out] = x [B, in] @ w.T (+ bias), or y += that (the residual stream) when accumulate; the tiles this
 * thread claims. */
static void linear(const Team *team, const Linear *l, const float *x, int64_t B, float *y, int accumulate,
                   const QuantBuffers *buf) {
    const Input input = input_for(l, x, B, buf);
    const TileKind k = tile_kind(l, B);
    int64_t lo, hi;
    while (claim(team, (l->out + k.rows - 1) / k.rows, &lo, &hi)) {
        for (int64_t t = lo; t < hi; t++) {
            const int64_t r0 = t * k.rows;
            const int R = l->out - r0 < k.rows ? (int)(l->out - r0) : k.rows;
            for (int64_t b0 = 0; b0 < B; b0 += k.seqs) {
                const int NB = B - b0 < k.seqs ? (int)(B - b0) : k.seqs;
                float acc[TILE_ACC] __attribute__((aligned(64)));
                run_tile(&k, l, r0, R, &input, b0, NB, acc);
                for (int b = 0; b < NB; b++) {
                    float *out = y + (b0 + b) * l->out + r0;
                    for (int r = 0; r < R; r++) {
                        const float v = acc[r * k.rstride + b * k.bstride];
                        out[r] = accumulate ? out[r] + v : v;
                    }
                }
            }
        }
    }
}

/* e^x for x <= 0 (a score minus its row's maximum), VW at a time: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by
 * Cephes' expf polynomial, 2^n put into the exponent. Within 2 ulp of expf (the tests hold the step to the torch
 * path at 1e-4); below -87 it returns ~1e-38 where expf underflows to 0, both nothing beside the row's 1. */
INLINE vf exp_nonpositive(vf x) {
    const vi low = x < -87.f;
    x = (vf)((low & (vi)((vf){0} - 87.f)) | (~low & (vi)x));
    const vf shift = (vf){0} + 12582912.f;  /* 1.5 * 2^23: adding it rounds to an integer, kept in the low bits */
    const vf t = x * 1.44269504088896341f + shift, n = t - shift;
    const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* ln 2 in two parts: n ln 2 exactly */
    vf poly = (vf){0} + 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    poly = poly * (r * r) + r + 1.f;
    const vi exponent = ((vi)t - (vi)shift) << 23;
    return (vf)((vi)poly + exponent);
}

/* out[i] = act(g[i]) * up[i] for n values, act SiLU or GELU (tanh approximation, as torch computes it:
 * 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))). Both are x * sigmoid(y), y = x for SiLU and
 * 2 sqrt(2 / pi) (x + 0.044715 x^3) for GELU, and sigmoid(y) = 1 / (1 + e^-|y|) or e^-|y| / (1 + e^-|y|) by y's
 * sign: VW at a time on exp_nonpositive (libm's tanhf and expf, one call per value, were a tenth of a 16-sequence
 * Gemma 3 step). A last part of fewer than VW values runs as a whole vector, padded with zeros. */
static void gate_times_up(const float *g, const float *up, int64_t n, float *out, int gelu) {
    const float beta2 = 2.f * 0.7978845608028654f, kappa = 0.044715f;
    for (int64_t i = 0; i < n; i += VW) {
        const int64_t m = n - i < VW ? n - i : VW;
        float gs[VW] = {0}, us[VW] = {0}, o[VW];
        memcpy(gs, g + i, m * sizeof(float)), memcpy(us, up + i, m * sizeof(float));
        const vf x = loadv(gs), y = gelu ? beta2 * (x + kappa * x * x * x) : x;
        const vi negative = y < 0.f;
        const vf e = exp_nonpositive((vf)((vi)y | ((vi){0} + INT32_MIN)));   /* e^-|y|: y with its sign bit set */
        const vf sig = (vf)((negative & (vi)(e / (1.f + e))) | (~negative & (vi)(1.f / (1.f + e))));
        storev(o, x * sig * loadv(us));
        memcpy(out + i, o, m * sizeof(float));
    }
}

/* act [B, I] = silu(gate) * up (or gelu), with gate and up the two halves of l's rows: a thread computes the gate rows
 * and the matching up rows of a tile together, so the activation needs no second pass. */
static void gated_linear(const Team *team, const Linear *l, const float *x, int64_t B, float *act, int gelu,
                         const QuantBuffers *buf) {
    const Input input = input_for(l, x, B, buf);
    const int64_t I = l->out / 2;
    const TileKind k = tile_kind(l, B);
    int64_t lo, hi;
    while (claim(team, (I + k.rows - 1) / k.rows, &lo, &hi)) {
        for (int64_t t = lo; t < hi; t++) {
            const int64_t r0 = t * k.rows;
            const int R = I - r0 < k.rows ? (int)(I - r0) : k.rows;
            for (int64_t b0 = 0; b0 < B; b0 += k.seqs) {
                const int NB = B - b0 < k.seqs ? (int)(B - b0) : k.seqs;
                float gate[TILE_ACC] __attribute__((aligned(64))), up[TILE_ACC] __attribute__((aligned(64)));
                run_tile(&k, l, r0, R, &input, b0, NB, gate);
                run_tile(&k, l, I + r0, R, &input, b0, NB, up);
                for (int b = 0; b < NB; b++) {
                    float g[TILE_ROWS], u[TILE_ROWS];   /* sequence b's row of the tile */
                    for (int r = 0; r < R; r++) {
                        const int64_t at = r * k.rstride + b * k.bstride;
                        g[r] = gate[at], u[r] = up[at];
                    }
                    gate_times_up(g, u, R, act + (b0 + b) * I + r0, gelu);
                }
            }
        }
    }
}

/* torch.rms_norm in fp32: x * rsqrt(mean(x^2) + eps) * weight. */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float rstd = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * rstd * w[i];
}

/* Rotate-half rotary, as RotaryEmbedding.rotate: x * cos + roll(x, D/2) * signed_sin, signed_sin being sin with
 * its first half negated (negating a product is exact: the same bits as the torch path's table). */
static void rotate(float *x, const float *cos, const float *sin, int64_t D) {
    float tmp[1024];
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) tmp[d] = x[d] * cos[d] + x[d + half] * -sin[d];
    for (int64_t d = half; d < D; d++) tmp[d] = x[d] * cos[d] + x[d - half] * sin[d];
    memcpy(x, tmp, D * sizeof(float));
}

INLINE int64_t slot_of(const int32_t *table, int64_t pos, int64_t bs) { return (int64_t)table[pos / bs] * bs + pos % bs; }
INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* One (token, kv head) of K or V into an int8 pool, as kernels/kv_quant.py quantize_kv: scale = float16 of
 * max|x| / 127, values round(x / scale) (ties to even) clamped to +-127; a zero head keeps scale 0. */
static void quantize_head(const float *x, int64_t D, int8_t *q, uint16_t *scale) {
    const uint16_t h = f32_to_f16(max_abs(x, D) / 127.f);
    const float stored = f16_to_f32(h), safe = stored > 0.f ? stored : 1.f;
    for (int64_t d = 0; d < D; d++) q[d] = (int8_t)fminf(fmaxf(rintf(x[d] / safe), -127.f), 127.f);
    *scale = h;
}

/* ---- Attention ---------------------------------------------------------------------------------------------
 * One task is one sequence's tokens of this step against one kv head: its M = tokens x (query heads per kv
 * head) queries read every key and value of the context once. Scores go block by block through the table with
 * the linear layers' tile (keys as rows, queries as sequences: the keys' loads are shared by all queries of a
 * GQA group and of a verify step); softmax per query over what it may see (a verify step's token sees the
 * context up to its own position); then the values, a tile of PV_Q queries x PV_V vectors of the head held in
 * registers while the keys' rows stream by. An int8 pool is read through its scales: a key's scale multiplies
 * its score, a value's scale its probability. */
#if VW == 16
#define PV_Q 4  /* 16 accumulators + 4 values + 1 probability of 32 zmm */
#else
#define PV_Q 2  /* 8 accumulators + 4 values + 1 probability of 16 ymm/xmm */
#endif
#define PV_V 4
#define QMAX 16  /* queries of one task scored together; more take another pass over the context */

/* out[q * ostride + c * VW ...] = sum_t p[q * ld + t] * v_t[c * VW ...] for QN queries and NV vectors, the values
 * rows of one kv head's context (vstride apart within a block) found through the table. */
#define PV_TILE(NAME, VTYPE, LOAD)                                                                           \
    INLINE void NAME(const VTYPE *v0, int64_t vstride, const int32_t *table, int64_t bs, int64_t start,      \
                     int64_t len, const float *p, int64_t ld, int QN, int NV, float *out, int64_t ostride) {\
        vf acc[PV_Q][PV_V];                                                                                 \
        for (int q = 0; q < QN; q++)                                                                        \
            for (int c = 0; c < NV; c++) acc[q][c] = (vf){0};                                               \
        for (int64_t t0 = start; t0 < len; t0 += bs) {                                                      \
            const VTYPE *block = v0 + (int64_t)table[t0 / bs] * bs * vstride;                                \
            const int64_t n = min64(bs, len - t0);                                                          \
            for (int64_t j = 0; j < n; j++) {                                                               \
                vf vv[PV_V];                                                                                \
                for (int c = 0; c < NV; c++) {                                                              \
                    vv[c] = LOAD(block + j * vstride + c * VW);                                             \
                    PIN(vv[c]);                                                                             \
                }                                                                                           \
                for (int q = 0; q < QN; q++) {                                                              \
                    const vf pq = (vf){0} + p[q * ld + t0 + j];                                             \
                    for (int c = 0; c < NV; c++) acc[q][c] += pq * vv[c];                                   \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int q = 0; q < QN; q++)                                                                        \
            for (int c = 0; c < NV; c++) storev(out + q * ostride + c * VW, acc[q][c]);                      \
    }
PV_TILE(pv_f32, float, loadv)
PV_TILE(pv_i8, int8_t, loadq)

/* Specialised: a full PV_Q or a single query, 1..PV_V vectors (a head of 16 floats on AVX2 is 2). */
#define PV_CASE(FN, V0, P, O, Q, V) case (Q) * 8 + (V): FN(V0, vstride, table, bs, start, len, P, ld, Q, V, O, ostride); break;
#define PV_DISPATCH_AT(FN, V0, P, O)                                                                         \
    switch (QN == PV_Q || QN == 1 ? QN * 8 + NV : 0) {                                                      \
        PV_CASE(FN, V0, P, O, PV_Q, 4) PV_CASE(FN, V0, P, O, PV_Q, 3) PV_CASE(FN, V0, P, O, PV_Q, 2)         \
        PV_CASE(FN, V0, P, O, PV_Q, 1) PV_CASE(FN, V0, P, O, 1, 4) PV_CASE(FN, V0, P, O, 1, 3)               \
        PV_CASE(FN, V0, P, O, 1, 2) PV_CASE(FN, V0, P, O, 1, 1)                                              \
        default: FN(V0, vstride, table, bs, start, len, P, ld, QN, NV, O, ostride); break;                  \
    }

/* The pool of one layer and kv head: rows of `stride` elements (float or int8) from `base`, scales beside. */
typedef struct {
    const void *base;
    const uint16_t *scales;   /* per (slot, kv head), or NULL for a float pool */
    int64_t stride, scale_stride;
} Pool;

INLINE Pool pool_of(const void *cache, const uint16_t *scales, int64_t g, int64_t Hkv, int64_t D) {
    const int64_t offset = g * D;
    Pool pool = {scales ? (const void *)((const int8_t *)cache + offset) : (const void *)((const float *)cache + offset),
                 scales ? scales + g : NULL, Hkv * D, Hkv};
    return pool;
}

/* s[q * ld + t] = scale * (query q . key t) for start <= t < len (start: a multiple of bs). */
static void score(const Pool *k, const int32_t *table, int64_t bs, int64_t start, int64_t len, const float *queries,
                  int M, int64_t D, float scale, float *s, int64_t ld) {
    const int64_t in = D, rstride = k->stride, xstride = D;
    const int fetch = 0;
    for (int64_t t0 = start; t0 < len; t0 += bs) {
        const int64_t slot0 = (int64_t)table[t0 / bs] * bs, n = min64(bs, len - t0);
        for (int64_t j = 0; j < n; j += TILE_R) {
            const int R = (int)min64(TILE_R, n - j);
            for (int b0 = 0; b0 < M; b0 += MAX_NB) {
                const int NB = M - b0 < MAX_NB ? M - b0 : MAX_NB;
                const float *x = queries + b0 * D;
                float acc[ROWS_MAX * MAX_NB];
                if (k->scales) {
                    const int8_t *w = (const int8_t *)k->base + (slot0 + j) * rstride;
                    DISPATCH(tile_i8, w)
                } else {
                    const float *w = (const float *)k->base + (slot0 + j) * rstride;
                    DISPATCH(tile_f32, w)
                }
                for (int r = 0; r < R; r++) {
                    const float rs = k->scales ? scale * f16_to_f32(k->scales[(slot0 + j + r) * k->scale_stride]) : scale;
                    for (int b = 0; b < NB; b++) s[(b0 + b) * ld + t0 + j + r] = acc[r * MAX_NB + b] * rs;
                }
            }
        }
    }
}

INLINE vf vmax(vf a, vf b) {
    const vi gt = a > b;
    return (vf)((gt & (vi)a) | (~gt & (vi)b));
}

/* Row q of s becomes softmax over its entries first[q] .. visible[q] - 1, zero elsewhere from start up to len;
 * an int8 pool's value scales (vscale[t]) are folded in. */
static void softmax_rows(float *s, int64_t ld, int M, const int64_t *first, const int64_t *visible, int64_t start,
                         int64_t len, const float *vscale) {
    for (int q = 0; q < M; q++) {
        for (int64_t t = start; t < first[q]; t++) s[q * ld + t] = 0.f;
        float *row = s + q * ld + first[q];   /* (indices below are from first[q]) */
        const float *vs = vscale ? vscale + first[q] : NULL;
        const int64_t n = visible[q] - first[q], whole = n / VW * VW;
        vf mv = (vf){0} - INFINITY;
        for (int64_t t = 0; t < whole; t += VW) mv = vmax(mv, loadv(row + t));
        float mx = -INFINITY;
        for (int i = 0; i < VW; i++) mx = mv[i] > mx ? mv[i] : mx;
        for (int64_t t = whole; t < n; t++) mx = row[t] > mx ? row[t] : mx;
        vf sv = {0};
        for (int64_t t = 0; t < whole; t += VW) {
            const vf e = exp_nonpositive(loadv(row + t) - mx);
            storev(row + t, e);
            sv += e;
        }
        float sum = hsum(sv);
        for (int64_t t = whole; t < n; t++) {
            row[t] = expf(row[t] - mx);
            sum += row[t];
        }
        const float inv = 1.f / sum;
        if (vs)
            for (int64_t t = 0; t < n; t++) row[t] *= inv * vs[t];
        else
            for (int64_t t = 0; t < n; t++) row[t] *= inv;
        for (int64_t t = n; t < len - first[q]; t++) row[t] = 0.f;
    }
}

/* out[q * D ...] = sum_t p[q * ld + t] * value t (start <= t < len), for M queries. */
static void mix_values(const Pool *v, const int32_t *table, int64_t bs, int64_t start, int64_t len, const float *p,
                       int64_t ld, int M, int64_t D, float *out) {
    const int64_t vstride = v->stride, ostride = D, whole = D / VW * VW;
    for (int64_t c0 = 0; c0 < whole; c0 += PV_V * VW) {
        const int NV = (int)min64(PV_V, (whole - c0) / VW);
        for (int q0 = 0; q0 < M; q0 += PV_Q) {
            const int QN = M - q0 < PV_Q ? M - q0 : PV_Q;
            const float *pq = p + q0 * ld;
            float *o = out + q0 * D + c0;
            if (v->scales) {
                const int8_t *v0 = (const int8_t *)v->base + c0;
                PV_DISPATCH_AT(pv_i8, v0, pq, o)
            } else {
                const float *v0 = (const float *)v->base + c0;
                PV_DISPATCH_AT(pv_f32, v0, pq, o)
            }
        }
    }
    for (int64_t d = whole; d < D; d++)  /* a head size that is not a multiple of the vector */
        for (int q = 0; q < M; q++) {
            float acc = 0.f;
            for (int64_t t = start; t < len; t++) {
                const int64_t row = slot_of(table, t, bs) * vstride + d;
                acc += p[q * ld + t] * (v->scales ? (float)((const int8_t *)v->base)[row] : ((const float *)v->base)[row]);
            }
            out[q * D + d] = acc;
        }
}

typedef struct {
    float *x, *qkv, *attn, *act;  /* shared by the team */
    float *out;                   /* shared: a layer's output before its norm (Gemma's normed residual adds) */
    float *h;                     /* per thread: this thread's copy of the normed rows */
    float *work;                  /* per thread: attention's queries, scores, value scales and outputs */
    int64_t work_size;            /* floats of `work` per thread */
    int8_t *q;                    /* per thread: an integer layer's input blocks (quant_size bytes), */
    float *qd;                    /*   their scales and */
    int32_t *qsum;                /*   their sums (quant_size / QBLOCK each) */
    int64_t quant_size;
} Scratch;

INLINE QuantBuffers quant_of(const Scratch *s, const Team *t) {
    const int64_t n = s->quant_size, blocks = 4 * n / QBLOCK;  /* (room for quantize_pairs' layout) */
    const QuantBuffers buf = {s->q + t->tid * n, s->qd + t->tid * blocks, s->qsum + t->tid * blocks};
    return buf;
}

/* What a step is: T tokens of B sequences, sequence b's tokens [cu_q[b], cu_q[b + 1]), each token's position;
 * sequence b's block table of group g at tables + (g * B + b) * table_stride (one group unless the model has
 * sliding-window layer groups: a window group's table has -1 for the blocks behind every window). */
typedef struct {
    int64_t T, B, table_stride, max_len;
    const int64_t *ids, *positions;
    const int32_t *cu_q, *tables;
} Batch;

/* One task: sequence b's tokens against kv head g. The queries are gathered into the thread's work space,
 * QMAX at a time. */
INLINE const int32_t *table_of(const Layer *l, const Batch *batch, int64_t b) {
    return batch->tables + (l->group * batch->B + b) * batch->table_stride;
}

static void attend(const Model *m, const Layer *l, const Batch *batch, int64_t b, int64_t g, const Scratch *s,
                   const Team *team) {
    const int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads, G = Hq / Hkv, bs = m->block_size;
    const int64_t qkv_n = l->qkv.out, first = batch->cu_q[b], n = batch->cu_q[b + 1] - first;
    const int32_t *table = table_of(l, batch, b);
    const Pool k = pool_of(l->k_cache, l->k_scales, g, Hkv, D), v = pool_of(l->v_cache, l->v_scales, g, Hkv, D);
    const int64_t len = batch->positions[first + n - 1] + 1, ld = batch->max_len;
    /* a window layer reads from the block of its first query's oldest key on (those before may be released) */
    const int64_t oldest = l->window ? batch->positions[first] - l->window + 1 : 0;
    const int64_t start = oldest > 0 ? oldest / bs * bs : 0;
    float *queries = s->work + team->tid * s->work_size, *out = queries + QMAX * D, *scores = out + QMAX * D;
    float *vscale = l->v_scales ? scores + QMAX * ld : NULL;
    if (vscale)
        for (int64_t t = start; t < len; t++) vscale[t] = f16_to_f32(v.scales[slot_of(table, t, bs) * v.scale_stride]);
    for (int64_t q0 = 0; q0 < n * G; q0 += QMAX) {
        const int M = (int)min64(QMAX, n * G - q0);
        int64_t lowest[QMAX], visible[QMAX];
        for (int q = 0; q < M; q++) {  /* query q0 + q: token (q0 + q) / G, head g * G + (q0 + q) % G */
            const int64_t token = first + (q0 + q) / G, head = g * G + (q0 + q) % G;
            memcpy(queries + q * D, s->qkv + token * qkv_n + head * D, D * sizeof(float));
            visible[q] = batch->positions[token] + 1;
            lowest[q] = l->window && visible[q] > l->window ? visible[q] - l->window : 0;
        }
        score(&k, table, bs, start, len, queries, M, D, m->scale, scores, ld);
        softmax_rows(scores, ld, M, lowest, visible, start, len, vscale);
        mix_values(&v, table, bs, start, len, scores, ld, M, D, out);
        for (int q = 0; q < M; q++) {
            const int64_t token = first + (q0 + q) / G, head = g * G + (q0 + q) % G;
            memcpy(s->attn + token * Hq * D + head * D, out + q * D, D * sizeof(float));
        }
    }
}

/* Every thread norms the rows itself into its own buffer: a few thousand flops instead of a barrier. */
static float *norm_rows(const Model *m, const float *w, int64_t T, const Scratch *s, const Team *t) {
    float *h = s->h + t->tid * T * m->hidden;
    for (int64_t i = 0; i < T; i++) rms_norm(s->x + i * m->hidden, w, m->hidden, m->eps, h + i * m->hidden);
    return h;
}

/* q/k norm and rotary of token i, and its K/V into the pool. */
static void place_token(const Model *m, const Layer *l, const Batch *batch, int64_t b, int64_t i, const Scratch *s) {
    const int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads, pos = batch->positions[i];
    float *q = s->qkv + i * l->qkv.out, *k = q + Hq * D, *v = k + Hkv * D;
    const float *cos = (l->cos ? l->cos : m->cos) + pos * D;
    const float *sin = (l->sin ? l->sin : m->sin) + pos * D;
    for (int64_t h = 0; h < Hq + Hkv; h++) {
        float *head = q + h * D;  /* q heads then k heads, side by side */
        if (l->q_norm) rms_norm(head, h < Hq ? l->q_norm : l->k_norm, D, m->eps, head);
        rotate(head, cos, sin, D);
    }
    const int64_t slot = slot_of(table_of(l, batch, b), pos, m->block_size);
    if (l->k_scales) {
        for (int64_t g = 0; g < Hkv; g++) {
            quantize_head(k + g * D, D, (int8_t *)l->k_cache + (slot * Hkv + g) * D, l->k_scales + slot * Hkv + g);
            quantize_head(v + g * D, D, (int8_t *)l->v_cache + (slot * Hkv + g) * D, l->v_scales + slot * Hkv + g);
        }
    } else {
        memcpy((float *)l->k_cache + slot * Hkv * D, k, Hkv * D * sizeof(float));
        memcpy((float *)l->v_cache + slot * Hkv * D, v, Hkv * D * sizeof(float));
    }
}

static void residual(const Model *m, const Team *team, const Linear *layer, const float *input, int64_t T,
                     const float *out_norm, const Scratch *s, const QuantBuffers *qb);

static void attention_block(const Model *m, const Layer *l, const Batch *batch, const Scratch *s, const Team *team) {
    const int64_t T = batch->T, Hkv = m->num_kv_heads;
    int64_t lo, hi;
    const QuantBuffers qb = quant_of(s, team);
    linear(team, &l->qkv, norm_rows(m, l->input_norm, T, s, team), T, s->qkv, 0, &qb);
    sync_team(team);
    share(team, batch->B, &lo, &hi);
    for (int64_t b = lo; b < hi; b++)
        for (int64_t i = batch->cu_q[b]; i < batch->cu_q[b + 1]; i++) place_token(m, l, batch, b, i, s);
    sync_team(team);
    /* tasks claimed one at a time: their contexts differ in length */
    while (claim_n(team, batch->B * Hkv, 1, &lo, &hi)) attend(m, l, batch, lo / Hkv, lo % Hkv, s, team);
    sync_team(team);
    residual(m, team, &l->o, s->attn, T, l->attn_out_norm, s, &qb);
}

/* x += out_layer(input): added straight into the residual stream, or (Gemma) through out_norm first. */
static void residual(const Model *m, const Team *team, const Linear *layer, const float *input, int64_t T,
                     const float *out_norm, const Scratch *s, const QuantBuffers *qb) {
    const int64_t H = m->hidden;
    linear(team, layer, input, T, out_norm ? s->out : s->x, out_norm == NULL, qb);
    sync_team(team);
    if (!out_norm)
        return;
    int64_t lo, hi;
    share(team, T, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        float *y = s->out + i * H, *x = s->x + i * H;
        rms_norm(y, out_norm, H, m->eps, y);
        for (int64_t j = 0; j < H; j++) x[j] += y[j];
    }
    sync_team(team);
}

static void mlp_block(const Model *m, const Layer *l, int64_t T, const Scratch *s, const Team *team) {
    const QuantBuffers qb = quant_of(s, team);
    gated_linear(team, &l->gate_up, norm_rows(m, l->post_norm, T, s, team), T, s->act, (int)m->gelu, &qb);
    sync_team(team);
    residual(m, team, &l->down, s->act, T, l->mlp_out_norm, s, &qb);
}

/* Row `id` of the embedding table; a GGUF table's row dequantized block by block (value = s * q + m). */
static void embed_row(const Model *m, int64_t id, float *out) {
    const int64_t H = m->hidden;
    if (m->embed_format == FMT_F32) {
        memcpy(out, (const float *)m->embed + id * H, H * sizeof(float));
        return;
    }
    const uint8_t *row = (const uint8_t *)m->embed + id * m->embed_row_bytes;
    for (int64_t k = 0; k < H / QBLOCK; k++) {
        int8_t q[QBLOCK];
        float sc[2], mn[2];
        ggml_block(m->embed_format - FMT_GGML, row, k, q, sc, mn);
        for (int i = 0; i < QBLOCK; i++) out[k * QBLOCK + i] = sc[i / 16] * (float)q[i] + mn[i / 16];
    }
}

/* Logits of one step: T tokens of B sequences (sequence b's are cu_q[b] .. cu_q[b + 1] - 1, at consecutive
 * positions ending at its last). Logits [n_out, vocab] of the rows out_rows (ascending: a prefill chunk samples
 * only its last token, if any), or [T, vocab] of every row when n_out < 0. Returns 0, or -1 when scratch memory
 * could not be had. */
API int pc_step(const Model *m, int64_t T, const int64_t *ids, const int64_t *positions, int64_t B,
                const int32_t *cu_q, const int32_t *tables, int64_t table_stride, float *logits, int num_threads,
                int64_t n_out, const int64_t *out_rows) {
    const int64_t H = m->hidden, D = m->head_dim, qkv_n = m->layers[0].qkv.out, I = m->layers[0].down.in;
    int64_t max_len = 1;
    for (int64_t i = 0; i < T; i++) max_len = positions[i] + 1 > max_len ? positions[i] + 1 : max_len;
    max_len = (max_len + 15) / 16 * 16;  /* scores rows start on a cache line */
    if (num_threads < 1) num_threads = 1;
    const int64_t work = 2 * QMAX * D + QMAX * max_len + max_len;
    int64_t max_in = H > I ? H : I;
    max_in = m->num_heads * D > max_in ? m->num_heads * D : max_in;
    const int64_t quant = (T * max_in + 63) / 64 * 64, blocks = 4 * quant / QBLOCK;
    const int64_t sizes[] = {T * H, T * qkv_n, T * m->num_heads * D, T * I, num_threads * T * H, num_threads * work,
                             num_threads * quant / 4, num_threads * blocks, num_threads * blocks, T * H};
    enum { PARTS = sizeof sizes / sizeof sizes[0] };
    int64_t total = 0;
    for (int i = 0; i < PARTS; i++) total += (sizes[i] + 15) / 16 * 16;
    float *mem = aligned_alloc(64, total * sizeof(float));
    if (!mem) return -1;
    float *parts[PARTS], *p = mem;
    for (int i = 0; i < PARTS; i++) {
        parts[i] = p;
        p += (sizes[i] + 15) / 16 * 16;
    }
    const Scratch s = {parts[0], parts[1], parts[2], parts[3], parts[9], parts[4], parts[5], work,
                       (int8_t *)parts[6], parts[7], (int32_t *)parts[8], quant};
    const Batch batch = {T, B, table_stride, max_len, ids, positions, cu_q, tables};
    for (int64_t i = 0; i < T; i++) {
        embed_row(m, ids[i], s.x + i * H);
        if (m->embed_scale != 1.f)
            for (int64_t j = 0; j < H; j++) s.x[i * H + j] *= m->embed_scale;
    }
    Barrier barrier = {0, 0, 0, 0};
#pragma omp parallel num_threads(num_threads)
    {
        const Team team = {omp_get_thread_num(), omp_get_num_threads(), &barrier};
        for (int64_t i = 0; i < m->num_layers; i++) {
            attention_block(m, &m->layers[i], &batch, &s, &team);
            mlp_block(m, &m->layers[i], T, &s, &team);
        }
        const int64_t R = n_out < 0 ? T : n_out;
        if (n_out >= 0) {  /* the sampled rows to the front, in order (out_rows[j] >= j: nothing read is overwritten) */
            if (team.tid == 0)
                for (int64_t j = 0; j < R; j++)
                    if (out_rows[j] != j) memcpy(s.x + j * H, s.x + out_rows[j] * H, H * sizeof(float));
            sync_team(&team);
        }
        const QuantBuffers qb = quant_of(&s, &team);
        if (R > 0) linear(&team, &m->lm_head, norm_rows(m, m->norm, R, &s, &team), R, logits, 0, &qb);
    }
    free(mem);
    return 0;
}

/* One linear layer on this thread: y [B, out] = x [B, in] @ weight.T (scaled, biased). The tests hold each
 * weight format's tiles to torch with it, on the same input (a whole step's inputs differ by rounding). */
API int pc_linear(const Linear *l, const float *x, int64_t B, float *y) {
    const int64_t n = (B * l->in + 63) / 64 * 64;
    int8_t *q = malloc(n);
    float *d = malloc(4 * n / QBLOCK * sizeof(float));
    int32_t *sum = malloc(4 * n / QBLOCK * sizeof(int32_t));
    int rc = -1;
    if (q && d && sum) {
        const QuantBuffers buf = {q, d, sum};
        Barrier barrier = {0, 0, 0, 0};
        const Team team = {0, 1, &barrier};
        linear(&team, l, x, B, y, 0, &buf);
        rc = 0;
    }
    free(q), free(d), free(sum);
    return rc;
}

/* quantize_head over `heads` rows of D: the tests hold it to kernels/kv_quant.py bit for bit. */
API void pc_quantize_heads(const float *x, int64_t heads, int64_t D, int8_t *q, uint16_t *scales) {
    for (int64_t h = 0; h < heads; h++) quantize_head(x + h * D, D, q + h * D, scales + h);
}

/* The struct sizes the Python side checks its ctypes mirrors against. */
API int64_t pc_sizeof_model(void) { return sizeof(Model); }
API int64_t pc_sizeof_layer(void) { return sizeof(Layer); }
/* What this build was compiled for: the vector ISA and the linear layers' tile shape. */
API const char *pc_build_info(void) {
#if defined(RL)
    return ISA_NAME " vw=" STR(VW) " tile=" STR(TILE_R) "x" STR(MAX_NB) " rows1=" STR(ROWS_1) " lanes=" STR(RL) "x"
        STR(RL_NB) " from " STR(RL_MIN);
#else
    return ISA_NAME " vw=" STR(VW) " tile=" STR(TILE_R) "x" STR(MAX_NB) " rows1=" STR(ROWS_1);
#endif
}

/* ---- GGUF blocks -> float32, for the torch path -----------------------------------------------------------
 * Where a step runs on the torch path (a long prefill, a family or format the step above does not take), a GGUF
 * layer is dequantized per call (pagedchat/model/gguf/linear.py). In torch ops that was about half of a long
 * prefill of Gemma 3's Q4_K_M file; here it is a plain loop per block. Every value is computed as
 * pagedchat/model/gguf/quants.py (gguf-py's formulas) computes it, each product and sum rounded to float32 on its
 * own: bit for bit the same weights, so the torch path's arithmetic does not change. Hence no contraction into
 * fused multiply-adds in this part (GCC contracts across statements unless told; clang only within one). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#define NO_FMA
#elif defined(__GNUC__)
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#else
#define NO_FMA
#endif

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes (quants.py _k_scales) */
INLINE void k_scale_pair(const uint8_t *s, int j, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *m = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 2) & 0x30));
    }
}

NO_FMA static void dq_q8_0(const uint8_t *b, float *y) {        /* q * d */
    const float d = f16_to_f32((uint16_t)(b[0] | b[1] << 8));
    for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d;
}
NO_FMA static void dq_q4_0(const uint8_t *b, float *y) {        /* d * (q - 8) */
    const float d = f16_to_f32((uint16_t)(b[0] | b[1] << 8));
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((b[2 + i] & 15) - 8);
        y[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
    }
}
NO_FMA static void dq_q4_1(const uint8_t *b, float *y) {        /* d * q + m */
    const float d = f16_to_f32((uint16_t)(b[0] | b[1] << 8)), m = f16_to_f32((uint16_t)(b[2] | b[3] << 8));
    for (int i = 0; i < 16; i++) {
        const float lo = d * (float)(b[4 + i] & 15), hi = d * (float)(b[4 + i] >> 4);
        y[i] = lo + m;
        y[i + 16] = hi + m;
    }
}
/* The loops below run over 16 or 32 consecutive values with one shift and one scale, so the compiler vectorizes
 * them (indexing each value on its own did not: Q6_K was slower than torch's ops). */

/* Q5_0 / Q5_1: bit k of the little-endian u32 before the nibbles is value k's fifth bit */
NO_FMA static void dq_q5_0(const uint8_t *b, float *y) {        /* d * (q - 16) */
    const float d = f16_to_f32((uint16_t)(b[0] | b[1] << 8));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((int)((b[6 + i] & 15) | ((qh >> i) & 1) << 4) - 16);   /* (int: qh is unsigned) */
        y[i + 16] = d * (float)((int)((b[6 + i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - 16);
    }
}
NO_FMA static void dq_q5_1(const uint8_t *b, float *y) {        /* d * q + m */
    const float d = f16_to_f32((uint16_t)(b[0] | b[1] << 8)), m = f16_to_f32((uint16_t)(b[2] | b[3] << 8));
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int i = 0; i < 16; i++) {
        const float lo = d * (float)((b[8 + i] & 15) | ((qh >> i) & 1) << 4);
        const float hi = d * (float)((b[8 + i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
        y[i] = lo + m;
        y[i + 16] = hi + m;
    }
}
/* Q2_K and Q3_K's 2-bit values: value 128h + 32j + i is bits 2j of byte 32h + i (sub-block 8h + 2j + i / 16) */
NO_FMA static void dq_q2_k(const uint8_t *b, float *y) {        /* (d * sc) * q - (dmin * m), sub-blocks of 16 */
    const uint8_t *sc = b, *qs = b + 16;
    const float d = f16_to_f32((uint16_t)(b[80] | b[81] << 8)), dmin = f16_to_f32((uint16_t)(b[82] | b[83] << 8));
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 2; t++) {
                const int s = 8 * h + 2 * j + t;
                const float dl = d * (float)(sc[s] & 15), ml = dmin * (float)(sc[s] >> 4);
                const uint8_t *q = qs + 32 * h + 16 * t;
                float *out = y + 16 * s;
                for (int i = 0; i < 16; i++) {
                    const float p = dl * (float)((q[i] >> (2 * j)) & 3);
                    out[i] = p - ml;
                }
            }
}
NO_FMA static void dq_q3_k(const uint8_t *b, float *y) {        /* (d * (sc - 32)) * (low - 4 unless the high bit) */
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const float d = f16_to_f32((uint16_t)(b[108] | b[109] << 8));
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 2; t++) {
                const int s = 8 * h + 2 * j + t, bit = 4 * h + j;
                const int low4 = (sc[s & 7] >> (4 * (s >> 3))) & 15, top2 = (sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
                const float dl = d * (float)((low4 | top2 << 4) - 32);
                const uint8_t *q = qs + 32 * h + 16 * t, *hm = hmask + 16 * t;
                float *out = y + 16 * s;
                for (int i = 0; i < 16; i++)
                    out[i] = dl * (float)(((q[i] >> (2 * j)) & 3) - (((hm[i] >> bit) & 1) ? 0 : 4));
            }
}
/* Q4_K and Q5_K's nibbles: value 64c + 32j + i is nibble j of byte 32c + i (sub-block 2c + j); Q5_K's fifth bit
 * of it is bit 2c + j of byte i of qh */
NO_FMA static void dq_q45_k(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *y) {
    const float d = f16_to_f32((uint16_t)(b[0] | b[1] << 8)), dmin = f16_to_f32((uint16_t)(b[2] | b[3] << 8));
    for (int s = 0; s < 8; s++) {
        float sc, m;
        k_scale_pair(b + 4, s, &sc, &m);
        const float dl = d * sc, ml = dmin * m;
        const uint8_t *q = qs + 32 * (s >> 1);
        const int shift = 4 * (s & 1);
        float *out = y + 32 * s;
        for (int i = 0; i < 32; i++) {
            const int v = ((q[i] >> shift) & 15) | (qh ? ((qh[i] >> s) & 1) << 4 : 0);
            const float p = dl * (float)v;
            out[i] = p - ml;
        }
    }
}
static void dq_q4_k(const uint8_t *b, float *y) { dq_q45_k(b, NULL, b + 16, y); }
static void dq_q5_k(const uint8_t *b, float *y) { dq_q45_k(b, b + 16, b + 48, y); }
/* Q6_K: value 128h + 32j + i has low nibble j / 2 of byte 64h + 32 (j % 2) + i and high bits 2j of byte 32h + i
 * (sub-block 8h + 2j + i / 16) */
NO_FMA static void dq_q6_k(const uint8_t *b, float *y) {        /* (d * sc) * (q - 32), sub-blocks of 16 */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_to_f32((uint16_t)(b[208] | b[209] << 8));
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 2; t++) {
                const int s = 8 * h + 2 * j + t;
                const float dl = d * (float)sc[s];
                const uint8_t *lo = ql + 64 * h + 32 * (j & 1) + 16 * t, *hi = qh + 32 * h + 16 * t;
                float *out = y + 16 * s;
                for (int i = 0; i < 16; i++)
                    out[i] = dl * (float)((((lo[i] >> (4 * (j >> 1))) & 15) | ((hi[i] >> (2 * j)) & 3) << 4) - 32);
            }
}

typedef void (*BlockDequantizer)(const uint8_t *, float *);

/* blocks GGUF blocks of `type` (consecutive) -> their values in `out`; 0, or -1 for a type not handled here */
API int pc_dequantize(int64_t type, const uint8_t *raw, int64_t blocks, float *out, int threads) {
    BlockDequantizer f;
    switch (type) {
    case GGML_Q8_0: f = dq_q8_0; break;
    case GGML_Q4_0: f = dq_q4_0; break;
    case GGML_Q4_1: f = dq_q4_1; break;
    case GGML_Q5_0: f = dq_q5_0; break;
    case GGML_Q5_1: f = dq_q5_1; break;
    case GGML_Q2_K: f = dq_q2_k; break;
    case GGML_Q3_K: f = dq_q3_k; break;
    case GGML_Q4_K: f = dq_q4_k; break;
    case GGML_Q5_K: f = dq_q5_k; break;
    case GGML_Q6_K: f = dq_q6_k; break;
    default: return -1;
    }
    const int64_t values = type >= GGML_Q2_K ? 256 : 32, bytes = ggml_row_bytes(type, values);
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (blocks * values >= 65536)
    for (int64_t k = 0; k < blocks; k++) f(raw + k * bytes, out + k * values);
    return 0;
}
