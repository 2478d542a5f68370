/* Compiled CPU kernels of fp8rl (loaded by fp8rl/fp8/kernels.py through ctypes).

   Plain C, no torch headers, so that a build takes a fraction of a second.
   Every kernel computes exactly the IEEE-754 FP32 operations of the torch code
   it replaces, element by element, in the same order (quant.py), so its results
   are the same bits: no fast-math, no fused multiply-add (built with
   -ffp-contract=off), only vectorization of independent elements. */

#include <stdint.h>
#include <stdlib.h> /* malloc: quantize_column_blocks's scratch */
#include <math.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h> /* one conversion instruction, FP16 -> FP32 (load_e4m3_div256) */
#endif
#ifdef _OPENMP
#include <omp.h> /* built with -fopenmp where the compiler has it: torch's own OpenMP runtime, loaded
                    already, runs our parallel loops on its worker threads (kernels.py) */
#endif

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#define E4M3_MAX 448.0f
#define EXPONENT_BITS 0x7F800000u
#define E4M3_MIN_NORMAL_EXP ((127u - 6u) << 23) /* exponent field of 2**-6 */
#define MAGIC_OFFSET ((20u << 23) | (1u << 22)) /* 2**e -> 1.5 * 2**(e + 20) */

/* The largest |x_j| of n values as IEEE bits, starting from acc (NaN orders above Inf). */
static inline uint32_t amax_bits_of(const float *x, int64_t n, uint32_t acc) {
    for (int64_t j = 0; j < n; j++) {
        const uint32_t a = f32_bits(x[j]) & 0x7FFFFFFFu;
        acc = a > acc ? a : acc;
    }
    return acc;
}

/* A block's scale from its finite amax: max(amax, amax_floor) / 448, for ue8m0 rounded up
   to a power of two (from its bits: s is positive and normal). */
static inline float block_scale(float amax, float amax_floor, int ue8m0) {
    float s = (amax < amax_floor ? amax_floor : amax) / E4M3_MAX;
    if (ue8m0) {
        const uint32_t sb = f32_bits(s);
        s = f32_from_bits(((sb >> 23) + ((sb & 0x7FFFFFu) != 0)) << 23);
    }
    return s;
}

/* clamp(y, -448, 448) rounded to the E4M3 grid, to nearest even: adding and subtracting
   1.5 * 2**(e + 20) (e: y's exponent, at least -6). A negative y that rounds to zero gives +0. */
static inline float round_e4m3(float y) {
    y = y < -E4M3_MAX ? -E4M3_MAX : (y > E4M3_MAX ? E4M3_MAX : y);
    uint32_t e = f32_bits(y) & EXPONENT_BITS;
    e = e < E4M3_MIN_NORMAL_EXP ? E4M3_MIN_NORMAL_EXP : e;
    const float magic = f32_from_bits(e + MAGIC_OFFSET);
    return (y + magic) - magic;
}

/* FP32 -> BF16 bits, to nearest even as torch's conversion; NaN becomes torch's scalar NaN. */
static inline uint16_t bf16_bits(float f) {
    const uint32_t u = f32_bits(f);
    const uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : rounded; /* a select: the loops vectorize */
}

/* quant.py's quantize_dequantize on FP32 rows: out[r, :] = the E4M3 1 x bk block
   quantization of x[r, :], dequantized, for rows r < rows of k elements
   (row strides ldx, ldo in elements; the last block of a row may be partial).
   Per block: amax = max |x| (a max over IEEE bits, which orders non-negative
   floats and puts NaN above Inf), s = max(amax, amax_floor) / 448 (ue8m0: rounded
   up to a power of two), y = clamp(x / s, -448, 448) rounded to the E4M3 grid by
   adding and subtracting 1.5 * 2**(e + 20) (e: y's exponent, at least -6),
   out = y * s. Returns 1 (nothing else defined) if x holds NaN or Inf, else 0. */
int fp8rl_qdq_rows(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, int64_t k,
                   int64_t bk, float amax_floor, int ue8m0, int threads) {
    int bad = 0;
    (void)threads;
    /* Rows on torch's threads where there is enough work to share (a prefill's or a large
       batch's 64 x 1536 input: a row's blocks are the same arithmetic on any thread). */
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) reduction(|: bad) if (threads > 1 && rows * k >= 32768)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *outr = out + r * ldo;
        for (int64_t c0 = 0; c0 < k; c0 += bk) {
            const int64_t n = k - c0 < bk ? k - c0 : bk;
            const float *xb = xr + c0;
            float *ob = outr + c0;
            const uint32_t amax_bits = amax_bits_of(xb, n, 0);
            bad |= amax_bits >= EXPONENT_BITS;
            const float s = block_scale(f32_from_bits(amax_bits), amax_floor, ue8m0);
            for (int64_t j = 0; j < n; j++) ob[j] = round_e4m3(xb[j] / s) * s;
        }
    }
    return bad;
}

/* quant.e4m3_values of one FP32 value at scale s: clamp(x / s, -448, 448) on the E4M3 grid
   (round_e4m3), with the sign of x (a negative value that rounds to zero keeps its sign). */
static inline float e4m3_value(float x, float s) {
    const uint32_t mag = f32_bits(round_e4m3(x / s)) & 0x7FFFFFFFu; /* round_e4m3 clamps first */
    return f32_from_bits(mag | (f32_bits(x) & 0x80000000u));
}

/* The E4M3 code (torch.float8_e4m3fn's byte) of y: a value on the E4M3 grid (|y| <= 448, as
   e4m3_value gives) or NaN. Normal values (from 2**-6) move their FP32 exponent and top three
   mantissa bits into the code's fields; subnormal ones are m * 2**-9, m = y * 512 exactly. */
static inline uint8_t e4m3_code(float y) {
    const uint32_t u = f32_bits(y), mag = u & 0x7FFFFFFFu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (mag > 0x7F800000u) return sign | 0x7Fu;
    if (mag < (121u << 23)) return sign | (uint8_t)(f32_from_bits(mag) * 512.0f);
    return sign | (uint8_t)((((mag >> 23) - 120u) << 3) | ((mag >> 20) & 7u));
}

/* One quantized value stored: its E4M3 code (values == NULL), or its dequantization
   value * s as FP32 (bf16 == 0) or rounded to BF16 bits (bf16 == 1): what dequantize makes
   of that code (the code's value is e4m3_value's, sign of zero included). */
