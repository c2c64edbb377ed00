/* One decode step of a Llama-family model on CPU, in one call: every sequence in the batch has exactly one
 * new token; its K/V is written into the paged pool and attention reads the pool through the block table.
 *
 * Why native: at batch 1 a small model's step is ~450 eager torch calls, and their dispatch cost (not the
 * arithmetic) is what separates pagedchat from llama.cpp. Here the step is a few dozen loops over memory the
 * torch side owns (weights, caches, rotary tables: pointers, nothing copied). The arithmetic is the torch
 * path's, in fp32, in another summation order (as one GEMM shape already differs from another).
 *
 * Linear layers keep the checkpoint's [out, in] layout, fp32 or int8 with one fp32 scale per output row
 * (pagedchat/model/quantize.py). A tile of 4 rows x up to 4 sequences shares every load: at batch 1 the
 * weights stream once at the memory-bandwidth floor; at batch 16 each weight load feeds 4 sequences.
 * Threads claim the row tiles of every linear layer and split the (sequence, kv head) pairs of attention,
 * inside one OpenMP region per step (the same libgomp torch loaded: one thread pool, no oversubscription);
 * how many threads a step gets is the caller's choice (pagedchat/native/step.py ThreadChoice).
 *
 * Built with the machine's C compiler on first use (pagedchat/native/build.py); GCC/clang vector extensions
 * keep it portable: 16-float vectors become AVX-512, 2 x AVX2 or 4 x SSE as the CPU has.
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

typedef struct {
    const void *weight;    /* [out, in]: float, or int8 when scales != NULL */
    const float *scales;   /* [out] per-row scale of an int8 weight, else NULL */
    const float *bias;     /* [out] or NULL */
    int64_t out, in;
} Linear;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    const float *q_norm, *k_norm;         /* [head_dim] (Qwen3) or NULL */
    Linear qkv, o, gate_up, down;
    float *k_cache, *v_cache;             /* [num_blocks, block_size, kv_heads, head_dim] */
} Layer;

typedef struct {
    int64_t hidden, num_layers, num_heads, num_kv_heads, head_dim, vocab, block_size;
    float eps, scale;
    const float *embed;                   /* [vocab, hidden] */
    const float *norm;                    /* [hidden] */
    Linear lm_head;
    const float *cos, *signed_sin;        /* [max_positions, head_dim] */
    const Layer *layers;
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

/* The sums of p0..p3, in one vector. A batch's tiles end in 16 sums each; reducing them one by one, a
 * batch-16 step of the small llama took 25-26 ms on AVX-512, with this 21 ms. */
INLINE v4 hsum4(vf p0, vf p1, vf p2, vf p3) {
#if VW == 4
    return sums4_of4(p0, p1, p2, p3);
#else
#if VW == 16
    const v8 q0 = halves16(p0), q1 = halves16(p1), q2 = halves16(p2), q3 = halves16(p3);
#else
    const v8 q0 = p0, q1 = p1, q2 = p2, q3 = p3;
#endif
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
INLINE void reduce_tile(vf a[TILE_R][MAX_NB], int R, int NB, float *acc) {
    int k = 0;
    for (; k + 4 <= R * NB; k += 4) {
        const v4 sums = hsum4(a[k / NB][k % NB], a[(k + 1) / NB][(k + 1) % NB], a[(k + 2) / NB][(k + 2) % NB],
                              a[(k + 3) / NB][(k + 3) % NB]);
        for (int j = 0; j < 4; j++) acc[(k + j) / NB * MAX_NB + (k + j) % NB] = sums[j];
    }
    for (; k < R * NB; k++) acc[k / NB * MAX_NB + k % NB] = hsum(a[k / NB][k % NB]);
}

/* y[b, r] = sum_i x[b, i] * w[r, i] for R rows from w (rows `in` apart) and NB sequences: every weight vector
 * loaded once feeds NB accumulators, every input vector R. R and NB are constants after inlining: the
 * accumulators stay in registers. */
#define TILE(NAME, WTYPE, LOAD, SCALAR)                                                                      \
    INLINE void NAME(const WTYPE *w, const float *x, int64_t in, int64_t xstride, int R, int NB, int fetch,  \
                     float *acc) {                                                                          \
        vf a[TILE_R][MAX_NB];                                                                               \
        for (int r = 0; r < R; r++)                                                                         \
            for (int b = 0; b < NB; b++) a[r][b] = (vf){0};                                                 \
        int64_t i = 0;                                                                                      \
        /* While these rows stream, the next tile's are fetched into L1 and the tile 4 ahead into L2 (once:  \
         * later sequences find them in cache). The far fetch keeps more of the stream in flight: the       \
         * matrix-vector pass over the small llama's weights, 8 alternations, 7.2-8.7 ms against 8.2-10.0. */ \
        const char *next = (const char *)(w + R * in), *far = (const char *)(w + 4 * R * in);             \
        const int lines = fetch ? (R * (int)sizeof(WTYPE) * VW + 63) / 64 : 0;                                     \
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
                vf wv = LOAD(w + r * in + i);                                                               \
                if (PIN_INPUTS) PIN(wv);                                                                    \
                for (int b = 0; b < NB; b++) a[r][b] += wv * xv[b];                                         \
            }                                                                                               \
        }                                                                                                   \
        reduce_tile(a, R, NB, acc);                                                                         \
        for (int r = 0; r < R; r++)                                                                         \
            for (int b = 0; b < NB; b++)                                                                    \
                for (int64_t j = i; j < in; j++) acc[r * MAX_NB + b] += SCALAR(w[r * in + j]) * x[b * xstride + j]; \
    }
