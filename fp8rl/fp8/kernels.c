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
            uint32_t amax_bits = 0;
            for (int64_t j = 0; j < n; j++) {
                const uint32_t a = f32_bits(xb[j]) & 0x7FFFFFFFu;
                amax_bits = a > amax_bits ? a : amax_bits;
            }
            if (amax_bits >= EXPONENT_BITS) return 1;
            const float amax = f32_from_bits(amax_bits);
            float s = (amax < amax_floor ? amax_floor : amax) / E4M3_MAX;
            if (ue8m0) { /* s is positive and normal: 2**ceil(log2(s)) from its bits */
                const uint32_t sb = f32_bits(s);
                s = f32_from_bits(((sb >> 23) + ((sb & 0x7FFFFFu) != 0)) << 23);
            }
            for (int64_t j = 0; j < n; j++) {
                float y = xb[j] / s;
                y = y < -E4M3_MAX ? -E4M3_MAX : (y > E4M3_MAX ? E4M3_MAX : y);
                uint32_t e = f32_bits(y) & EXPONENT_BITS;
                e = e < E4M3_MIN_NORMAL_EXP ? E4M3_MIN_NORMAL_EXP : e;
                const float magic = f32_from_bits(e + MAGIC_OFFSET);
                y = (y + magic) - magic;
                ob[j] = y * s;
            }
        }
    }
    return 0;
}