static inline void store_e4m3(uint8_t *codes, void *values, int bf16, int64_t i, float x, float s) {
    const float y = e4m3_value(x, s);
    if (values == NULL) codes[i] = e4m3_code(y);
    else if (bf16) ((uint16_t *)values)[i] = bf16_bits(y * s);
    else ((float *)values)[i] = y * s;
}

/* Column blocks (bk = 1: the FP8 wgrad's blocks of bm tokens of one feature) with the rows
   outer and the columns inner, so that each pass runs along a row's contiguous values (the
   block-by-block loop would take one value per row): per column c, amax over the block's
   rows, then each value divided by its column's scale and encoded. The same operations per
   value as the general loop, hence the same bits; amax is a max, exact in any order. `amax`
   is k values of scratch. */
static int quantize_column_blocks(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t bm,
                                  float amax_floor, int ue8m0, uint8_t *codes, void *values, int bf16,
                                  float *scales, uint32_t *amax) {
    for (int64_t r0 = 0; r0 < m; r0 += bm) {
        const int64_t r1 = m - r0 < bm ? m : r0 + bm;
        float *s = scales + (r0 / bm) * k;
        memset(amax, 0, (size_t)k * sizeof *amax);
        for (int64_t r = r0; r < r1; r++) {
            const float *xr = x + r * ldx;
            for (int64_t c = 0; c < k; c++) {
                const uint32_t a = f32_bits(xr[c]) & 0x7FFFFFFFu;
                amax[c] = a > amax[c] ? a : amax[c];
            }
        }
        for (int64_t c = 0; c < k; c++) {
            if (amax[c] >= EXPONENT_BITS) return 1;
            s[c] = block_scale(f32_from_bits(amax[c]), amax_floor, ue8m0);
        }
        for (int64_t r = r0; r < r1; r++) {
            const float *xr = x + r * ldx;
            for (int64_t c = 0; c < k; c++) store_e4m3(codes, values, bf16, r * k + c, xr[c], s[c]);
        }
    }
    return 0;
}

/* quant.py's quantize of an FP32 matrix x [m, k] (row stride ldx) into E4M3 blocks of
   bm x bk (the last row and column blocks may be partial): per block, amax = max |x|
   (over IEEE bits, NaN above Inf), s = max(amax, amax_floor) / 448 (ue8m0: rounded up
   to a power of two), y = clamp(x / s, -448, 448) rounded to the E4M3 grid as in
   fp8rl_qdq_rows, and its E4M3 code (the sign of y kept, as the cast keeps it for a
   value that rounds to zero). codes [m, k] (row stride k), scales [ceil(m/bm),
   ceil(k/bk)] row-major. With values != NULL it writes, instead of the codes, their
   dequantization (values [m, k], row stride k): FP32, or rounded to BF16 as uint16 bits
   (bf16 == 1): the FP8 backward's GEMM operands, in one pass instead of quantize and
   dequantize (and convert). Returns 1 (nothing else defined) if x holds NaN or Inf. Column blocks
   (bk = 1) go through quantize_column_blocks: the same bits in row order. */
int fp8rl_quantize_blocks(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t bm, int64_t bk,
                          float amax_floor, int ue8m0, uint8_t *codes, void *values, int bf16, float *scales) {
    if (bk == 1 && bm > 1) {
        uint32_t *amax = malloc((size_t)k * sizeof *amax);
        if (amax != NULL) {
            const int bad = quantize_column_blocks(x, ldx, m, k, bm, amax_floor, ue8m0, codes, values, bf16, scales, amax);
            free(amax);
            return bad;
        }
    }
    const int64_t kb = (k + bk - 1) / bk;
    for (int64_t r0 = 0; r0 < m; r0 += bm) {
        const int64_t rows = m - r0 < bm ? m - r0 : bm;
        for (int64_t c0 = 0; c0 < k; c0 += bk) {
            const int64_t n = k - c0 < bk ? k - c0 : bk;
            uint32_t amax_bits = 0;
            for (int64_t r = r0; r < r0 + rows; r++) amax_bits = amax_bits_of(x + r * ldx + c0, n, amax_bits);
            if (amax_bits >= EXPONENT_BITS) return 1;
            const float s = block_scale(f32_from_bits(amax_bits), amax_floor, ue8m0);
            scales[(r0 / bm) * kb + c0 / bk] = s;
            for (int64_t r = r0; r < r0 + rows; r++) {
                const float *xr = x + r * ldx + c0;
                for (int64_t j = 0; j < n; j++) store_e4m3(codes, values, bf16, r * k + c0 + j, xr[j], s);
            }
        }
    }
    return 0;
}

/* quant.py's dequantize of E4M3 blocks: out[r, c] = value(codes[r, c]) * scales[r / bm, c / bk]
   (one FP32 rounding), stored as FP32 (bf16 == 0) or rounded to BF16 (to nearest even, as
   torch's conversion; the values are finite) as uint16 bits (bf16 == 1). */
void fp8rl_dequantize_blocks(const uint8_t *codes, const float *scales, int64_t m, int64_t k, int64_t bm,
                             int64_t bk, int bf16, void *out) {
    float table[256];
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 15, mant = c & 7;
        float v = e == 0 ? (float)mant / 512.0f : f32_from_bits((uint32_t)(e + 120) << 23) * (1.0f + mant / 8.0f);
        if ((c & 0x7F) == 0x7F) v = __builtin_nanf(""); /* E4M3's only NaN codes */
        table[c] = (c & 0x80) ? -v : v;
    }
    const int64_t kb = (k + bk - 1) / bk;
    for (int64_t r = 0; r < m; r++) {
        const uint8_t *cr = codes + r * k;
        const float *sr = scales + (r / bm) * kb;
        for (int64_t c0 = 0; c0 < k; c0 += bk) {
            const int64_t n = k - c0 < bk ? k - c0 : bk;
            const float s = sr[c0 / bk];
            if (bf16) {
                uint16_t *o = (uint16_t *)out + r * k + c0;
                for (int64_t j = 0; j < n; j++) {
                    o[j] = bf16_bits(table[cr[c0 + j]] * s);
                }
            } else {
                float *o = (float *)out + r * k + c0;
                for (int64_t j = 0; j < n; j++) o[j] = table[cr[c0 + j]] * s;
            }
        }
    }
}