#define AS_FLOAT(v) (v)
#define INT8_TO_FLOAT(v) ((float)(v))
TILE(tile_f32, float, loadv, AS_FLOAT)
TILE(tile_i8, int8_t, loadq, INT8_TO_FLOAT)

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
 * never taken); a tail of rows goes generic. */
#define NB_CASE(FN, W, K) case K: FN(W, x, in, in, TILE_R, (K) <= MAX_NB ? (K) : MAX_NB, fetch, acc); break;
#define DISPATCH(FN, W)                                                                                      \
    switch (R == TILE_R ? NB : 0) {                                                                         \
        NB_CASE(FN, W, 1) NB_CASE(FN, W, 2) NB_CASE(FN, W, 3) NB_CASE(FN, W, 4)                             \
        NB_CASE(FN, W, 5) NB_CASE(FN, W, 6) NB_CASE(FN, W, 7) NB_CASE(FN, W, 8)                             \
        default: FN(W, x, in, in, R, NB, fetch, acc); break;                                                \
    }

/* acc[r * MAX_NB + b] = rows r0 .. r0+R of l (scaled, biased) against sequences b0 .. b0+NB of x_all [B, in]. */
static void tile(const Linear *l, int64_t r0, int R, const float *x_all, int64_t b0, int NB, float *acc) {
    const int64_t in = l->in;
    const int fetch = b0 == 0;
    const float *x = x_all + b0 * in;
    if (l->scales) {
        const int8_t *w = (const int8_t *)l->weight + r0 * in;
        DISPATCH(tile_i8, w)
    } else {
        const float *w = (const float *)l->weight + r0 * in;
        DISPATCH(tile_f32, w)
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) {
            if (l->scales) acc[r * MAX_NB + b] *= l->scales[r0 + r];
            if (l->bias) acc[r * MAX_NB + b] += l->bias[r0 + r];
        }
}

/* Claims the next GRAB row tiles of the running linear layer into [*lo, *hi); false when none are left.
 *
 * Rows are claimed, not split in fixed shares: a thread that runs slower (its core shared with another
 * process) does fewer tiles instead of holding every phase up until its fixed half is done. */
#define GRAB 8
static int claim(const Team *t, int64_t tiles, int64_t *lo, int64_t *hi) {
    *lo = atomic_fetch_add_explicit(&t->barrier->next_tile, GRAB, memory_order_relaxed);
    *hi = *lo + GRAB < tiles ? *lo + GRAB : tiles;
    return *lo < tiles;
}

