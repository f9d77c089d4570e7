// River's own element-wise and one-token attention loops for the fused exit layer's two calls
// (river_int4.cpp's attention_in / attention_out), AVX2 + FMA (also in the AVX-512 build).
//
// They replace ATen's rms_norm sum, silu and scaled_dot_product_attention there: on one decode token those
// ops cost 10-50 us a call each in dispatch, allocation and thread start-up, for microseconds of arithmetic.
// They compute the same functions in fp32 but not in ATen's order (a sum of squares in 8 lanes, exp by a
// polynomial), so their results differ from ATen's in the last bits; the fused layer's build check bounds
// the difference against the architecture's exit copy (fused_layer.check_against_architecture, 1e-3).
#pragma once
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace river_ops {

inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(m);
}

// exp of 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial), within
// 2 ulp over [-87, 88]; inputs below -87.3 (and -inf) give 0, above 88.37 exp(88.37).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365f), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

inline float exp1(float x) {
  alignas(32) float v[8];
  _mm256_store_ps(v, exp8(_mm256_set1_ps(x)));
  return v[0];
}

// out[m, k] = silu(gate[m, k]) * up[m, k] = gate / (1 + exp(-gate)) * up for gu [M, 2K] = [gate | up]
inline void silu_mul_rows(const float* gu, int64_t M, int64_t K, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu + m * 2 * K;
    const float* u = g + K;
    float* o = out + m * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 gv = _mm256_loadu_ps(g + k);
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
      _mm256_storeu_ps(o + k, _mm256_mul_ps(s, _mm256_loadu_ps(u + k)));
    }
    for (; k < K; ++k) o[k] = g[k] / (1.0f + exp1(-g[k])) * u[k];
  }
}

// out[m] = x[m] * (1 / sqrt(mean(x[m]^2) + eps)) * weight, the mean's sum in 8 lanes
inline void rms_norm_rows(const float* x, int64_t M, int64_t K, const float* w, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_loadu_ps(xr + k);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; k < K; ++k) ss += xr[k] * xr[k];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
    const __m256 rv = _mm256_set1_ps(r);
    float* o = out + m * K;
    k = 0;
    for (; k + 8 <= K; k += 8)
      _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), rv), _mm256_loadu_ps(w + k)));
    for (; k < K; ++k) o[k] = xr[k] * r * w[k];
  }
}

// 8 dot products as one vector: lane j = sum of a[j]'s lanes
inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// What one key position adds to a query row's scores: a float mask (added, as SDPA adds it), a bool mask
// (false: the key is not attended), or none.
struct Mask {
  const float* add = nullptr;   // [L] of this batch row, or null
  const bool* keep = nullptr;   // [L] of this batch row, or null
};