/* ---- Softmax attention, one fused pass per group of query rows ----

   Not a copy of torch code: the attention of the fast backends (`cpu`, `amx`) is defined by
   this kernel, in the rollout's decode steps and in the training forward alike, so both get
   the same bits by construction. A query row's output depends only on its own q, its mask
   row and the keys and values of its KV head: the same operations in the same order whatever
   the batch, the number of rows computed together, the number of key slots passed (slots past
   the row's last live one are never read) or the storage (BF16 widens exactly; a per-head
   scale is one FP32 product, what transformer.store_heads computes for FP8 K/V).

   Per row (16-lane vectors of GCC's vector extension: each lane is plain IEEE FP32
   arithmetic, the same on AVX-512, AVX2 or scalar code):
     score[l] = (sum over d in ascending order of q[d] * k[l][d]) * scale, lane l % 16;
     blocked slots -> -inf; m = max of the live scores (exact, any order);
     e[l] = exp(score[l] - m) (exp_nonpos below; 0 where blocked);
     sum: 16 lane sums over l in ascending order, then a fixed halving tree;
     p[l] = e[l] / sum (with p_scale > 0: rounded to E4M3 at that scale, as store_heads);
     out[d] = sum over live l in ascending order of p[l] * v[l][d]. */

#define LANES 16
#define ROWS 4   /* query rows sharing one pass over their KV head's keys */
#define CHUNKS 4 /* 16-key chunks of one pass: independent sums, so they overlap */
#define DBLK 4   /* 16-wide blocks of the output row accumulated in one pass over the values */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint8_t vb8 __attribute__((vector_size(16)));