/* y [B, out] = x [B, in] @ w.T (+ bias), or y += that (the residual stream) when accumulate; the tiles this
 * thread claims. */
static void linear(const Team *team, const Linear *l, const float *x, int64_t B, float *y, int accumulate) {
    int64_t lo, hi;
    while (claim(team, (l->out + TILE_R - 1) / TILE_R, &lo, &hi)) {
        for (int64_t t = lo; t < hi; t++) {
            const int64_t r0 = t * TILE_R;
            const int R = l->out - r0 < TILE_R ? (int)(l->out - r0) : TILE_R;
            for (int64_t b0 = 0; b0 < B; b0 += MAX_NB) {
                const int NB = B - b0 < MAX_NB ? (int)(B - b0) : MAX_NB;
                float acc[TILE_R * MAX_NB];
                tile(l, r0, R, x, b0, NB, acc);
                for (int r = 0; r < R; r++)
                    for (int b = 0; b < NB; b++) {
                        float *out = y + (b0 + b) * l->out + r0 + r;
                        *out = accumulate ? *out + acc[r * MAX_NB + b] : acc[r * MAX_NB + b];
                    }
            }
        }
    }
}

/* act [B, I] = silu(gate) * up, with gate and up the two halves of l's rows: a thread computes the gate rows
 * and the matching up rows of a tile together, so the activation needs no second pass. */
static void gated_linear(const Team *team, const Linear *l, const float *x, int64_t B, float *act) {
    const int64_t I = l->out / 2;
    int64_t lo, hi;
    while (claim(team, (I + TILE_R - 1) / TILE_R, &lo, &hi)) {
        for (int64_t t = lo; t < hi; t++) {
            const int64_t r0 = t * TILE_R;
            const int R = I - r0 < TILE_R ? (int)(I - r0) : TILE_R;
            for (int64_t b0 = 0; b0 < B; b0 += MAX_NB) {
                const int NB = B - b0 < MAX_NB ? (int)(B - b0) : MAX_NB;
                float gate[TILE_R * MAX_NB], up[TILE_R * MAX_NB];
                tile(l, r0, R, x, b0, NB, gate);
                tile(l, I + r0, R, x, b0, NB, up);
                for (int r = 0; r < R; r++)
                    for (int b = 0; b < NB; b++) {
                        const float g = gate[r * MAX_NB + b];
                        act[(b0 + b) * I + r0 + r] = g / (1.f + expf(-g)) * up[r * MAX_NB + b];
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

/* Rotate-half rotary, as RotaryEmbedding.rotate: x * cos + roll(x, D/2) * signed_sin. */
static void rotate(float *x, const float *cos, const float *ssin, int64_t D) {
    float tmp[1024];
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; d++) tmp[d] = x[d] * cos[d] + x[d < half ? d + half : d - half] * ssin[d];
    memcpy(x, tmp, D * sizeof(float));
}

INLINE int64_t slot_of(const int32_t *table, int64_t pos, int64_t bs) { return (int64_t)table[pos / bs] * bs + pos % bs; }

INLINE float dot(const float *a, const float *b, int64_t n) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) acc += loadv(a + i) * loadv(b + i);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Softmax weights in place: exp(s - max) / sum. */
static void softmax(float *scores, int64_t len) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < len; t++) mx = scores[t] > mx ? scores[t] : mx;
    for (int64_t t = 0; t < len; t++) {
        scores[t] = expf(scores[t] - mx);
        sum += scores[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; t++) scores[t] *= inv;
}

/* One query head over its sequence's paged context, keys and values read in place block by block through the
 * table (no gather). DV = head_dim / 16 is a constant after inlining: the query and the output stay in
 * registers for the whole context (an output in memory made every key a load-add-store chain). */
INLINE void attend_head(const float *k_cache, const float *v_cache, const float *qh, const int32_t *table,
                        int64_t len, int64_t bs, int64_t stride, float scale, float *o, float *scores, const int DV) {
    vf q[256 / VW], acc[256 / VW];
    for (int c = 0; c < DV; c++) q[c] = loadv(qh + VW * c), acc[c] = (vf){0};
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t base = (int64_t)table[t0 / bs] * bs, n = len - t0 < bs ? len - t0 : bs;
        for (int64_t j = 0; j < n; j++) {
            const float *k = k_cache + (base + j) * stride;
            vf d = q[0] * loadv(k);
            for (int c = 1; c < DV; c++) d += q[c] * loadv(k + VW * c);
            scores[t0 + j] = hsum(d) * scale;
        }
    }
    softmax(scores, len);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t base = (int64_t)table[t0 / bs] * bs, n = len - t0 < bs ? len - t0 : bs;
        for (int64_t j = 0; j < n; j++) {
            const float *v = v_cache + (base + j) * stride;
            const float p = scores[t0 + j];
            for (int c = 0; c < DV; c++) acc[c] += p * loadv(v + VW * c);
        }
    }
    for (int c = 0; c < DV; c++) storev(o + VW * c, acc[c]);
}