// One query token per batch row, grouped-query attention over the cache slot:
// q [rep, d] (the rep query heads of one K/V head, rows qs apart), keys / values [L, d] (rows ks / vs apart,
// unit stride within a row) -> out [rep, d] (rows os apart) = softmax(scale * q k^T + mask) v, d % 8 == 0.
// A query row that attends to no key gets zeros.
inline void attend_group(const float* q, int64_t qs, int64_t rep, const float* keys, int64_t ks, const float* values,
                         int64_t vs, int64_t L, int64_t d, float scale, Mask mask, float* out, int64_t os) {
  thread_local std::vector<float> buf;
  const int64_t Lp = (L + 7) / 8 * 8;
  if (buf.size() < static_cast<size_t>(rep * Lp)) buf.resize(rep * Lp);
  float* scores = buf.data();
  const float ninf = -std::numeric_limits<float>::infinity();
  // scores: eight keys at a time for each query row (eight dot products summed across lanes together)
  for (int64_t r = 0; r < rep; ++r) {
    const float* qr = q + r * qs;
    float* sr = scores + r * Lp;
    int64_t l = 0;
    for (; l + 8 <= L; l += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + c);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + (l + j) * ks + c), acc[j]);
      }
      _mm256_storeu_ps(sr + l, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
    }
    for (; l < L; ++l) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + c), _mm256_loadu_ps(keys + l * ks + c), acc);
      sr[l] = hsum8(acc) * scale;
    }
    if (mask.add != nullptr)
      for (l = 0; l < L; ++l) sr[l] += mask.add[l];
    if (mask.keep != nullptr)
      for (l = 0; l < L; ++l)
        if (!mask.keep[l]) sr[l] = ninf;
    // softmax: exp(s - max), normalised at the end
    float mx = ninf;
    l = 0;
    if (L >= 8) {
      __m256 mv = _mm256_loadu_ps(sr);
      for (l = 8; l + 8 <= L; l += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + l));
      mx = hmax8(mv);
    }
    for (; l < L; ++l) mx = std::max(mx, sr[l]);
    float* o = out + r * os;
    if (mx == ninf) {  // no key attended
      for (int64_t c = 0; c < d; ++c) o[c] = 0.0f;
      for (l = 0; l < L; ++l) sr[l] = 0.0f;
      continue;
    }
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    float sum = 0.0f;
    l = 0;
    for (; l + 8 <= L; l += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + l), mxv));
      _mm256_storeu_ps(sr + l, p);
      sv = _mm256_add_ps(sv, p);
    }
    sum = hsum8(sv);
    for (; l < L; ++l) {
      sr[l] = exp1(sr[l] - mx);
      sum += sr[l];
    }
    const float inv = 1.0f / sum;
    for (l = 0; l < L; ++l) sr[l] *= inv;
  }
  // out[r] = sum_l p[r, l] v[l], 64 columns at a time in 8 registers
  for (int64_t r = 0; r < rep; ++r) {
    const float* pr = scores + r * Lp;
    float* o = out + r * os;
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      const int nv = static_cast<int>(std::min<int64_t>(64, d - c0) / 8);
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      if (nv == 8) {  // the usual head_dim (64, 128): the loop the compiler keeps in registers
        for (int64_t l = 0; l < L; ++l) {
          const __m256 p = _mm256_set1_ps(pr[l]);
          const float* vl = values + l * vs + c0;
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vl + 8 * j), acc[j]);
        }
      } else {
        for (int64_t l = 0; l < L; ++l) {
          const __m256 p = _mm256_set1_ps(pr[l]);
          const float* vl = values + l * vs + c0;
          for (int j = 0; j < nv; ++j) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vl + 8 * j), acc[j]);
        }
      }
      for (int j = 0; j < nv; ++j) _mm256_storeu_ps(o + c0 + 8 * j, acc[j]);
    }
  }
}

// torch.argmax of one row x [V] (V >= 1): the first index of the largest value, a NaN counting as larger than
// any number (so the first NaN's index). Eight lanes, each keeping its first largest value and its index
// (strictly greater replaces), then the lanes' largest with the smallest index, then the tail.
inline int64_t argmax_row(const float* x, int64_t V) {
  auto first_nan = [&]() -> int64_t {
    for (int64_t j = 0; j < V; ++j)
      if (x[j] != x[j]) return j;
    return -1;
  };
  int64_t best_i = 0;
  float best_v = x[0];
  int64_t i = 1;
  if (V >= 16) {
    __m256 best = _mm256_loadu_ps(x);
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), bidx = idx;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= V; i += 8) {
      idx = _mm256_add_epi32(idx, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, v, gt);
      bidx = _mm256_blendv_epi8(bidx, idx, _mm256_castps_si256(gt));
    }
    if (_mm256_movemask_ps(nan)) return first_nan();
    alignas(32) float bv[8];
    alignas(32) int32_t bi[8];
    _mm256_store_ps(bv, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi), bidx);
    best_v = bv[0];
    best_i = bi[0];
    for (int j = 1; j < 8; ++j)
      if (bv[j] > best_v || (bv[j] == best_v && bi[j] < best_i)) {
        best_v = bv[j];
        best_i = bi[j];
      }
  } else if (x[0] != x[0]) {
    return 0;
  }
  for (; i < V; ++i) {
    if (x[i] != x[i]) return first_nan();
    if (x[i] > best_v) {
      best_v = x[i];
      best_i = i;
    }
  }
  return best_i;
}

}  // namespace river_ops