static inline vf splat(float x) { return (vf){0} + x; }
static inline vf select_vf(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf loadu(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storeu(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf load_bf16(const uint16_t *p) { vh h; memcpy(&h, p, sizeof h); return (vf)(__builtin_convertvector(h, vu) << 16); }

/* 16 E4M3 codes (OCP E4M3FN, torch.float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa
   bits; 0x7F and 0xFF NaN) -> their values times 2**-8, exactly, in FP32. The code's bits moved
   into an FP16's (sign to bit 15, exponent and mantissa to bits 13..7) make an FP16 of exactly
   that value, subnormal codes included, which F16C converts to FP32 in one instruction; the
   caller folds the 2**8 into its FP32 scale (s * 256 is exact, and (v / 256) * (s * 256) rounds
   the same real number as v * s). Without F16C: the same numbers from integer arithmetic. */
static inline vf load_e4m3_div256(const uint8_t *p) {
    vb8 b;
    memcpy(&b, p, sizeof b);
    const vh c = __builtin_convertvector(b, vh);
#if defined(__AVX512F__) || defined(__F16C__)
    vh h = ((c & 0x7F) << 7) | ((c & 0x80) << 8);
    const vh nan = (vh)((c & 0x7F) == 0x7F);
    h = (h & ~nan) | (nan & 0x7E00); /* NaN stays NaN */
#endif
#if defined(__AVX512F__)
    __m256i hi;
    memcpy(&hi, &h, sizeof hi);
    const __m512 f = _mm512_cvtph_ps(hi);
    vf out;
    memcpy(&out, &f, sizeof out);
    return out;
#elif defined(__F16C__)
    __m128i lo, hi;
    memcpy(&lo, &h, sizeof lo);
    memcpy(&hi, (const char *)&h + 16, sizeof hi);
    const __m256 a = _mm256_cvtph_ps(lo), z = _mm256_cvtph_ps(hi);
    vf out;
    memcpy(&out, &a, 32);
    memcpy((char *)&out + 32, &z, 32);
    return out;
#else
    const vu u = __builtin_convertvector(c, vu), em = u & 0x7Fu;         /* exponent and mantissa */
    const vf normal = (vf)((em << 20) + (112u << 23));                   /* 2**(e - 15) (1 + m / 8) */
    const vf subnormal = __builtin_convertvector((vi)em, vf) * 0x1p-17f; /* m * 2**-9 * 2**-8 */
    vf mag = select_vf((vi)(em < 8u), subnormal, normal);
    mag = select_vf((vi)(em == 0x7Fu), splat(NAN), mag);
    return (vf)((vu)mag | ((u & 0x80u) << 24));
#endif
}

/* How the attention kernel's K/V are stored. */
#define KV_F32 0
#define KV_BF16 1
#define KV_E4M3 2 /* codes; the caller's scales carry the 2**8 of load_e4m3_div256 */
static inline vf load_kv(const void *base, int64_t at, int kind) {
    if (kind == KV_E4M3) return load_e4m3_div256((const uint8_t *)base + at);
    return kind == KV_BF16 ? load_bf16((const uint16_t *)base + at) : loadu((const float *)base + at);
}

/* round_e4m3 on 16 lanes. */
static inline vf round_e4m3_v(vf y) {
    y = select_vf(y < -E4M3_MAX, splat(-E4M3_MAX), y);
    y = select_vf(y > E4M3_MAX, splat(E4M3_MAX), y);
    vu e = (vu)y & EXPONENT_BITS;
    e = (vu)select_vf((vi)(e < E4M3_MIN_NORMAL_EXP), (vf)((vu){0} + E4M3_MIN_NORMAL_EXP), (vf)e);
    const vf magic = (vf)(e + MAGIC_OFFSET);
    return (y + magic) - magic;
}

/* exp(x) for x <= 0 (softmax's shifted scores): Cephes' expf, a Cody-Waite reduction
   x = n ln2 + r and a degree-7 polynomial in r (about 1 ulp), times 2**n from its bits; 0
   below -87 (where 2**n would leave the normal range; such a weight is below 2**-125). */
static inline vf exp_nonpos_v(vf x) {
    const vf big = splat(12582912.0f); /* 1.5 * 2**23: adding it rounds to an integer */
    const vi under = x < -87.0f;
    const vf xc = select_vf(under, splat(-87.0f), x);
    const vf n = (xc * 1.44269504088896341f + big) - big;
    vf r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = splat(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = (p * (r * r) + r) + 1.0f;
    const vf two_n = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
    return select_vf(under, splat(0.0f), p * two_n);
}

/* The 16 lanes' sum by a fixed halving tree (lane l + width into lane l), and their max
   (NaN lanes skipped): the horizontal reductions every kernel here ends its row with. */
static inline float lanes_sum(vf v) {
    float lanes[LANES];
    storeu(lanes, v);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] = lanes[l] + lanes[l + width];
    return lanes[0];
}

static inline float lanes_max(vf v) {
    float m = -INFINITY;
    for (int l = 0; l < LANES; l++) m = v[l] > m ? v[l] : m;
    return m;
}

/* R query rows (qr, o, mask, live slot counts hi_of) against one KV head: keys kt[d * kt_d + l]
   (transposed: the slot axis contiguous), values v[l * v_l + d]; s: R x Lpad scratch. */
static inline __attribute__((always_inline)) void rows_attention(
    const float *const *qr, float *const *o, const uint8_t *const *mask, const int64_t *hi_of, const int R,
    const void *kt, int64_t kt_d, const void *v, int64_t v_l, const int kind, float ks, float vs,
    int64_t D, float scale, float p_scale, float *s, int64_t Lpad) {
    const int scaled = kind == KV_E4M3; /* only E4M3 codes carry per-head scales */
    int64_t hi = 0;
    for (int r = 0; r < R; r++) hi = hi_of[r] > hi ? hi_of[r] : hi;
    const int64_t nch = (hi + LANES - 1) / LANES;
    const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vf vmx[ROWS];
    for (int r = 0; r < R; r++) vmx[r] = splat(-INFINITY);
    for (int64_t c0 = 0; c0 < nch; c0 += CHUNKS) {
        const int nc = nch - c0 < CHUNKS ? (int)(nch - c0) : CHUNKS;
        vf acc[ROWS][CHUNKS];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CHUNKS; c++) acc[r][c] = splat(0.0f);
        for (int64_t d = 0; d < D; d++)
            for (int c = 0; c < nc; c++) {
                vf kv = load_kv(kt, d * kt_d + (c0 + c) * LANES, kind);
                if (scaled) kv = kv * ks;
                for (int r = 0; r < R; r++) acc[r][c] = acc[r][c] + qr[r][d] * kv;
            }
        for (int c = 0; c < nc; c++) {
            const int64_t l0 = (c0 + c) * LANES;
            for (int r = 0; r < R; r++) {
                vb8 blocked;
                memcpy(&blocked, mask[r] + l0, LANES); /* mask rows are padded to whole chunks */
                const vi live = (__builtin_convertvector(blocked, vi) == 0) & ((iota + (int32_t)l0) < (int32_t)hi_of[r]);
                const vf x = select_vf(live, acc[r][c] * scale, splat(-INFINITY));
                storeu(s + r * Lpad + l0, x);
                vmx[r] = select_vf(x > vmx[r], x, vmx[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float *sr = s + r * Lpad;
        const float m = lanes_max(vmx[r]);
        vf sum = splat(0.0f);
        for (int64_t c = 0; c < nch; c++) {
            const vf x = loadu(sr + c * LANES);
            const vf e = select_vf(x == -INFINITY, splat(0.0f), exp_nonpos_v(x - m));
            storeu(sr + c * LANES, e);
            sum = sum + e;
        }
        const float total = lanes_sum(sum);
        for (int64_t c = 0; c < nch; c++) {
            vf p = loadu(sr + c * LANES) / total;
            if (p_scale > 0.0f) { /* quant.dequantize_static(p, p_scale): sign of p, then the scale */
                const vf y = round_e4m3_v(p / p_scale);
                p = (vf)(((vu)y & 0x7FFFFFFFu) | ((vu)p & 0x80000000u)) * p_scale;
            }
            storeu(sr + c * LANES, p);
        }
    }
    for (int64_t d0 = 0; d0 < D; d0 += DBLK * LANES) {
        const int nb = (D - d0) / LANES < DBLK ? (int)((D - d0) / LANES) : DBLK;
        vf acc[ROWS][DBLK];
        for (int r = 0; r < R; r++)
            for (int k = 0; k < DBLK; k++) acc[r][k] = splat(0.0f);
        for (int64_t l = 0; l < hi; l++) { /* a blocked slot's p is 0: adds +-0 to sums that start at +0 */
            float p[ROWS];
            for (int r = 0; r < R; r++) p[r] = s[r * Lpad + l];
            for (int k = 0; k < nb; k++) {
                vf vv = load_kv(v, l * v_l + d0 + k * LANES, kind);
                if (scaled) vv = vv * vs;
                for (int r = 0; r < R; r++) acc[r][k] = acc[r][k] + p[r] * vv;
            }
        }
        for (int r = 0; r < R; r++)
            for (int k = 0; k < nb; k++) storeu(o[r] + d0 + k * LANES, acc[r][k]);
    }
}

#define ROWS_CALL(R)                                                                                            \
    do {                                                                                                        \
        if (item_kind == KV_E4M3) rows_attention(qr, o, mask, hi, R, ktb, item_kt_d, vb, item_v_l, KV_E4M3, ks, vs, D, scale, p_scale, s, Lpad); \
        else if (item_kind == KV_BF16) rows_attention(qr, o, mask, hi, R, ktb, item_kt_d, vb, item_v_l, KV_BF16, ks, vs, D, scale, p_scale, s, Lpad); \
        else rows_attention(qr, o, mask, hi, R, ktb, item_kt_d, vb, item_v_l, KV_F32, ks, vs, D, scale, p_scale, s, Lpad);      \
    } while (0)

/* BF16 or E4M3 keys and values read by more than one group of query rows (a prefill, a
   training forward) are widened once per item into FP32 scratch, E4M3 values times their
   head's scale: the FP32 numbers the direct path forms at every use, so the same numbers reach
   the same arithmetic (KV_F32 on the scratch) and the bits do not change; only the decoding is
   not repeated for every group of ROWS rows (docs/design.md section 3 has the prefill's
   times). A decode step (one group) reads its cache directly. */
#define WIDEN_KV(kind, nrows) ((kind) != KV_F32 && (nrows) > ROWS)

/* Floats of work one thread needs (kernels.py's `attention` allocates threads times this). */
int64_t fp8rl_attention_work(int kind, int64_t nrows, int64_t D, int64_t Lpad) {
    return ROWS * Lpad + (WIDEN_KV(kind, nrows) ? 2 * D * Lpad : 0);
}

/* out[b, h, t] = softmax attention of q[b, h, t] over the first L key slots of KV head
   h / (H / Hkv) of batch row b, for b in [b0, b1).
     q      FP32 [B, H, T, D], contiguous; out the same;
     kt     keys transposed [B, Hkv, D, *] (slot axis contiguous), strides kt_b, kt_h, kt_d;
     v      values [B, Hkv, *, D] (D contiguous), strides v_b, v_h, v_l;
            FP32 (kind KV_F32) or BF16 bits (KV_BF16) as they are, or E4M3 codes (KV_E4M3) times
            k_scale[h] / v_scale[h] (FP8 K/V: the E4M3 values and their per-head scales; the
            other kinds take no scales);
     blocked uint8 [B, T, Lpad] (1: slot not attended; Lpad = L rounded up to 16, the padding 1),
            strides m_b, m_t;
     D a multiple of 16; work: threads * attention_work(kind, G * T, D, Lpad) floats (each thread
     its rows of scores, and where WIDEN_KV its item's widened keys and values). The (b, KV head)
     items are shared among `threads` OpenMP threads where built with OpenMP; an item's
     arithmetic is the same on any thread, so the bits do not depend on the thread count. */
void fp8rl_attention(const float *q, const void *kt, const void *v, int kind, const float *k_scale,
                     const float *v_scale, int64_t kt_b, int64_t kt_h, int64_t kt_d, int64_t v_b, int64_t v_h,
                     int64_t v_l, const uint8_t *blocked, int64_t m_b, int64_t m_t, int64_t b0, int64_t b1,
                     int64_t H, int64_t Hkv, int64_t T, int64_t D, int64_t L, float scale, float p_scale,
                     float *out, float *work, int threads) {
    const int64_t G = H / Hkv, Lpad = (L + LANES - 1) / LANES * LANES;
    const int64_t esz = kind == KV_E4M3 ? 1 : (kind == KV_BF16 ? 2 : 4);
    const int64_t items = (b1 - b0) * Hkv; /* one (batch row, KV head) each: no item reads another's output */
    const int64_t nrows = G * T; /* row i: query head hk * G + i / T, token i % T */
    const int widen = WIDEN_KV(kind, nrows);
    const int64_t per_thread = fp8rl_attention_work(kind, nrows, D, Lpad);
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && items > 1)
#endif
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = b0 + item / Hkv, hk = item % Hkv;
#ifdef _OPENMP
        float *s = work + (int64_t)omp_get_thread_num() * per_thread;
#else
        float *s = work;
#endif
        const char *ktb = (const char *)kt + (b * kt_b + hk * kt_h) * esz;
        const char *vb = (const char *)v + (b * v_b + hk * v_h) * esz;
        if (item + 1 < items) { /* the next item's keys and values, on their way while this one computes */
            const int64_t bn = b0 + (item + 1) / Hkv, hn = (item + 1) % Hkv;
            const char *ktn = (const char *)kt + (bn * kt_b + hn * kt_h) * esz;
            const char *vn = (const char *)v + (bn * v_b + hn * v_h) * esz;
            for (int64_t d = 0; d < D; d++)
                for (int64_t at = 0; at < L * esz; at += 64) __builtin_prefetch(ktn + d * kt_d * esz + at, 0, 2);
            for (int64_t at = 0; at < L * v_l * esz; at += 64) __builtin_prefetch(vn + at, 0, 2);
        }
        const float unit = kind == KV_E4M3 ? 256.0f : 1.0f; /* load_e4m3_div256's 2**-8, undone exactly */
        float ks = k_scale ? k_scale[hk] * unit : 1.0f, vs = v_scale ? v_scale[hk] * unit : 1.0f;
        int item_kind = kind;
        int64_t item_kt_d = kt_d, item_v_l = v_l;
        if (widen) { /* keys [D, Lpad] (every chunk a row reads), values [L, D] */
            float *kw = s + ROWS * Lpad, *vw = kw + D * Lpad;
            const int scaled = kind == KV_E4M3; /* as in rows_attention */
            for (int64_t d = 0; d < D; d++)
                for (int64_t l = 0; l < Lpad; l += LANES) {
                    const vf x = load_kv(ktb, d * kt_d + l, kind);
                    storeu(kw + d * Lpad + l, scaled ? x * ks : x);
                }
            for (int64_t l = 0; l < L; l++)
                for (int64_t d = 0; d < D; d += LANES) {
                    const vf x = load_kv(vb, l * v_l + d, kind);
                    storeu(vw + l * D + d, scaled ? x * vs : x);
                }
            ktb = (const char *)kw, vb = (const char *)vw;
            item_kind = KV_F32, item_kt_d = Lpad, item_v_l = D, ks = vs = 1.0f;
        }
        for (int64_t i0 = 0; i0 < nrows; i0 += ROWS) {
            const float *qr[ROWS];
            float *o[ROWS];
            const uint8_t *mask[ROWS];
            int64_t hi[ROWS];
            const int nr = nrows - i0 < ROWS ? (int)(nrows - i0) : ROWS;
            for (int r = 0; r < nr; r++) {
                const int64_t h = hk * G + (i0 + r) / T, t = (i0 + r) % T;
                qr[r] = q + ((b * H + h) * T + t) * D;
                o[r] = out + ((b * H + h) * T + t) * D;
                mask[r] = blocked + b * m_b + t * m_t;
                int64_t e = L; /* the row's live slots end here: nothing after is read */
                while (e > 0 && mask[r][e - 1]) e--;
                hi[r] = e;
            }
            switch (nr) {
            case 1: ROWS_CALL(1); break;
            case 2: ROWS_CALL(2); break;
            case 3: ROWS_CALL(3); break;
            default: ROWS_CALL(4); break;
            }
        }
    }
}

/* ---- One decode step's heads into the fused KV cache ----

   The torch code of Attention.forward between the q/k/v GEMMs and the attention kernel, for
   the rollout's fused cache, in one pass and the same bits (element by element IEEE FP32
   operations, no reduction):
     rope:     y[d] = x[d] * cos[d] + x[(d + D/2) % D] * sin_rot[d] (transformer.apply_rope; the
               sign of the rotated half is carried by sin_rot);
     q:        stored per `q_mode`: 0 FP32 as is; 1 BF16-rounded (to nearest even, as torch's
               conversion) and widened; 2 E4M3 at its head's scale (quant.dequantize_static:
               clamp(y / s) rounded to E4M3, the sign of y, times s);
     k, v:     written at slot `start + t` of the cache: kv_fp8 == 0 as BF16 bits, the values
               rounded to nearest even (NaN becomes torch's scalar NaN, 0x7FC0); kv_fp8 == 1 as
               the E4M3 codes (torch.float8_e4m3fn; NaN 0x7F) of their E4M3 values
               (quant.e4m3_values) before the per-head scale, which the attention kernel applies.
   q, k, v   FP32 rows r = b * T + t (row strides lq, lk, lv), head h at h * D, D contiguous;
   cos, sin_rot FP32 [B * T, D]; q_out FP32 [B, H, T, D];
   kt        keys transposed [B, Hkv, D, *] (strides kt_b, kt_h, kt_d), vc values [B, Hkv, *, D]
             (strides v_b, v_h, v_l), in elements of the stored format (2 bytes or 1). */

static inline void rope_row(const float *x, const float *c, const float *s, int64_t D, float *y) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) {
        const float a = x[d] * c[d], b = x[d + half] * s[d];
        y[d] = a + b;
    }
    for (int64_t d = half; d < D; d++) {
        const float a = x[d] * c[d], b = x[d - half] * s[d];
        y[d] = a + b;
    }
}

void fp8rl_rope_store(const float *q, const float *k, const float *v, int64_t lq, int64_t lk, int64_t lv,
                      const float *cos_, const float *sin_rot, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                      int64_t D, int q_mode, const float *q_scale, int kv_fp8, const float *k_scale,
                      const float *v_scale, float *q_out, void *kt, int64_t kt_b, int64_t kt_h, int64_t kt_d,
                      void *vc, int64_t v_b, int64_t v_h, int64_t v_l, int64_t start, int threads) {
    const int64_t esz = kv_fp8 ? 1 : 2;
    (void)threads;
    /* Rows in parallel: the cache writes are scattered (K transposed: one cache line per
       element), so a second thread mostly overlaps their misses. */
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && B * T > 1)
#endif
    for (int64_t r = 0; r < B * T; r++) {
        const int64_t b = r / T, t = r % T, slot = start + t;
        float y[1024]; /* one head's row; D <= 1024 (checked by the caller) */
        const float *c = cos_ + r * D, *s = sin_rot + r * D;
        if (r + 1 < B * T) { /* the next row's key slots: each of its D elements on a cache line of its own */
            const int64_t bn = (r + 1) / T, slot_n = start + (r + 1) % T;
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t d = 0; d < D; d++)
                    __builtin_prefetch((const char *)kt + (bn * kt_b + h * kt_h + d * kt_d + slot_n) * esz, 1, 3);
        }
        for (int64_t h = 0; h < H; h++) {
            float *o = q_out + ((b * H + h) * T + t) * D;
            rope_row(q + r * lq + h * D, c, s, D, o);
            if (q_mode == 1)
                for (int64_t d = 0; d < D; d++) o[d] = f32_from_bits((uint32_t)bf16_bits(o[d]) << 16);
            else if (q_mode == 2)
                for (int64_t d = 0; d < D; d++) o[d] = e4m3_value(o[d], q_scale[h]) * q_scale[h];
        }
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t k_at = b * kt_b + h * kt_h + slot, v_at = b * v_b + h * v_h + slot * v_l;
            const float *vr = v + r * lv + h * D;
            rope_row(k + r * lk + h * D, c, s, D, y);
            if (kv_fp8) {
                uint8_t *kd = (uint8_t *)kt + k_at, *vd = (uint8_t *)vc + v_at, kb[1024];
                for (int64_t d = 0; d < D; d++) {
                    kb[d] = e4m3_code(e4m3_value(y[d], k_scale[h]));
                    vd[d] = e4m3_code(e4m3_value(vr[d], v_scale[h]));
                }
                for (int64_t d = 0; d < D; d++) kd[d * kt_d] = kb[d];
            } else {
                uint16_t *kd = (uint16_t *)kt + k_at, *vd = (uint16_t *)vc + v_at, kb[1024];
                for (int64_t d = 0; d < D; d++) {
                    kb[d] = bf16_bits(y[d]);
                    vd[d] = bf16_bits(vr[d]);
                }
                for (int64_t d = 0; d < D; d++) kd[d * kt_d] = kb[d];
            }
        }
    }
}