/* Any other head size: the same arithmetic with the output in memory. */
static void attend_head_any(const float *k_cache, const float *v_cache, const float *qh, const int32_t *table,
                            int64_t len, int64_t bs, int64_t stride, int64_t D, float scale, float *o,
                            float *scores) {
    for (int64_t t = 0; t < len; t++) scores[t] = dot(qh, k_cache + slot_of(table, t, bs) * stride, D) * scale;
    softmax(scores, len);
    for (int64_t d = 0; d < D; d++) o[d] = 0.f;
    for (int64_t t = 0; t < len; t++) {
        const float *v = v_cache + slot_of(table, t, bs) * stride, p = scores[t];
        for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
    }
}

/* The query heads that share kv head g, over one sequence's context. */
static void attend(const Model *m, const Layer *l, const float *q, const int32_t *table, int64_t len, int64_t g,
                   float *out, float *scores) {
    const int64_t D = m->head_dim, Hkv = m->num_kv_heads, group = m->num_heads / Hkv, bs = m->block_size;
    const float *k_cache = l->k_cache + g * D, *v_cache = l->v_cache + g * D;  /* slot stride Hkv * D */
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        const float *qh = q + h * D;
        float *o = out + h * D;
        switch (D) {
            case 64: attend_head(k_cache, v_cache, qh, table, len, bs, Hkv * D, m->scale, o, scores, 64 / VW); break;
            case 128: attend_head(k_cache, v_cache, qh, table, len, bs, Hkv * D, m->scale, o, scores, 128 / VW); break;
            case 256: attend_head(k_cache, v_cache, qh, table, len, bs, Hkv * D, m->scale, o, scores, 256 / VW); break;
            default: attend_head_any(k_cache, v_cache, qh, table, len, bs, Hkv * D, D, m->scale, o, scores);
        }
    }
}

typedef struct {
    float *x, *qkv, *attn, *act;  /* shared by the team */
    float *h, *scores;            /* per thread: this thread's copy of the normed rows, its softmax scores */
} Scratch;

/* Every thread norms the rows itself into its own buffer: a few thousand flops instead of a barrier. */
static float *norm_rows(const Model *m, const float *w, int64_t B, const Scratch *s, const Team *t) {
    float *h = s->h + t->tid * B * m->hidden;
    for (int64_t b = 0; b < B; b++) rms_norm(s->x + b * m->hidden, w, m->hidden, m->eps, h + b * m->hidden);
    return h;
}

