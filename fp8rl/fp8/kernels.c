/* Compiled CPU kernels of fp8rl (loaded by fp8rl/fp8/kernels.py through ctypes).

   Plain C, no torch headers, so that a build takes a fraction of a second.
   Every kernel computes exactly the IEEE-754 FP32 operations of the torch code
   it replaces, element by element, in the same order (quant.py), so its results
   are the same bits: no fast-math, no fused multiply-add (built with
   -ffp-contract=off), only vectorization of independent elements. */

#include <stdint.h>
#include <string.h>

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

/* quant.py's quantize_dequantize on FP32 rows: out[r, :] = the E4M3 1 x bk block
   quantization of x[r, :], dequantized, for rows r < rows of k elements
   (row strides ldx, ldo in elements; the last block of a row may be partial).
   Per block: amax = max |x| (a max over IEEE bits, which orders non-negative
   floats and puts NaN above Inf), s = max(amax, amax_floor) / 448 (ue8m0: rounded
   up to a power of two), y = clamp(x / s, -448, 448) rounded to the E4M3 grid by
   adding and subtracting 1.5 * 2**(e + 20) (e: y's exponent, at least -6),
   out = y * s. Returns 1 (nothing else defined) if x holds NaN or Inf, else 0. */
int fp8rl_qdq_rows(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, int64_t k,
                   int64_t bk, float amax_floor, int ue8m0) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *outr = out + r * ldo;
        for (int64_t c0 = 0; c0 < k; c0 += bk) {
            const int64_t n = k - c0 < bk ? k - c0 : bk;
            const float *xb = xr + c0;
            float *ob = outr + c0;
            const uint32_t amax_bits = amax_bits_of(xb, n, 0);
            if (amax_bits >= EXPONENT_BITS) return 1;
            const float s = block_scale(f32_from_bits(amax_bits), amax_floor, ue8m0);
            for (int64_t j = 0; j < n; j++) ob[j] = round_e4m3(xb[j] / s) * s;
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
   ceil(k/bk)] row-major. Returns 1 (nothing else defined) if x holds NaN or Inf. */
int fp8rl_quantize_blocks(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t bm, int64_t bk,
                          float amax_floor, int ue8m0, uint8_t *codes, float *scales) {
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
                uint8_t *cr = codes + r * k + c0;
                for (int64_t j = 0; j < n; j++) {
                    const float y = xr[j] / s;
                    const uint32_t yb = f32_bits(y); /* the sign of y: the cast's, also where it rounds to 0 */
                    const uint32_t v = f32_bits(round_e4m3(y)) & 0x7FFFFFFFu; /* |y| on the grid */
                    const uint32_t ve = v >> 23; /* biased exponent; 121 = 2**-6, the smallest normal */
                    const uint32_t mag = v == 0 ? 0
                                         : ve >= 121u ? ((ve - 120u) << 3) | ((v >> 20) & 7u)
                                                      : (uint32_t)(f32_from_bits(v) * 512.0f); /* subnormal: v / 2**-9 */
                    cr[j] = (uint8_t)(((yb >> 24) & 0x80u) | mag);
                }
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
                    const uint32_t u = f32_bits(table[cr[c0 + j]] * s);
                    o[j] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                }
            } else {
                float *o = (float *)out + r * k + c0;
                for (int64_t j = 0; j < n; j++) o[j] = table[cr[c0 + j]] * s;
            }
        }
    }
}