/* ---- torch's CPU random numbers: torch.rand(n, generator=g) of several generators at once ----

   A torch.Generator on the CPU is at::mt19937 (the 32-bit Mersenne Twister); torch.rand of
   FP32 draws y = the next tempered 32-bit output and returns (y & (2**24 - 1)) * 2**-24 (its
   low 24 bits: `uniform_real_distribution`), one element after the other. The generator's
   state comes from `Generator.get_state()` (torch's legacy layout: seed u64, left i32,
   seeded i32, next u64, state u64[624]; kernels.py checks the layout against torch.rand
   before using this) and goes back with `set_state`, so the same numbers come out, the
   generator stays where torch would leave it, and a sampling step's noise (16 rows x 49,152
   logits) costs a fraction of torch's serial loop. */

#define MT_N 624
#define MT_M 397
#define MT_LEFT_AT 8
#define MT_NEXT_AT 16
#define MT_STATE_AT 24

static inline uint32_t mt_twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7FFFFFFFu)) >> 1) ^ ((v & 1u) ? 0x9908B0DFu : 0u);
}

static void mt_next_state(uint32_t *s) {
    int j;
    for (j = 0; j < MT_N - MT_M; j++) s[j] = s[j + MT_M] ^ mt_twist(s[j], s[j + 1]);
    for (; j < MT_N - 1; j++) s[j] = s[j + MT_M - MT_N] ^ mt_twist(s[j], s[j + 1]);
    s[MT_N - 1] = s[MT_M - 1] ^ mt_twist(s[MT_N - 1], s[0]);
}