static void attention_block(const Model *m, const Layer *l, int64_t B, const int64_t *positions,
                            const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                            const Scratch *s, int64_t max_len, const Team *team) {
    const int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads, qkv_n = l->qkv.out;
    int64_t lo, hi;
    linear(team, &l->qkv, norm_rows(m, l->input_norm, B, s, team), B, s->qkv, 0);
    sync_team(team);
    /* q/k norm and rotary per (sequence, head), then the new K/V into the pool */
    share(team, B, &lo, &hi);
    for (int64_t b = lo; b < hi; b++) {
        float *q = s->qkv + b * qkv_n, *k = q + Hq * D, *v = k + Hkv * D;
        const float *cos = m->cos + positions[b] * D, *ssin = m->signed_sin + positions[b] * D;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float *head = q + h * D;  /* q heads then k heads, side by side */
            if (l->q_norm) rms_norm(head, h < Hq ? l->q_norm : l->k_norm, D, m->eps, head);
            rotate(head, cos, ssin, D);
        }
        const int64_t slot = slot_of(tables + b * table_stride, positions[b], m->block_size);
        memcpy(l->k_cache + slot * Hkv * D, k, Hkv * D * sizeof(float));
        memcpy(l->v_cache + slot * Hkv * D, v, Hkv * D * sizeof(float));
    }
    sync_team(team);
    share(team, B * Hkv, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        const int64_t b = i / Hkv, g = i % Hkv;
        attend(m, l, s->qkv + b * qkv_n, tables + b * table_stride, seq_lens[b], g, s->attn + b * Hq * D,
               s->scores + team->tid * max_len);
    }
    sync_team(team);
    linear(team, &l->o, s->attn, B, s->x, 1);
    sync_team(team);
}

static void mlp_block(const Model *m, const Layer *l, int64_t B, const Scratch *s, const Team *team) {
    gated_linear(team, &l->gate_up, norm_rows(m, l->post_norm, B, s, team), B, s->act);
    sync_team(team);
    linear(team, &l->down, s->act, B, s->x, 1);
    sync_team(team);
}

/* Logits [B, vocab] of one decode step. Returns 0, or -1 when scratch memory could not be had. */
API int pc_decode_step(const Model *m, int64_t B, const int64_t *ids, const int64_t *positions,
                       const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, float *logits,
                       int num_threads) {
    const int64_t H = m->hidden, qkv_n = m->layers[0].qkv.out, I = m->layers[0].down.in;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    if (num_threads < 1) num_threads = 1;
    const int64_t sizes[] = {B * H, B * qkv_n, B * m->num_heads * m->head_dim, B * I, num_threads * B * H,
                             num_threads * max_len};
    int64_t total = 0;
    for (int i = 0; i < 6; i++) total += (sizes[i] + 15) / 16 * 16;
    float *mem = aligned_alloc(64, total * sizeof(float));
    if (!mem) return -1;
    float *parts[6], *p = mem;
    for (int i = 0; i < 6; i++) {
        parts[i] = p;
        p += (sizes[i] + 15) / 16 * 16;
    }
    const Scratch s = {parts[0], parts[1], parts[2], parts[3], parts[4], parts[5]};
    for (int64_t b = 0; b < B; b++) memcpy(s.x + b * H, m->embed + ids[b] * H, H * sizeof(float));
    Barrier barrier = {0, 0, 0, 0};
#pragma omp parallel num_threads(num_threads)
    {
        const Team team = {omp_get_thread_num(), omp_get_num_threads(), &barrier};
        for (int64_t i = 0; i < m->num_layers; i++) {
            attention_block(m, &m->layers[i], B, positions, tables, table_stride, seq_lens, &s, max_len, &team);
            mlp_block(m, &m->layers[i], B, &s, &team);
        }
        linear(&team, &m->lm_head, norm_rows(m, m->norm, B, &s, &team), B, logits, 0);
    }
    free(mem);
    return 0;
}

/* The struct sizes the Python side checks its ctypes mirrors against. */
API int64_t pc_sizeof_model(void) { return sizeof(Model); }
API int64_t pc_sizeof_layer(void) { return sizeof(Layer); }
/* What this build was compiled for: the vector ISA and the linear layers' tile shape. */
API const char *pc_build_info(void) {
    return ISA_NAME " vw=" STR(VW) " tile=" STR(TILE_R) "x" STR(MAX_NB);
}