/* n uniform FP32 values in [0, 1) from one generator state (get_state's bytes, updated
   in place), written at out[i * ld .. + width) for i in rows: n = rows * width. */
static void mt_uniform(uint8_t *state, float *out, int64_t rows, int64_t width, int64_t ld) {
    int32_t left;
    uint64_t next, words[MT_N];
    uint32_t s[MT_N];
    memcpy(&left, state + MT_LEFT_AT, 4);
    memcpy(&next, state + MT_NEXT_AT, 8);
    memcpy(words, state + MT_STATE_AT, sizeof words);
    for (int j = 0; j < MT_N; j++) s[j] = (uint32_t)words[j];
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * ld;
        for (int64_t i = 0; i < width;) {
            /* at::mt19937's draw: `if (--left == 0) next_state();` (left = N, next = 0), then
               state[next++]. The draws before that refill, at once: */
            if (left == 1) {
                mt_next_state(s);
                left = MT_N + 1;
                next = 0;
            }
            int64_t take = width - i < (int64_t)left - 1 ? width - i : (int64_t)left - 1;
            const uint32_t *p = s + next;
            for (int64_t j = 0; j < take; j++) {
                uint32_t y = p[j];
                y ^= y >> 11;
                y ^= (y << 7) & 0x9D2C5680u;
                y ^= (y << 15) & 0xEFC60000u;
                y ^= y >> 18;
                o[i + j] = (float)(y & 0xFFFFFFu) * 0x1p-24f; /* exact: a 24-bit integer times 2**-24 */
            }
            i += take;
            next += (uint64_t)take;
            left -= (int32_t)take;
        }
    }
    for (int j = 0; j < MT_N; j++) words[j] = s[j];
    memcpy(state + MT_LEFT_AT, &left, 4);
    memcpy(state + MT_NEXT_AT, &next, 8);
    memcpy(state + MT_STATE_AT, words, sizeof words);
}

/* torch.stack([torch.rand(steps, width, generator=g) for g in generators], dim=1): generator r's
   draws fill out[i, r, :] (out [steps, R, width] contiguous), generators in parallel. */
void fp8rl_uniform_rows(uint8_t **states, int64_t R, int64_t steps, int64_t width, float *out, int threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && R > 1)
#endif
    for (int64_t r = 0; r < R; r++) mt_uniform(states[r], out + r * width, steps, width, R * width);
}

/* (a + b).argmax(-1) of FP32 rows a, b [R, V] (row strides la, lb), without the sum's tensor:
   the Gumbel-max sample of each row (a: its log-probabilities, b: its Gumbel noise). One FP32
   addition per element, as torch's add; torch's argmax order: the first maximum, a NaN above
   every number (the first NaN). 16 lanes each keep their first maximum; the lanes' winners are
   then compared value first, index second, so the first maximum of the row wins. */
static int64_t argmax_sum_row(const float *a, const float *b, int64_t V) {
    const int64_t V16 = V - V % 16;
    int64_t at = 0;
    float best = -INFINITY;
    int nan = 0;
    if (V16 > 0) {
        vf bestv = splat(-INFINITY);
        vi idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, lane = idx, nans = (vi){0};
        for (int64_t j = 0; j < V16; j += 16) {
            const vf v = loadu(a + j) + loadu(b + j);
            const vi more = (vi)(v > bestv);
            nans |= (vi)(v != v);
            bestv = select_vf(more, v, bestv);
            idx = (more & (lane + (int32_t)j)) | (~more & idx);
        }
        for (int l = 0; l < 16; l++) {
            nan |= nans[l] != 0;
            if (bestv[l] > best || (bestv[l] == best && idx[l] < at)) {
                best = bestv[l];
                at = idx[l];
            }
        }
    }
    for (int64_t j = V16; j < V && !nan; j++) { /* the tail: later indices, so a strict > keeps the first */
        const float v = a[j] + b[j];
        nan |= v != v;
        if (v > best) {
            best = v;
            at = j;
        }
    }
    if (nan) /* rare: the first NaN is the answer */
        for (int64_t j = 0; j < V; j++) {
            const float v = a[j] + b[j];
            if (v != v) return j;
        }
    return at;
}

void fp8rl_argmax_sum(const float *a, int64_t la, const float *b, int64_t lb, int64_t R, int64_t V,
                      int64_t *out, int threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && R > 1 && R * V >= 65536)
#endif
    for (int64_t r = 0; r < R; r++) out[r] = argmax_sum_row(a + r * la, b + r * lb, V);
}

/* transformer.py's RMSNorm of FP32 rows, in this loop's own fixed order, which every forward
   under a backend with `fused_pointwise` runs (a decode step and the training forward alike,
   so a row's bits do not depend on the batch or the phase): for each row r < rows of d elements,
   ss = the sum of x[j] * x[j] (each square rounded, then added: no FMA) in 16 lane sums over
   j in ascending order (lane j % 16; a partial last chunk adds zeros), the lanes then summed by
   a fixed halving tree; r = 1 / sqrt(ss / d + eps) (the square root correctly rounded, then
   the division rounded once; torch.rsqrt's root is not correctly rounded on every CPU); out[j] = w[j] * (x[j] * r); inv[r] = r where inv is given (the backward's).
   Row strides ldx, ldo in elements. */
void fp8rl_rmsnorm_rows(const float *x, int64_t ldx, const float *w, float eps, float *out, int64_t ldo,
                        float *inv_out, int64_t rows, int64_t d, int threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * d >= 32768)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * ldo;
        vf acc = splat(0.0f);
        int64_t j = 0;
        for (; j + LANES <= d; j += LANES) {
            const vf v = loadu(xr + j);
            acc = acc + v * v;
        }
        if (j < d) {
            float tail[LANES] = {0};
            memcpy(tail, xr + j, (size_t)(d - j) * sizeof(float));
            const vf v = loadu(tail);
            acc = acc + v * v;
        }
        const float inv = 1.0f / sqrtf(lanes_sum(acc) / (float)d + eps);
        if (inv_out) inv_out[r] = inv;
        for (int64_t k = 0; k < d; k++) o[k] = w[k] * (xr[k] * inv);
    }
}

/* The SwiGLU gate of FP32 rows, silu(g) * u, in this loop's own arithmetic (every forward
   under a backend with `fused_pointwise` runs it): e = exp(-|g|) (exp_nonpos_v, about 1 ulp),
   sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below (no overflow either side),
   out = (g * sigmoid(g)) * u. rows x n elements; row strides ldg, ldu, ldo. */
void fp8rl_silu_mul_rows(const float *g, int64_t ldg, const float *u, int64_t ldu, float *out, int64_t ldo,
                         int64_t rows, int64_t n, int threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * n >= 32768)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *gr = g + r * ldg, *ur = u + r * ldu;
        float *o = out + r * ldo;
        for (int64_t j = 0; j < n; j += LANES) {
            const int64_t m = n - j < LANES ? n - j : LANES;
            vf gv, uv;
            if (m == LANES) {
                gv = loadu(gr + j);
                uv = loadu(ur + j);
            } else {
                float gt[LANES] = {0}, ut[LANES] = {0};
                memcpy(gt, gr + j, (size_t)m * sizeof(float));
                memcpy(ut, ur + j, (size_t)m * sizeof(float));
                gv = loadu(gt);
                uv = loadu(ut);
            }
            const vi neg = gv < 0.0f;
            const vf e = exp_nonpos_v(select_vf(neg, gv, -gv));
            const vf sig = select_vf(neg, e / (1.0f + e), 1.0f / (1.0f + e));
            const vf y = (gv * sig) * uv;
            if (m == LANES) {
                storeu(o + j, y);
            } else {
                float yt[LANES];
                storeu(yt, y);
                memcpy(o + j, yt, (size_t)m * sizeof(float));
            }
        }
    }
}

/* One AdamW step of n FP32 elements in place (fp8rl/optim.py), in the operations of torch's
   single-tensor AdamW (torch.optim.AdamW on the CPU), each rounded once in FP32:
     p = p * decay                              (decay = 1 - lr * weight_decay)
     m = fma(c, g - m, m)  if |w| < 0.5, else fma(c, g - m, g)   (lerp_(g, w): c = w, or w - 1)
     v = fma(s2 * g, g, v * b2)                 (mul_(b2).addcmul_(g, g, value=s2))
     d = sqrt(v) / bc2s + eps                   (bc2s = sqrt(1 - b2**step))
     p = p + (neg_step * m) / d                 (addcdiv_(m, d, value=neg_step))
   The two fmas are the fused multiply-adds torch's vectorized lerp and addcmul make; the
   square root is correctly rounded (torch's vectorized one is not always, so the two differ
   in the last bit of a rare p). Every element takes the same operations whatever its
   position, so a shard of a tensor steps as the whole does (FSDP2). */
void fp8rl_adamw(float *restrict p, const float *restrict g, float *restrict m, float *restrict v, int64_t n,
                 float decay, float w, float b2, float s2, float bc2s, float eps, float neg_step, int threads) {
    (void)threads;
    const int small = fabsf(w) < 0.5f;
    const float c = small ? w : w - 1.0f;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n >= 65536)
#endif
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i], mi = m[i];
        const float mn = fmaf(c, gi - mi, small ? mi : gi);
        const float vn = fmaf(s2 * gi, gi, v[i] * b2);
        const float d = sqrtf(vn) / bc2s + eps;
        p[i] = p[i] * decay + (neg_step * mn) / d;
        m[i] = mn;
        v[i] = vn;
    }
}

/* Log-softmax of FP32 rows at given tokens, and its gradient (rollout/engine.py
   `token_logprobs` under a backend with `fused_pointwise`: the rollout's recorded log-probs
   and the training forward's both come from here, so they agree bit for bit, and no
   vocabulary-sized log-softmax is ever written). Row r (V elements x[j], temperature t):
     y[j]  = x[j] / t                     (x[j] itself where t == 1)
     m     = max_j y[j]                   (exact in any order; NaNs are skipped here and
                                           reach the sum below)
     s     = sum_j exp(y[j] - m)          (exp_nonpos_v; 16-lane chunks k of the row go to
                                           accumulator k % 4, a partial last chunk padded
                                           with -inf (exp 0); (a0 + a1) + (a2 + a3), then the
                                           lanes by a fixed halving tree)
     logp  = (y[target] - m) - log(s)     (torch's log_softmax's form: x - max - log(sum))
     entropy = log(s) - w / s,  w = sum_j exp(y[j] - m) * (y[j] - m)   (-sum p log p;
                                           a term with exp 0 counts 0: a -inf logit adds no NaN)
   The order is fixed by the code, not by the CPU's vector width: the same bits on every
   x86-64 CPU. stats[2r], stats[2r + 1] keep m and log(s) for the backward:
     grad[j] = g * (0 - p[j]) (g * (1 - p[target]) at the target), p[j] = exp((y[j] - m) - log(s)),
   then / t where t != 1 (the chain rule through y = x / t). */
static inline vf logit_chunk(const float *x, int64_t j, int64_t V, float t, int scaled) {
    vf y;
    if (j + LANES <= V) {
        y = loadu(x + j);
    } else {
        float tail[LANES];
        for (int l = 0; l < LANES; l++) tail[l] = j + l < V ? x[j + l] : -INFINITY;
        y = loadu(tail);
    }
    return scaled ? y / t : y;
}

static void logprob_row(const float *x, int64_t V, int64_t target, float t, float *logp, float *stats,
                        float *entropy) {
    const int scaled = t != 1.0f;
    vf mv = splat(-INFINITY);
    for (int64_t j = 0; j < V; j += LANES) {
        const vf y = logit_chunk(x, j, V, t, scaled);
        mv = select_vf((vi)(y > mv), y, mv);
    }
    const float m = lanes_max(mv);
    vf s[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
    vf w[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
    const vf mm = splat(m);
    int64_t k = 0;
    for (int64_t j = 0; j < V; j += LANES, k++) {
        const vf d = logit_chunk(x, j, V, t, scaled) - mm;
        const vf e = exp_nonpos_v(d);
        s[k % 4] = s[k % 4] + e;
        if (entropy) w[k % 4] = w[k % 4] + select_vf((vi)(e > 0.0f), e * d, splat(0.0f));
    }
    const float sum = lanes_sum((s[0] + s[1]) + (s[2] + s[3]));
    const float logs = logf(sum);
    const float yt = scaled ? x[target] / t : x[target];
    *logp = (yt - m) - logs;
    stats[0] = m;
    stats[1] = logs;
    if (entropy) *entropy = logs - lanes_sum((w[0] + w[1]) + (w[2] + w[3])) / sum;
}

void fp8rl_token_logprobs(const float *x, int64_t ldx, const int64_t *target, int64_t rows, int64_t V, float t,
                          float *logp, float *stats, float *entropy, int threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1 && rows * V >= 65536)
#endif
    for (int64_t r = 0; r < rows; r++)
        logprob_row(x + r * ldx, V, target[r], t, logp + r, stats + 2 * r, entropy ? entropy + r : NULL);
}

void fp8rl_token_logprobs_backward(const float *x, int64_t ldx, const int64_t *target, int64_t rows, int64_t V,
                                   float t, const float *stats, const float *grad_logp, float *grad, int64_t ldg,
                                   int threads) {
    (void)threads;
    const int scaled = t != 1.0f;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1 && rows * V >= 65536)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *gr = grad + r * ldg;
        const float g = grad_logp[r];
        const vf m = splat(stats[2 * r]), logs = splat(stats[2 * r + 1]), ng = splat(-g);
        for (int64_t j = 0; j < V; j += LANES) {
            const vf p = exp_nonpos_v((logit_chunk(xr, j, V, t, scaled) - m) - logs);
            vf gj = ng * p; /* g * (0 - p) == (-g) * p, exactly */
            if (scaled) gj = gj / t;
            if (j + LANES <= V) {
                storeu(gr + j, gj);
            } else {
                float out[LANES];
                storeu(out, gj);
                memcpy(gr + j, out, (size_t)(V - j) * sizeof(float));
            }
        }
        const int64_t at = target[r];
        const float yt = scaled ? xr[at] / t : xr[at];
        const float pt = exp_nonpos_v(splat((yt - stats[2 * r]) - stats[2 * r + 1]))[0];
        const float gt = g * (1.0f - pt);
        gr[at] = scaled ? gt / t : gt;
    }
}
