// river-int4: 4-bit weight-only products with int8 activations, on AVX-512 VNNI (vpdpbusd) or AVX2
// (vpmaddubsw + vpmaddwd), chosen at compile time (river_int4.py builds one library per instruction set).
//
// Weights: asymmetric 4-bit groups of G input channels, w ~= (q - 8) * scale + zero with q in [0, 15] (the
// grid and layout of torch-int4's tinygemm, quant/modules.py), scale and zero stored as fp16 (as llama.cpp
// stores its block scales). Activations: each row quantized per group of G to int8, symmetric
// (x ~= xs * qx, xs = max|x| / 127), with the exact fp32 sum of the group kept for the zero term and the
// integer sum of qx for the centring:
//   sum_k w_k x_k  ~=  scale * xs * (sum_k q_k qx_k - 8 sum_k qx_k)  +  zero * sum_k x_k.
// The integer dot products multiply unsigned by signed bytes (vpdpbusd; on AVX2 vpmaddubsw, whose int16
// pair sums cannot saturate here: 2 * 15 * 127 = 3810): the weights' nibbles q go in as they are
// (unsigned), the activations qx as signed; the centring by 8 is exact integer arithmetic on the row's own
// sum, so no per-weight correction is stored or read. Both instruction sets compute the same integers and
// the same fp32 operations lane by lane (the AVX2 path keeps the 16 lanes as two 8-lane halves and sums a
// group in AVX-512's reduction order), so they give the same numbers bit for bit.
//
// Packed layout (river_int4_pack): output channels in blocks of 16; each block is one contiguous stream of
// its K / G groups, and each group is G / 8 steps of 64 bytes (16 lanes x 4 bytes: byte b of lane j holds
// q[n0 + j][k + b] in its low nibble and q[n0 + j][k + 4 + b] in its high nibble) followed by the group's 16
// scales and 16 zeros (fp16, 64 bytes): G * 8 + 64 bytes a group, 6 % over the 4-bit weights at G = 128,
// all read as one sequential stream per block.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "layer_ops.h"

namespace {

// The product clock (read by river_hf.bench_harness.step_profile): when on, the wall time of every weight
// product (the activations' int8 quantization and the blocks' dot products, from the calling thread) is
// added up, so a profile can split a fused exit layer's two calls into products and the rest.
std::atomic<bool> g_clock_on{false};
std::atomic<int64_t> g_product_ns{0};

struct ProductTimer {
  const bool on = g_clock_on.load(std::memory_order_relaxed);
  const std::chrono::steady_clock::time_point start = on ? std::chrono::steady_clock::now()
                                                         : std::chrono::steady_clock::time_point{};
  ~ProductTimer() {
    if (on)
      g_product_ns.fetch_add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
          std::memory_order_relaxed);
  }
};

void set_product_clock(bool on) { g_clock_on.store(on); }
int64_t product_ns() { return g_product_ns.load(); }

constexpr int kLanes = 16;

inline int64_t group_bytes(int64_t G) { return G * 8 + 64; }

// q: int32 [N, K] in [0, 15]; scales, zeros: fp16 [N, K / G] -> uint8 [N / 16, K / G, G * 8 + 64]
torch::Tensor pack(torch::Tensor q, torch::Tensor scales, torch::Tensor zeros, int64_t G) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt32, "river_int4_pack: q must be int32 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % kLanes == 0 && G % 16 == 0 && K % G == 0, "river_int4_pack: N % 16, G % 16 and K % G must be 0");
  const int64_t groups = K / G;
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && zeros.scalar_type() == torch::kHalf &&
                  scales.numel() == N * groups && zeros.numel() == N * groups,
              "river_int4_pack: scales and zeros must be fp16 [N, K / G]");
  auto qc = q.contiguous();
  auto sc = scales.contiguous(), zc = zeros.contiguous();
  const int64_t gb = group_bytes(G);
  auto out = torch::empty({N / kLanes, groups, gb}, torch::kUInt8);
  const int32_t* src = qc.data_ptr<int32_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zc.data_ptr<at::Half>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t nb = 0; nb < N / kLanes; ++nb)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* grp = dst + (nb * groups + g) * gb;
      for (int64_t s = 0; s < G / 8; ++s)
        for (int j = 0; j < kLanes; ++j)
          for (int b = 0; b < 4; ++b) {
            const int32_t* row = src + (nb * kLanes + j) * K + g * G + s * 8;
            const uint8_t lo = static_cast<uint8_t>(row[b] & 15), hi = static_cast<uint8_t>(row[4 + b] & 15);
            grp[(s * kLanes + j) * 4 + b] = static_cast<uint8_t>(lo | (hi << 4));
          }
      uint16_t* meta = reinterpret_cast<uint16_t*>(grp + G * 8);
      for (int j = 0; j < kLanes; ++j) {
        meta[j] = sp[(nb * kLanes + j) * groups + g];
        meta[kLanes + j] = zp[(nb * kLanes + j) * groups + g];
      }
    }
  return out;
}

// x: float [M, K] -> qx int8 [M, K], xs float [M, K / G], xsum float [M, K / G], qsum int32 [M, K / G]
#if defined(__AVX512VNNI__)
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int8_t* qx, float* xs, float* xsum,
                   int32_t* qsum) {
  const int64_t groups = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * K + g * G;
      __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
      for (int64_t k = 0; k < G; k += 16) {
        __m512 v = _mm512_loadu_ps(xg + k);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        vsum = _mm512_add_ps(vsum, v);
      }
      const float amax = _mm512_reduce_max_ps(vmax);
      const float scale = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      xs[m * groups + g] = scale;
      xsum[m * groups + g] = _mm512_reduce_add_ps(vsum);
      const __m512 vinv = _mm512_set1_ps(inv);
      int8_t* qg = qx + m * K + g * G;
      __m512i isum = _mm512_setzero_si512();
      for (int64_t k = 0; k < G; k += 16) {
        __m512i r = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + k), vinv),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        r = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        isum = _mm512_add_epi32(isum, r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + k), _mm512_cvtsepi32_epi8(r));
      }
      qsum[m * groups + g] = _mm512_reduce_add_epi32(isum);
    }
}

#else
// AVX2: the 16 lanes of the AVX-512 loop as two 8-lane halves, the group's sum reduced in the order of
// _mm512_reduce_add_ps (halves, then 128-bit halves, then pairs), so xsum is the same float
inline float reduce_add16(__m256 a, __m256 b) {
  const __m256 t3 = _mm256_add_ps(b, a);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m128 t10 = _mm_add_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(t10);
}

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int8_t* qx, float* xs, float* xsum,
                   int32_t* qsum) {
  const int64_t groups = K / G;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * K + g * G;
      __m256 vmax = _mm256_setzero_ps(), sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
      for (int64_t k = 0; k < G; k += 16) {
        const __m256 a = _mm256_loadu_ps(xg + k), b = _mm256_loadu_ps(xg + k + 8);
        vmax = _mm256_max_ps(vmax, _mm256_max_ps(_mm256_and_ps(a, absmask), _mm256_and_ps(b, absmask)));
        sum_lo = _mm256_add_ps(sum_lo, a);
        sum_hi = _mm256_add_ps(sum_hi, b);
      }
      const float amax = river_ops::hmax8(vmax);
      const float scale = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      xs[m * groups + g] = scale;
      xsum[m * groups + g] = reduce_add16(sum_lo, sum_hi);
      const __m256 vinv = _mm256_set1_ps(inv);
      int8_t* qg = qx + m * K + g * G;
      __m256i isum = _mm256_setzero_si256();
      for (int64_t k = 0; k < G; k += 8) {
        __m256i r = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + k), vinv),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        r = _mm256_max_epi32(_mm256_min_epi32(r, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        isum = _mm256_add_epi32(isum, r);
        const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(r, r), 0x08);  // 8 int16 in the low half
        _mm_storel_epi64(reinterpret_cast<__m128i*>(qg + k),
                         _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_castsi256_si128(p16)));
      }
      __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(isum, 1), _mm256_castsi256_si128(isum));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      qsum[m * groups + g] = _mm_cvtsi128_si32(s4);
    }
}
#endif

// torch.nn.functional.rms_norm of each row of x [M, K] (float, contiguous) with weight [K]:
// x * (1 / sqrt(mean(x * x) + eps)) * weight (river_ops::rms_norm_rows: the sum of squares in 8 lanes, not
// ATen's order, so the last bit may differ from torch's)
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.numel() == K && weight.scalar_type() == torch::kFloat, "river_int4: the norm weight must be float [K]");
  auto wc = weight.contiguous();
  auto out = torch::empty({M, K}, torch::kFloat);
  river_ops::rms_norm_rows(x.data_ptr<float>(), M, K, wc.data_ptr<float>(), static_cast<float>(eps),
                           out.data_ptr<float>());
  return out;
}

// y [M, N] float = x [M, K] (float or bfloat16) times the packed weights, plus bias [N] if given.
constexpr int64_t kRows = 4;

struct Block {  // one block of 16 output channels: its groups' weights, scales and zeros in one stream
  const uint8_t* w;
  const float* bias;
  int64_t groups, G;
};

struct Rows {  // up to kRows activation rows and where their 16 outputs go
  const int8_t* qx;
  const float* xs;
  const float* xsum;
  const int32_t* qsum;
  const float* residual;  // [M, N] or null: added to the output as it is stored
  float* y;
  int64_t K, groups, N;
};

#if defined(__AVX512VNNI__)
// R rows of one block: each 64-byte weight load is unpacked once and used for every row
template <int R>
inline void block_rows(const Block& blk, const Rows& r) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = blk.bias ? _mm512_loadu_ps(blk.bias) : _mm512_setzero_ps();
  const int64_t steps = blk.G / 8, gb = group_bytes(blk.G);
  for (int64_t g = 0; g < blk.groups; ++g) {
    // one row: two dependency chains (low and high nibbles), two steps per iteration, else vpdpbusd's
    // latency bounds the call; several rows: one chain per row (the rows are the independent chains)
    __m512i lo[R], hi[R];
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
    const uint8_t* wg = blk.w + g * gb;
    const int64_t unroll = R == 1 ? 2 : 1;
    for (int64_t s = 0; s < steps; s += unroll) {
      for (int64_t u = 0; u < unroll; ++u) {
        const __m512i v = _mm512_loadu_si512(wg + (s + u) * 64);
        const __m512i w0 = _mm512_and_si512(v, mask);
        const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        for (int i = 0; i < R; ++i) {
          const int8_t* xg = r.qx + i * r.K + g * blk.G + (s + u) * 8;
          int32_t a0, a1;
          std::memcpy(&a0, xg, 4);
          std::memcpy(&a1, xg + 4, 4);
          if (R == 1) {
            lo[i] = _mm512_dpbusd_epi32(lo[i], w0, _mm512_set1_epi32(a0));
            hi[i] = _mm512_dpbusd_epi32(hi[i], w1, _mm512_set1_epi32(a1));
          } else {
            lo[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo[i], w0, _mm512_set1_epi32(a0)), w1, _mm512_set1_epi32(a1));
          }
        }
      }
    }
    const uint8_t* meta = wg + steps * 64;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta)));
    const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32)));
    for (int i = 0; i < R; ++i) {
      const int64_t at = i * r.groups + g;
      const __m512i centred = _mm512_sub_epi32(_mm512_add_epi32(lo[i], hi[i]), _mm512_set1_epi32(8 * r.qsum[at]));
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(r.xs[at])), _mm512_cvtepi32_ps(centred), acc[i]);
      acc[i] = _mm512_fmadd_ps(zero, _mm512_set1_ps(r.xsum[at]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i)  // residual + product, the architecture's order (one fp32 add, as at::add)
    _mm512_storeu_ps(r.y + i * r.N, r.residual ? _mm512_add_ps(_mm512_loadu_ps(r.residual + i * r.N), acc[i]) : acc[i]);
}

#else
// R rows of one block (AVX2): the 16 lanes as two 8-lane halves, one after the other. Each 32-byte half-step
// of weights is unpacked once and used for every row; the byte products' int16 pair sums (at most 3810 each, vpmaddubsw) are added up
// over up to kChunk steps in int16 (at most 7 620 a step for a low and a high nibble: 4 steps stay below
// 32 767), then widened to int32 by vpmaddwd: the same integers as vpdpbusd's.
constexpr int64_t kChunk = 4;
// Software prefetch of the weight stream, in bytes ahead: each 64-byte step fetches the line this far ahead
// (into the next group, or the next block: a thread's blocks are one contiguous stream), non-temporal
// (the weights are read once a step, so they should not push the activations, the KV cache and the code of
// the ops between products out of L2). With the hardware prefetcher alone a one-row product read at about
// half of STREAM triad on an AVX2 EPYC; 2048 bytes ahead made the exit shapes' one-row calls 1.2-1.4x
// faster there (1024 and 4096 within noise of it), and the non-temporal hint made 24 fused exit layers of
// Qwen2.5-Coder-0.5B another ~8 % faster than a T0 prefetch (benchmarks/probes/int4_rows.py and a decode
// step). Prefetching changes no arithmetic.
constexpr int64_t kPrefetch = 2048;

// Half h (lanes 8h .. 8h + 7) of R rows of one group: its dot products (int32, 8 lanes), each row's
// activations broadcast 4 bytes at a time. One half at a time keeps R rows' accumulators in the 16 ymm
// registers (the group's bytes stay in L1 for the second half).
template <int R>
inline void group_half(const uint8_t* wg, int64_t steps, int h, const int8_t* const* xg, __m256i* dot) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int i = 0; i < R; ++i) dot[i] = _mm256_setzero_si256();
  for (int64_t s0 = 0; s0 < steps; s0 += kChunk) {
    const int64_t s1 = std::min(steps, s0 + kChunk);
    __m256i part[R];
    for (int i = 0; i < R; ++i) part[i] = _mm256_setzero_si256();
    for (int64_t s = s0; s < s1; ++s) {
      if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(wg + s * 64 + kPrefetch), _MM_HINT_NTA);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + s * 64 + 32 * h));
      const __m256i w0 = _mm256_and_si256(v, mask), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      for (int i = 0; i < R; ++i) {
        int32_t a0, a1;
        std::memcpy(&a0, xg[i] + s * 8, 4);
        std::memcpy(&a1, xg[i] + s * 8 + 4, 4);
        part[i] = _mm256_add_epi16(part[i], _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(a0)),
                                                            _mm256_maddubs_epi16(w1, _mm256_set1_epi32(a1))));
      }
    }
    for (int i = 0; i < R; ++i) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(part[i], ones));
  }
}

template <int R>
inline void block_rows(const Block& blk, const Rows& r) {
  const int64_t steps = blk.G / 8, gb = group_bytes(blk.G);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = blk.bias ? _mm256_loadu_ps(blk.bias + 8 * h) : _mm256_setzero_ps();
    for (int64_t g = 0; g < blk.groups; ++g) {
      const uint8_t* wg = blk.w + g * gb;
      const int8_t* xg[R];
      for (int i = 0; i < R; ++i) xg[i] = r.qx + i * r.K + g * blk.G;
      __m256i dot[R];
      group_half<R>(wg, steps, h, xg, dot);
      const uint8_t* meta = wg + steps * 64;
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * h)));
      const __m256 zero = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 32 + 16 * h)));
      for (int i = 0; i < R; ++i) {
        const int64_t at = i * r.groups + g;
        const __m256i centred = _mm256_sub_epi32(dot[i], _mm256_set1_epi32(8 * r.qsum[at]));
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(r.xs[at])), _mm256_cvtepi32_ps(centred), acc[i]);
        acc[i] = _mm256_fmadd_ps(zero, _mm256_set1_ps(r.xsum[at]), acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) {  // residual + product, the architecture's order (one fp32 add, as at::add)
      float* y = r.y + i * r.N + 8 * h;
      _mm256_storeu_ps(y, r.residual ? _mm256_add_ps(_mm256_loadu_ps(r.residual + i * r.N + 8 * h), acc[i]) : acc[i]);
    }
  }
}

// One row (the decode step's product, AVX2): both 8-lane halves in one pass, so each step's two 4-byte
// activation broadcasts serve all 16 lanes and each 64-byte step is read once. The same integers (int16
// pair sums over up to kChunk steps, widened by vpmaddwd) and the same fp32 operations per lane, in the
// same order, as block_rows<R>: the same numbers bit for bit.
template <>
inline void block_rows<1>(const Block& blk, const Rows& r) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t steps = blk.G / 8, gb = group_bytes(blk.G);
  __m256 acc0 = blk.bias ? _mm256_loadu_ps(blk.bias) : _mm256_setzero_ps();
  __m256 acc1 = blk.bias ? _mm256_loadu_ps(blk.bias + 8) : _mm256_setzero_ps();
  for (int64_t g = 0; g < blk.groups; ++g) {
    const uint8_t* wg = blk.w + g * gb;
    const int8_t* xg = r.qx + g * blk.G;
    __m256i dot0 = _mm256_setzero_si256(), dot1 = _mm256_setzero_si256();
    for (int64_t s0 = 0; s0 < steps; s0 += kChunk) {
      const int64_t s1 = std::min(steps, s0 + kChunk);
      __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
      for (int64_t s = s0; s < s1; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(wg + s * 64 + kPrefetch), _MM_HINT_NTA);
        int32_t b0, b1;
        std::memcpy(&b0, xg + s * 8, 4);
        std::memcpy(&b1, xg + s * 8 + 4, 4);
        const __m256i a0 = _mm256_set1_epi32(b0), a1 = _mm256_set1_epi32(b1);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + s * 64));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + s * 64 + 32));
        p0 = _mm256_add_epi16(p0, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v0, mask), a0),
                                                   _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), mask), a1)));
        p1 = _mm256_add_epi16(p1, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v1, mask), a0),
                                                   _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), mask), a1)));
      }
      dot0 = _mm256_add_epi32(dot0, _mm256_madd_epi16(p0, ones));
      dot1 = _mm256_add_epi32(dot1, _mm256_madd_epi16(p1, ones));
    }
    const uint8_t* meta = wg + steps * 64;
    const __m256 xs = _mm256_set1_ps(r.xs[g]), xsum = _mm256_set1_ps(r.xsum[g]);
    const __m256i q8 = _mm256_set1_epi32(8 * r.qsum[g]);
    const __m256 scale0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta)));
    const __m256 scale1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16)));
    const __m256 zero0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 32)));
    const __m256 zero1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 48)));
    acc0 = _mm256_fmadd_ps(_mm256_mul_ps(scale0, xs), _mm256_cvtepi32_ps(_mm256_sub_epi32(dot0, q8)), acc0);
    acc0 = _mm256_fmadd_ps(zero0, xsum, acc0);
    acc1 = _mm256_fmadd_ps(_mm256_mul_ps(scale1, xs), _mm256_cvtepi32_ps(_mm256_sub_epi32(dot1, q8)), acc1);
    acc1 = _mm256_fmadd_ps(zero1, xsum, acc1);
  }
  float* y = r.y;
  _mm256_storeu_ps(y, r.residual ? _mm256_add_ps(_mm256_loadu_ps(r.residual), acc0) : acc0);
  _mm256_storeu_ps(y + 8, r.residual ? _mm256_add_ps(_mm256_loadu_ps(r.residual + 8), acc1) : acc1);
}
#endif

// y [M, N] = x [M, K] (float, contiguous) times the packed weights (plus bias [N] and residual [M, N] when
// not null), K = packed.size(1) * G: the activations' int8 quantization and the blocks' dot products, timed
// by the product clock. What mm and the exit stack's rows both call, so they compute the same numbers.
void product_rows(const float* x, int64_t M, const torch::Tensor& packed, const float* b, int64_t G,
                  const float* resp, float* yp) {
  const int64_t NB = packed.size(0), groups = packed.size(1), K = groups * G, N = NB * kLanes;
  ProductTimer timer;  // from here to the return: the product
  // the quantized activations in this thread's scratch buffers (reused from call to call: no allocations)
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> xs, xsum;
  thread_local std::vector<int32_t> qsum;
  if (qx.size() < static_cast<size_t>(M * K)) qx.resize(M * K);
  if (xs.size() < static_cast<size_t>(M * groups)) {
    xs.resize(M * groups);
    xsum.resize(M * groups);
    qsum.resize(M * groups);
  }
  quantize_rows(x, M, K, G, qx.data(), xs.data(), xsum.data(), qsum.data());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* qxp = qx.data();
  const float* xsp = xs.data();
  const float* xsump = xsum.data();
  const int32_t* qsump = qsum.data();
  const int64_t block_bytes = groups * group_bytes(G);
  // one weight stream per block; a few blocks per task keep the two threads' streams long
  at::parallel_for(0, NB, 4, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t m = 0; m < M; m += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
        const Block blk{w + nb * block_bytes, b ? b + nb * kLanes : nullptr, groups, G};
        const Rows r{qxp + m * K, xsp + m * groups, xsump + m * groups, qsump + m * groups,
                     resp ? resp + m * N + nb * kLanes : nullptr, yp + m * N + nb * kLanes, K, groups, N};
        switch (rows) {
          case 1: block_rows<1>(blk, r); break;
          case 2: block_rows<2>(blk, r); break;
          case 3: block_rows<3>(blk, r); break;
          default: block_rows<4>(blk, r); break;
        }
      }
  });
}

// packed: uint8 [N / 16, K / G, G * 8 + 64] (river_int4_pack); bias float [N] or none.
// With ``silu_mul``: x is [M, 2K] = [gate | up] and the product's input is silu(gate) * up; with ``norm``
// (float [K]): the input is RMS-normalized first (eps ``eps``, rms_norm_rows); with ``residual`` (float
// [M, N]): it is added to the output as it is stored. silu and the norm are River's own loops
// (layer_ops.h): the functions torch computes, up to float rounding order.
torch::Tensor mm(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t group,
                 c10::optional<torch::Tensor> norm, double eps, bool silu_mul, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2, "river_int4_mm: x must be [M, K]");
  const int64_t G = group, NB = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == group_bytes(G) && G % 16 == 0,
              "river_int4_mm: packed must be [N / 16, K / G, G * 8 + 64]");
  const int64_t M = x.size(0), K = groups * G, N = NB * kLanes;
  TORCH_CHECK(x.size(1) == (silu_mul ? 2 * K : K), "river_int4_mm: shapes do not match");
  torch::Tensor xf = x.scalar_type() == torch::kFloat ? x : x.to(torch::kFloat);
  if (silu_mul) {  // silu(gate) * up
    xf = xf.contiguous();
    auto act = torch::empty({M, K}, torch::kFloat);
    river_ops::silu_mul_rows(xf.data_ptr<float>(), M, K, act.data_ptr<float>());
    xf = act;
  }
  xf = xf.contiguous();
  if (norm.has_value()) xf = rms_norm_rows(xf, *norm, eps);
  c10::optional<torch::Tensor> res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->numel() == M * N && residual->scalar_type() == torch::kFloat,
                "river_int4_mm: the residual must be float [M, out_features]");
    res = residual->contiguous();
  }
  auto y = torch::empty({M, N}, torch::kFloat);
  product_rows(xf.data_ptr<float>(), M, packed, bias.has_value() ? bias->data_ptr<float>() : nullptr, G,
               res.has_value() ? res->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

// The Llama / Qwen2 / Mistral fused exit layer (river/fused_llama.py) in two calls around the KV cache's
// update (which stays the cache object's own, in Python): ``attention_in`` is the input norm, the stacked
// q/k/v product and rotary on q and k; ``attention_out`` is SDPA over the updated cache, the o product with
// the residual, the second norm, the stacked gate/up product, silu(gate) * up and the down product with the
// residual. Rotary and the residual adds are loops doing the fp32 operations of the Python path in its
// order; the norms, silu and, for one query token, attention are River's own loops (layer_ops.h), which
// compute the same functions up to float rounding order (the fused layer's build check bounds the result
// against the architecture's exit copy); attention over more tokens is ATen's SDPA.

// x [rows, hidden] float; cos, sin [batch or 1, tokens, d] float, the model's rotary tables as its rotary
// module returns them -> query [batch, heads, tokens, d], keys [batch, kv, tokens, d] (rotary applied),
// values [batch, kv, tokens, d] (views)
std::vector<torch::Tensor> attention_in(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                        int64_t group, torch::Tensor norm, double eps, torch::Tensor cos,
                                        torch::Tensor sin, int64_t batch, int64_t tokens, int64_t heads, int64_t kv,
                                        int64_t d) {
  const int64_t width = heads + 2 * kv, rot = heads + kv, half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
                  cos.sizes() == sin.sizes() && cos.dim() == 3 && (cos.size(0) == 1 || cos.size(0) == batch) &&
                  cos.size(1) == tokens && cos.size(2) == d,
              "river_int4 attention_in: cos / sin must be float [batch or 1, tokens, head_dim]");
  auto y = mm(x, packed, bias, group, norm, eps, false, c10::nullopt);  // [batch * tokens, width * d]
  auto c = cos.contiguous(), s = sin.contiguous();
  // rotary: q * cos + rotate_half(q) * sin with rotate_half(q) = cat(-q[half:], q[:half]): a multiply, a
  // multiply and an add in fp32 (built with -ffp-contract=off, so not a fused multiply-add), as the Python
  // ops compute it; the first half's a + (-b) * s is written a - b * s, the same float (negation is exact)
  auto qk = torch::empty({batch, rot, tokens, d}, torch::kFloat);
  const float* yp = y.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* qp = qk.data_ptr<float>();
  const int64_t cb = c.size(0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < rot; ++j)
      for (int64_t t = 0; t < tokens; ++t) {
        const float* src = yp + ((b * tokens + t) * width + j) * d;
        const float* ct = cp + ((cb == 1 ? 0 : b) * tokens + t) * d;
        const float* st = sp + ((cb == 1 ? 0 : b) * tokens + t) * d;
        float* dst = qp + ((b * rot + j) * tokens + t) * d;
        for (int64_t i = 0; i < half; ++i) dst[i] = src[i] * ct[i] - src[i + half] * st[i];
        for (int64_t i = half; i < d; ++i) dst[i] = src[i] * ct[i] + src[i - half] * st[i];
      }
  auto values = y.view({batch, tokens, width, d}).transpose(1, 2).narrow(1, rot, kv);
  return {qk.narrow(1, 0, heads), qk.narrow(1, heads, kv), values};
}

// The one-token mask as attend_one_token and the exit stack take it: undefined (none), or float (added) or
// bool (true: attended) [batch or 1, 1, 1, L], contiguous along L.
torch::Tensor one_token_mask(const c10::optional<torch::Tensor>& mask, int64_t batch, int64_t L) {
  if (!mask.has_value() || !mask->defined()) return torch::Tensor();
  torch::Tensor m = mask->stride(3) == 1 ? *mask : mask->contiguous();
  TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == batch) && m.size(1) == 1 && m.size(2) == 1 &&
                  m.size(3) == L && (m.scalar_type() == torch::kFloat || m.scalar_type() == torch::kBool),
              "river_int4 attention_out: the one-token mask must be float or bool [batch or 1, 1, 1, L]");
  return m;
}

// One query token per batch row, every K/V head's group of heads / kv query heads (river_ops::attend_group),
// the (batch, K/V head) pairs over both threads. Query head h of row b at q + b * qb + h * qh; keys and values
// of row b, K/V head g, position t at k + b * kb + g * kh + t * ks (v likewise); output head h of row b at
// out + b * ob + h * d. m: one_token_mask's. Pointers, not tensors: a caller's thread_local scratch rows named
// inside the task would be the worker thread's own.
void attend_rows(const float* q, int64_t qb, int64_t qh, int64_t batch, int64_t heads, int64_t kv, const float* k,
                 int64_t kb, int64_t kh, int64_t ks, const float* v, int64_t vb, int64_t vh, int64_t vs, int64_t L,
                 int64_t d, float scale, const torch::Tensor& m, float* out, int64_t ob) {
  const int64_t rep = heads / kv;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rep * L * d));
  at::parallel_for(0, batch * kv, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv, g = i % kv;
      river_ops::Mask mk;
      if (m.defined()) {
        const int64_t off = (m.size(0) == 1 ? 0 : b) * m.stride(0);
        if (m.scalar_type() == torch::kBool) mk.keep = m.data_ptr<bool>() + off;
        else mk.add = m.data_ptr<float>() + off;
      }
      river_ops::attend_group(q + b * qb + g * rep * qh, qh, rep, k + b * kb + g * kh, ks, v + b * vb + g * vh, vs,
                              L, d, scale, mk, out + b * ob + g * rep * d, d);
    }
  });
}

// One query token per batch row: query [batch, heads, 1, d] (unit stride in d), keys / values
// [batch, kv, L, d] (the cache slot), mask none or [batch or 1, 1, 1, L] float (added) or bool (true:
// attended) -> [batch, heads * d] = softmax(scale * q k^T + mask) v per head, query head h reading K/V head
// h / (heads / kv). River's own loop (river_ops::attend_group), split by (batch row, K/V head) between
// threads when there is enough work.
torch::Tensor attend_one_token(const torch::Tensor& query, torch::Tensor keys, torch::Tensor values,
                               const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4, "river_int4 attention_out: query and keys must be 4-D");
  const int64_t batch = query.size(0), heads = query.size(1), d = query.size(3);
  const int64_t kv = keys.size(1), L = keys.size(2);
  TORCH_CHECK(query.size(2) == 1 && query.stride(3) == 1 && d % 8 == 0 && kv > 0 &&
                  heads % kv == 0 && keys.dim() == 4 && keys.size(0) == batch && keys.size(3) == d &&
                  values.sizes() == keys.sizes() && query.scalar_type() == torch::kFloat &&
                  keys.scalar_type() == torch::kFloat && values.scalar_type() == torch::kFloat,
              "river_int4 attention_out: one-token attention needs float query [batch, heads, 1, d % 8 == 0] "
              "and keys / values [batch, kv, L, d]");
  if (keys.stride(3) != 1) keys = keys.contiguous();
  if (values.stride(3) != 1) values = values.contiguous();
  const torch::Tensor m = one_token_mask(mask, batch, L);
  auto out = torch::empty({batch, heads * d}, torch::kFloat);
  attend_rows(query.data_ptr<float>(), query.stride(0), query.stride(1), batch, heads, kv, keys.data_ptr<float>(),
              keys.stride(0), keys.stride(1), keys.stride(2), values.data_ptr<float>(), values.stride(0),
              values.stride(1), values.stride(2), L, d, static_cast<float>(scale), m, out.data_ptr<float>(), heads * d);
  return out;
}

// attn [rows, heads * d], residual [rows, hidden] (the layer's input) -> h + down(silu(gate) * up) with
// h = residual + o(attn) and gate | up = gu(norm(h)): the layer after attention, three river-int4 products.
torch::Tensor layer_tail(const torch::Tensor& attn, const torch::Tensor& residual, const torch::Tensor& o_packed,
                         const c10::optional<torch::Tensor>& o_bias, int64_t o_group, const torch::Tensor& gu_packed,
                         const c10::optional<torch::Tensor>& gu_bias, int64_t gu_group, const torch::Tensor& norm,
                         double eps, const torch::Tensor& down_packed, const c10::optional<torch::Tensor>& down_bias,
                         int64_t down_group) {
  auto h = mm(attn, o_packed, o_bias, o_group, c10::nullopt, 0.0, false, residual);
  auto gu = mm(h, gu_packed, gu_bias, gu_group, norm, eps, false, c10::nullopt);
  return mm(gu, down_packed, down_bias, down_group, c10::nullopt, 0.0, true, h);
}

// query [batch, heads, tokens, d] (or, for one token, [batch, kv, heads / kv, d]: transformers' packed
// form), keys / values [batch, kv or heads, length, d], mask (additive or boolean, SDPA's broadcasting) or
// none, residual [rows, hidden] (the layer's input) -> [rows, hidden]. With ``one_token`` (one query token
// per row, query [batch, heads, 1, d] and the cache slot as it is): River's own attention
// (attend_one_token) instead of ATen's SDPA.
torch::Tensor attention_out(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                            c10::optional<torch::Tensor> mask, bool causal, double scale, bool gqa, bool one_token,
                            torch::Tensor residual, torch::Tensor o_packed, c10::optional<torch::Tensor> o_bias,
                            int64_t o_group, torch::Tensor gu_packed, c10::optional<torch::Tensor> gu_bias,
                            int64_t gu_group, torch::Tensor norm, double eps, torch::Tensor down_packed,
                            c10::optional<torch::Tensor> down_bias, int64_t down_group) {
  const int64_t rows = residual.size(0);
  torch::Tensor attn;
  if (one_token) {
    attn = attend_one_token(query, keys, values, mask, scale);
  } else {
    attn = at::scaled_dot_product_attention(query, keys, values, mask, 0.0, causal, scale, gqa);
    // [batch, heads, tokens, d] in head order (also when the query heads came packed per K/V head)
    const int64_t batch = query.size(0), d = query.size(3);
    attn = attn.reshape({batch, -1, rows / batch, d}).transpose(1, 2).reshape({rows, -1});
  }
  return layer_tail(attn, residual, o_packed, o_bias, o_group, gu_packed, gu_bias, gu_group, norm, eps, down_packed,
                    down_bias, down_group);
}

// src [batch, kv, 1, d] -> position ``pos`` of buf [batch, kv, capacity > pos, d] (both float, rows of d
// contiguous): one decode step's K or V written into a growing cache slot's room (river/cache.py).
void write_position(const torch::Tensor& buf, const torch::Tensor& src, int64_t pos) {
  TORCH_CHECK(buf.dim() == 4 && src.dim() == 4 && buf.size(0) == src.size(0) && buf.size(1) == src.size(1) &&
                  buf.size(3) == src.size(3) && src.size(2) == 1 && pos >= 0 && pos < buf.size(2) &&
                  buf.scalar_type() == torch::kFloat && src.scalar_type() == torch::kFloat && buf.stride(3) == 1 &&
                  src.stride(3) == 1,
              "river_int4 exit_stack: a growing slot's buffer must be float [batch, kv, capacity > length, d]");
  float* bp = buf.data_ptr<float>();
  const float* sp = src.data_ptr<float>();
  const int64_t d = buf.size(3);
  for (int64_t b = 0; b < buf.size(0); ++b)
    for (int64_t h = 0; h < buf.size(1); ++h)
      std::memcpy(bp + b * buf.stride(0) + h * buf.stride(1) + pos * buf.stride(2),
                  sp + b * src.stride(0) + h * src.stride(1), d * sizeof(float));
}

// exit_stack on growing cache slots (length >= 0), without a tensor per intermediate: each layer's
// activations live in this thread's scratch rows, and every step calls the same loops in the same order as
// attention_in, attend_one_token and layer_tail (rms_norm_rows, product_rows, the rotary loop,
// river_ops::attend_group, silu_mul_rows), so the same numbers bit for bit; what goes is ~20 tensor
// allocations, views and dispatches a layer. Arguments as exit_stack's; returns its {out, keys..., values...},
// or with ``views`` false {out} alone (the caller keeps the slots' lengths itself: ExitStackHandle).
std::vector<torch::Tensor> stack_in_room(torch::Tensor x, const std::vector<torch::Tensor>& packed,
                                         const std::vector<c10::optional<torch::Tensor>>& bias,
                                         const std::vector<int64_t>& group, const std::vector<torch::Tensor>& norms,
                                         const std::vector<double>& eps, const torch::Tensor& cos,
                                         const torch::Tensor& sin, const std::vector<torch::Tensor>& past_keys,
                                         const std::vector<torch::Tensor>& past_values, int64_t length,
                                         const c10::optional<torch::Tensor>& mask, int64_t heads, int64_t kv,
                                         int64_t d, double scale, bool views = true) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2, B = x.size(0), hidden = x.size(1);
  const int64_t width = heads + 2 * kv, rot = heads + kv, half = d / 2, L = length + 1;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && d % 8 == 0 && kv > 0 && heads % kv == 0 &&
                  cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
                  cos.sizes() == sin.sizes() && cos.dim() == 3 && (cos.size(0) == 1 || cos.size(0) == B) &&
                  cos.size(1) == 1 && cos.size(2) == d,
              "river_int4 exit_stack: x must be float [batch, hidden], cos / sin float [batch or 1, 1, head_dim]");
  const torch::Tensor m = one_token_mask(mask, B, L);
  auto check_product = [&](int64_t j, int64_t K, int64_t N) {
    const torch::Tensor& p = packed[j];
    TORCH_CHECK(p.dim() == 3 && p.scalar_type() == torch::kUInt8 && group[j] % 16 == 0 &&
                    p.size(2) == group_bytes(group[j]) && p.size(1) * group[j] == K && p.size(0) * kLanes == N &&
                    (!bias[j].has_value() || (bias[j]->numel() == N && bias[j]->scalar_type() == torch::kFloat &&
                                              bias[j]->is_contiguous())),
                "river_int4 exit_stack: a layer's packed product does not match the layer's shapes");
  };
  const int64_t inter2 = packed[2].size(0) * kLanes, inter = inter2 / 2;
  auto xc = x.contiguous();
  auto c = cos.contiguous(), s = sin.contiguous();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const int64_t cb = c.size(0);
  thread_local std::vector<float> xa, xb, xn, y, qk, attn, h, gu, act;
  auto fit = [](std::vector<float>& v, int64_t n) { if (v.size() < static_cast<size_t>(n)) v.resize(n); };
  fit(xa, B * hidden), fit(xb, B * hidden), fit(xn, B * hidden), fit(y, B * width * d), fit(qk, B * rot * d);
  fit(attn, B * heads * d), fit(h, B * hidden), fit(gu, B * inter2), fit(act, B * inter);
  std::memcpy(xa.data(), xc.data_ptr<float>(), B * hidden * sizeof(float));
  float* cur = xa.data();
  float* next = xb.data();
  std::vector<torch::Tensor> keys(layers), values(layers);
  const float sc = static_cast<float>(scale);
  for (int64_t i = 0; i < layers; ++i) {
    check_product(4 * i, hidden, width * d), check_product(4 * i + 1, heads * d, hidden);
    check_product(4 * i + 2, hidden, inter2), check_product(4 * i + 3, inter, hidden);
    TORCH_CHECK(packed[4 * i + 2].size(0) * kLanes == inter2, "river_int4 exit_stack: the layers' widths differ");
    const torch::Tensor& kb = past_keys[i];
    const torch::Tensor& vb = past_values[i];
    for (const torch::Tensor* buf : {&kb, &vb})
      TORCH_CHECK(buf->dim() == 4 && buf->size(0) == B && buf->size(1) == kv && buf->size(2) > length &&
                      buf->size(3) == d && buf->scalar_type() == torch::kFloat && buf->stride(3) == 1,
                  "river_int4 exit_stack: a growing slot's buffer must be float [batch, kv, capacity > length, d]");
    auto bias_of = [&](int64_t j) { return bias[j].has_value() ? bias[j]->data_ptr<float>() : nullptr; };
    auto norm_of = [&](int64_t j) {
      TORCH_CHECK(norms[j].numel() == hidden && norms[j].scalar_type() == torch::kFloat && norms[j].is_contiguous(),
                  "river_int4: the norm weight must be float [K]");
      return norms[j].data_ptr<float>();
    };
    // attention_in: input norm, q/k/v product, rotary on q and k (its loop, tokens = 1)
    river_ops::rms_norm_rows(cur, B, hidden, norm_of(2 * i), static_cast<float>(eps[2 * i]), xn.data());
    product_rows(xn.data(), B, packed[4 * i], bias_of(4 * i), group[4 * i], nullptr, y.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < rot; ++j) {
        const float* src = y.data() + (b * width + j) * d;
        const float* ct = cp + (cb == 1 ? 0 : b) * d;
        const float* st = sp + (cb == 1 ? 0 : b) * d;
        float* dst = qk.data() + (b * rot + j) * d;
        for (int64_t t = 0; t < half; ++t) dst[t] = src[t] * ct[t] - src[t + half] * st[t];
        for (int64_t t = half; t < d; ++t) dst[t] = src[t] * ct[t] + src[t - half] * st[t];
      }
    // the new position's K (rotary applied) and V into the slot's room (write_position's copy)
    float* kp = kb.data_ptr<float>();
    float* vp = vb.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < kv; ++g) {
        std::memcpy(kp + b * kb.stride(0) + g * kb.stride(1) + length * kb.stride(2),
                    qk.data() + (b * rot + heads + g) * d, d * sizeof(float));
        std::memcpy(vp + b * vb.stride(0) + g * vb.stride(1) + length * vb.stride(2),
                    y.data() + (b * width + rot + g) * d, d * sizeof(float));
      }
    // attend_one_token's attention over the slot's first L positions
    attend_rows(qk.data(), rot * d, d, B, heads, kv, kp, kb.stride(0), kb.stride(1), kb.stride(2), vp, vb.stride(0),
                vb.stride(1), vb.stride(2), L, d, sc, m, attn.data(), heads * d);
    // layer_tail: h = x + o(attn); x' = h + down(silu(gate) * up), gate | up = gu(norm(h))
    product_rows(attn.data(), B, packed[4 * i + 1], bias_of(4 * i + 1), group[4 * i + 1], cur, h.data());
    river_ops::rms_norm_rows(h.data(), B, hidden, norm_of(2 * i + 1), static_cast<float>(eps[2 * i + 1]), xn.data());
    product_rows(xn.data(), B, packed[4 * i + 2], bias_of(4 * i + 2), group[4 * i + 2], nullptr, gu.data());
    river_ops::silu_mul_rows(gu.data(), B, inter, act.data());
    product_rows(act.data(), B, packed[4 * i + 3], bias_of(4 * i + 3), group[4 * i + 3], h.data(), next);
    std::swap(cur, next);
    if (views) {
      keys[i] = kb.narrow(2, 0, L);
      values[i] = vb.narrow(2, 0, L);
    }
  }
  auto out = torch::empty({B, hidden}, torch::kFloat);
  std::memcpy(out.data_ptr<float>(), cur, B * hidden * sizeof(float));
  std::vector<torch::Tensor> result{out};
  if (!views) return result;
  result.insert(result.end(), keys.begin(), keys.end());
  result.insert(result.end(), values.begin(), values.end());
  return result;
}

// exit_stack on growing cache slots with the per-layer arguments held from step to step: what River's
// exit-mode step (river/exit_step.py) calls. A step through exit_stack hands pybind11 ~400 Python objects
// (each layer's packed weights, biases, group sizes, norms, epsilons and slot buffers) and gets back ~50
// tensors; this holds them and takes the step's x, cos / sin, length and mask only. Same computation
// (stack_in_room), so the same numbers and the same KV cache writes as exit_stack.
struct ExitStackHandle {
  std::vector<torch::Tensor> packed;
  std::vector<c10::optional<torch::Tensor>> bias;
  std::vector<int64_t> group;
  std::vector<torch::Tensor> norms;
  std::vector<double> eps;
  int64_t heads, kv, d;
  double scale;
  std::vector<torch::Tensor> keys, values;

  ExitStackHandle(std::vector<torch::Tensor> packed_, std::vector<c10::optional<torch::Tensor>> bias_,
                  std::vector<int64_t> group_, std::vector<torch::Tensor> norms_, std::vector<double> eps_,
                  int64_t heads_, int64_t kv_, int64_t d_, double scale_)
      : packed(std::move(packed_)), bias(std::move(bias_)), group(std::move(group_)), norms(std::move(norms_)),
        eps(std::move(eps_)), heads(heads_), kv(kv_), d(d_), scale(scale_) {
    const size_t layers = norms.size() / 2;
    TORCH_CHECK(layers > 0 && packed.size() == 4 * layers && bias.size() == 4 * layers &&
                    group.size() == 4 * layers && norms.size() == 2 * layers && eps.size() == 2 * layers,
                "river_int4 ExitStackHandle: 4 products and 2 norms per layer");
  }

  // the slots' buffers [batch, kv, capacity, d], one key and one value buffer per layer
  void set_rooms(std::vector<torch::Tensor> keys_, std::vector<torch::Tensor> values_) {
    TORCH_CHECK(keys_.size() == norms.size() / 2 && values_.size() == keys_.size(),
                "river_int4 ExitStackHandle: one key and one value buffer per layer");
    keys = std::move(keys_);
    values = std::move(values_);
  }

  // x [batch, hidden] float -> the last layer's output [batch, hidden]; writes position ``length`` of each
  // layer's buffers and attends to their first length + 1 positions (exit_stack's arguments otherwise)
  torch::Tensor run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t length,
                    c10::optional<torch::Tensor> mask) {
    TORCH_CHECK(length >= 0 && !keys.empty(), "river_int4 ExitStackHandle: set_rooms first; length >= 0");
    return stack_in_room(x, packed, bias, group, norms, eps, cos, sin, keys, values, length, mask, heads, kv, d,
                         scale, false)[0];
  }
};

// The exit layers of one decode step after the exit, in one call: for each layer i, attention_in, the KV
// cache slot's update, River's one-token attention over the slot and layer_tail,
// the same functions attention_in / attention_out compute (so the same numbers as the per-layer calls).
// x [batch, hidden] float (one token per row); per layer, in order: packed / bias / group of q|k|v, o,
// gate|up and down (packed[4 i + j], ...), the two norms' weights and eps (norms[2 i + j], ...); cos / sin
// [batch or 1, 1, d] as attention_in takes them;
// past_keys / past_values: none (no cache); with ``length`` -1, each layer's past K/V, the new position
// concatenated to them (as transformers' DynamicLayer.update does); with ``length`` >= 0, each layer's growing
// buffers (river/cache.py) whose first ``length`` positions are the past: the new position is written at
// ``length`` and the layer's K/V are the buffers' first length + 1 positions (views). The same values either
// way. mask as attend_one_token. Returns {out [batch, hidden], keys of each layer..., values of each layer...}.
std::vector<torch::Tensor> exit_stack(torch::Tensor x, std::vector<torch::Tensor> packed,
                                      std::vector<c10::optional<torch::Tensor>> bias, std::vector<int64_t> group,
                                      std::vector<torch::Tensor> norms, std::vector<double> eps, torch::Tensor cos,
                                      torch::Tensor sin, std::vector<torch::Tensor> past_keys,
                                      std::vector<torch::Tensor> past_values, int64_t length,
                                      c10::optional<torch::Tensor> mask, int64_t heads, int64_t kv, int64_t d,
                                      double scale) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2, batch = x.size(0);
  TORCH_CHECK(layers > 0 && packed.size() == 4 * layers && bias.size() == 4 * layers && group.size() == 4 * layers &&
                  norms.size() == 2 * layers && eps.size() == 2 * layers &&
                  (past_keys.empty() || (past_keys.size() == layers && past_values.size() == layers)),
              "river_int4 exit_stack: 4 products, 2 norms and 0 or 1 past K/V per layer");
  if (length >= 0 && !past_keys.empty())  // growing slots: no tensor per intermediate
    return stack_in_room(x, packed, bias, group, norms, eps, cos, sin, past_keys, past_values, length, mask, heads,
                         kv, d, scale);
  std::vector<torch::Tensor> keys(layers), values(layers);
  for (int64_t i = 0; i < layers; ++i) {
    auto qkv = attention_in(x, packed[4 * i], bias[4 * i], group[4 * i], norms[2 * i], eps[2 * i], cos, sin, batch,
                            1, heads, kv, d);
    if (past_keys.empty()) {
      keys[i] = qkv[1];
      values[i] = qkv[2];
    } else if (length < 0) {
      keys[i] = at::cat({past_keys[i], qkv[1]}, 2);
      values[i] = at::cat({past_values[i], qkv[2]}, 2);
    } else {
      write_position(past_keys[i], qkv[1], length);
      write_position(past_values[i], qkv[2], length);
      keys[i] = past_keys[i].narrow(2, 0, length + 1);
      values[i] = past_values[i].narrow(2, 0, length + 1);
    }
    auto attn = attend_one_token(qkv[0], keys[i], values[i], mask, scale);
    x = layer_tail(attn, x, packed[4 * i + 1], bias[4 * i + 1], group[4 * i + 1], packed[4 * i + 2], bias[4 * i + 2],
                   group[4 * i + 2], norms[2 * i + 1], eps[2 * i + 1], packed[4 * i + 3], bias[4 * i + 3],
                   group[4 * i + 3]);
  }
  std::vector<torch::Tensor> out{x};
  out.insert(out.end(), keys.begin(), keys.end());
  out.insert(out.end(), values.begin(), values.end());
  return out;
}


// ---- dense_mm: river-fp32, a few fp32 rows times an fp32 weight as nn.Linear stores it ----
// y[r, n] = sum_k x[r, k] W[n, k] (+ b[n]), reading W ([N, K] row-major, the nn.Linear layout, no copy)
// from memory once per call. Each (row, output) keeps one 8-lane fp32 accumulator over k
// in steps of 8 (FMA; the last partial step masked), summed across lanes at the end in a fixed order, so a
// row's numbers do not depend on the other rows of the call, on how the rows are blocked or on the thread
// count. A block of NW weight rows shares each x load and each x row its weight loads (R x NW accumulators,
// NW weight vectors and one x vector fit the 16 AVX registers). AVX2 + FMA, also in the AVX-512 build; lanes summed by river_ops::hsum8.

// R rows times weight rows n..n+NW-1. pf (or null): the next block's first weight row, fetched into the
// cache one line per weight row every 16 floats while this block computes, so a multi-row call does not
// wait on memory between blocks (a one-row call streams and needs no help).
template <int R, int NW>
void dense_block(const float* x, int64_t K, const float* W, int64_t n, int64_t N, const float* bias, float* y,
                 __m256i tail, const float* pf) {
  __m256 acc[R][NW];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* w = W + n * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    if (pf != nullptr && (k & 15) == 0)
      for (int j = 0; j < NW; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * K + k), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int j = 0; j < NW; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  if (k < K) {
    __m256 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = _mm256_maskload_ps(w + j * K + k, tail);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + r * K + k, tail);
      for (int j = 0; j < NW; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NW; ++j) y[r * N + n + j] = river_ops::hsum8(acc[r][j]) + (bias ? bias[n + j] : 0.0f);
}

// rows (1..RM) rows times one block of NW weight rows
template <int NW, int RM>
void dense_chunk(int64_t rows, const float* x, int64_t K, const float* W, int64_t n, int64_t N, const float* bias,
                 float* y, __m256i tail, const float* pf) {
  if constexpr (RM >= 1) {
    if (rows == RM) return dense_block<RM, NW>(x, K, W, n, N, bias, y, tail, pf);
    dense_chunk<NW, RM - 1>(rows, x, K, W, n, N, bias, y, tail, pf);
  }
}

// A call with M rows: the outputs in blocks of NW weight rows, split between threads; each block is read
// from memory once (fetched ahead while the block before it computes, when PF) and used for every chunk of up
// to RM rows while it sits in L1. One row: NW = 4 (RM = 1, no fetching ahead); more rows: NW = 3, RM = 4
// with fetching ahead, 1.2-1.6x the NW = 2 x 6-row blocks at 2-16 rows on Qwen2.5-Coder-0.5B's shapes
// (benchmarks/probes/int4_rows.py --product dense).
template <int NW, int RM, bool PF>
void dense_rows(const float* x, int64_t M, int64_t K, const float* W, int64_t N, const float* bias, float* y) {
  alignas(32) int32_t m[8];
  for (int i = 0; i < 8; ++i) m[i] = (K % 8 != 0 && i < K % 8) ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
  const int64_t blocks = (N + NW - 1) / NW;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NW;
      for (int64_t r0 = 0; r0 < M; r0 += RM) {
        const int64_t rows = std::min<int64_t>(RM, M - r0);
        if (n + NW <= N) {
          const float* pf = (PF && r0 == 0 && b + 1 < b1 && n + 2 * NW <= N) ? W + (n + NW) * K : nullptr;
          dense_chunk<NW, RM>(rows, x + r0 * K, K, W, n, N, bias, y + r0 * N, tail, pf);
        } else {
          for (int64_t j = n; j < N; ++j)
            dense_chunk<1, RM>(rows, x + r0 * K, K, W, j, N, bias, y + r0 * N, tail, nullptr);
        }
      }
    }
  });
}

// x [..., K] float32, weight [N, K] float32 (contiguous), bias [N] float32 or none -> [..., N] float32
torch::Tensor dense_mm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "dense_mm: float32 only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && x.size(-1) == weight.size(1),
              "dense_mm: weight must be a contiguous [N, K] matrix with K = x.size(-1)");
  const int64_t K = weight.size(1), N = weight.size(0);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N, "dense_mm: bias must be float32 [N]");
    bias_c = bias->contiguous();
    b = bias_c.data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 1) dense_rows<4, 1, false>(xp, M, K, wp, N, b, yp);
  else dense_rows<3, 4, true>(xp, M, K, wp, N, b, yp);
  return y.view(sizes);
}


// ---- grid_mm: river-grid, fp32 rows times a weight held exactly on its own quantization grid ----
// W[n, k] = fl(A[n, g] * Q[n, k] + B[n, g]) for the G input channels k of group g: Q int8, A and B fp32 per
// (row, group) (B may be absent: 0). A weight read from a GGUF block format (Q4_K, Q6_K, Q8_0, ...) is
// exactly this (quant/grid.py checks every weight bit for bit with grid_dequant, the same fma as here), so
// the product is the fp32 product on the same weights up to fp32 summation order, from about a third of
// the bytes. One accumulator (16 lanes on AVX-512, 8 on AVX2) per (row, output) over k, lanes summed at
// the end: a row's numbers do not depend on the call's other rows or on the thread count.
//
// Packed layout (grid_pack): weight rows in blocks of GRID_ROWS (the last block padded with zero rows);
// each block one contiguous stream of its K / G groups, a group being the block's GRID_ROWS x G int8 q
// (row by row), then its GRID_ROWS scales, then (with offsets) its GRID_ROWS offsets: one sequential read
// per block (rows of separate q, scale and offset tensors read side by side ran at 26 GB/s where dense_mm
// streams 44 on the same CPU), prefetched GRID_PREFETCH groups ahead.
//
// A call of M rows makes ceil(M / GRM) passes over each block, as even as they can be; each pass
// dequantizes the block's weight vectors in registers once for its rows. Up to a few rows the product is
// bound by the bytes it reads, past them by the fmas (the dequantizing ones included).
constexpr int64_t GRID_ROWS = 4;
#if defined(__AVX512F__)
using gvec = __m512;
constexpr int GL = 16, GRM = 6;  // 24 accumulators, 4 weight vectors and x in 32 registers
inline gvec g_q(const int8_t* q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))); }
inline gvec g_set1(float v) { return _mm512_set1_ps(v); }
inline gvec g_zero() { return _mm512_setzero_ps(); }
inline gvec g_load(const float* p) { return _mm512_loadu_ps(p); }
inline void g_store(float* p, gvec v) { _mm512_storeu_ps(p, v); }
inline gvec g_fma(gvec a, gvec b, gvec c) { return _mm512_fmadd_ps(a, b, c); }
inline float g_hsum(gvec v) { return _mm512_reduce_add_ps(v); }
inline bool g_equal(gvec a, gvec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ) == 0xFFFF; }
#else
using gvec = __m256;
constexpr int GL = 8, GRM = 2;  // 8 accumulators, 4 weight vectors, x and the broadcasts in 16 registers
inline gvec g_q(const int8_t* q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))); }
inline gvec g_set1(float v) { return _mm256_set1_ps(v); }
inline gvec g_zero() { return _mm256_setzero_ps(); }
inline gvec g_load(const float* p) { return _mm256_loadu_ps(p); }
inline void g_store(float* p, gvec v) { _mm256_storeu_ps(p, v); }
inline gvec g_fma(gvec a, gvec b, gvec c) { return _mm256_fmadd_ps(a, b, c); }
inline float g_hsum(gvec v) { return river_ops::hsum8(v); }
inline bool g_equal(gvec a, gvec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)) == 0xFF; }
#endif

inline int64_t grid_stride(int64_t G, bool offset) { return GRID_ROWS * G + GRID_ROWS * 4 * (offset ? 2 : 1); }

// the block's weight vector j for input channels k..k+GL-1 of group grp (whose stream starts at p)
inline gvec grid_w(const int8_t* p, int64_t G, bool offset, int j, int64_t k) {
  const float* sc = reinterpret_cast<const float*>(p + GRID_ROWS * G);
  return g_fma(g_set1(sc[j]), g_q(p + j * G + k), offset ? g_set1(sc[GRID_ROWS + j]) : g_zero());
}

// Software prefetch of the block stream, in groups ahead (into the thread's next block: its blocks are one
// contiguous stream), non-temporal as river-int4's (the weights are read once a step). On the 2-core AMD
// EPYC Zen 5, one 1536 x 8960 weight at 8 rows, streamed: 1709 us without it, 1066 / 936 / 835 / 755 with
// 8 / 16 / 32 / 64 groups ahead (one probe each, 64 within noise of 32). With GRM 6 (it was 4) the products
// ran 1.6-3.6x faster at 4-16 rows than before, 0.95-1.65x at one row, bit for bit the same numbers
// (benchmarks/probes/int4_rows.py --product grid). Prefetching changes no arithmetic.
constexpr int64_t GRID_PREFETCH = 32;

// R rows times one block of GRID_ROWS weight rows (n..n+GRID_ROWS-1, outputs past N not written)
template <int R>
void grid_block(const float* x, int64_t K, const int8_t* blk, int64_t G, bool offset, int64_t n, int64_t N,
                const float* bias, float* y) {
  constexpr int NW = GRID_ROWS;
  const int64_t groups = K / G, stride = grid_stride(G, offset);
  gvec acc[R][NW];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = g_zero();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* p = blk + g * stride;
    for (int64_t line = 0; line < stride; line += 64)  // GRID_PREFETCH groups ahead (never faults past the end)
      _mm_prefetch(reinterpret_cast<const char*>(p + GRID_PREFETCH * stride + line), _MM_HINT_NTA);
    for (int64_t k = 0; k < G; k += GL) {
      gvec w[NW];
      for (int j = 0; j < NW; ++j) w[j] = grid_w(p, G, offset, j, k);
      for (int r = 0; r < R; ++r) {
        const gvec xv = g_load(x + r * K + g * G + k);
        for (int j = 0; j < NW; ++j) acc[r][j] = g_fma(w[j], xv, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NW && n + j < N; ++j) y[r * N + n + j] = g_hsum(acc[r][j]) + (bias ? bias[n + j] : 0.0f);
}

template <int RM>
void grid_chunk(int64_t rows, const float* x, int64_t K, const int8_t* blk, int64_t G, bool offset, int64_t n,
                int64_t N, const float* bias, float* y) {
  if constexpr (RM >= 1) {
    if (rows == RM) return grid_block<RM>(x, K, blk, G, offset, n, N, bias, y);
    grid_chunk<RM - 1>(rows, x, K, blk, G, offset, n, N, bias, y);
  }
}

void check_grid(const torch::Tensor& packed, int64_t N, int64_t K, int64_t G, bool offset) {
  TORCH_CHECK(G > 0 && G % GL == 0 && K % G == 0 && N > 0,
              "grid: the group size must divide K and be a multiple of ", GL, " (got K ", K, ", G ", G, ")");
  TORCH_CHECK(packed.scalar_type() == torch::kChar && packed.dim() == 1 && packed.is_contiguous() &&
              packed.numel() == (N + GRID_ROWS - 1) / GRID_ROWS * (K / G) * grid_stride(G, offset),
              "grid: packed must be grid_pack's int8 stream for these N, K, G");
}

// q int8 [N, K], scale float32 [N, K / G], offset float32 [N, K / G] or none -> the packed int8 stream
torch::Tensor grid_pack(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> offset) {
  TORCH_CHECK(q.scalar_type() == torch::kChar && q.dim() == 2 && scale.scalar_type() == torch::kFloat &&
              scale.dim() == 2 && scale.size(0) == q.size(0) && scale.size(1) > 0 && q.size(1) % scale.size(1) == 0,
              "grid_pack: q must be int8 [N, K] and scale float32 [N, K / G]");
  const bool off = offset.has_value() && offset->defined();
  if (off) TORCH_CHECK(offset->scalar_type() == torch::kFloat && offset->sizes() == scale.sizes(),
                       "grid_pack: offset must be float32 shaped like scale");
  const int64_t N = q.size(0), K = q.size(1), groups = scale.size(1), G = K / groups;
  TORCH_CHECK(G % GL == 0, "grid_pack: the group size must be a multiple of ", GL, " (got ", G, ")");
  auto qc = q.contiguous();
  auto sc = scale.contiguous();
  torch::Tensor oc = off ? offset->contiguous() : torch::Tensor();
  const int64_t stride = grid_stride(G, off), nblocks = (N + GRID_ROWS - 1) / GRID_ROWS;
  auto packed = torch::zeros({nblocks * groups * stride}, q.options());
  int8_t* P = packed.data_ptr<int8_t>();
  const int8_t* Q = qc.data_ptr<int8_t>();
  const float* A = sc.data_ptr<float>();
  const float* B = off ? oc.data_ptr<float>() : nullptr;
  for (int64_t blk = 0; blk < nblocks; ++blk)
    for (int64_t g = 0; g < groups; ++g) {
      int8_t* p = P + (blk * groups + g) * stride;
      float* f = reinterpret_cast<float*>(p + GRID_ROWS * G);
      for (int64_t j = 0; j < GRID_ROWS; ++j) {
        const int64_t n = blk * GRID_ROWS + j;
        if (n >= N) continue;  // padding rows stay zero
        std::memcpy(p + j * G, Q + n * K + g * G, G);
        f[j] = A[n * groups + g];
        if (off) f[GRID_ROWS + j] = B[n * groups + g];
      }
    }
  return packed;
}

// x [..., K] float32, the packed weight of N x K with groups of G, bias [N] or none -> [..., N] float32
torch::Tensor grid_mm(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K, int64_t G, bool offset,
                      c10::optional<torch::Tensor> bias) {
  check_grid(packed, N, K, G, offset);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.size(-1) == K, "grid_mm: x must be float32 [..., K]");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N, "grid_mm: bias must be float32 [N]");
    bias_c = bias->contiguous();
    b = bias_c.data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const int8_t* P = packed.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t block_bytes = (K / G) * grid_stride(G, offset), nblocks = (N + GRID_ROWS - 1) / GRID_ROWS;
  // passes of at most GRM rows over each block, as even as they can be (8 rows: 4 + 4, not 6 + 2)
  const int64_t passes = (M + GRM - 1) / GRM, per_pass = passes > 0 ? (M + passes - 1) / passes : 1;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int64_t r0 = 0; r0 < M; r0 += per_pass)
        grid_chunk<GRM>(std::min<int64_t>(per_pass, M - r0), xp + r0 * K, K, P + blk * block_bytes, G, offset,
                        blk * GRID_ROWS, N, b, yp + r0 * N);
  });
  return y.view(sizes);
}

// the weight grid_mm multiplies by: float32 [N, K], W[n, k] = fma(A[n, g], Q[n, k], B[n, g]) read back from
// the packed stream
torch::Tensor grid_dequant(torch::Tensor packed, int64_t N, int64_t K, int64_t G, bool offset) {
  check_grid(packed, N, K, G, offset);
  const int64_t groups = K / G, stride = grid_stride(G, offset), nblocks = (N + GRID_ROWS - 1) / GRID_ROWS;
  auto w = torch::empty({N, K}, packed.options().dtype(torch::kFloat));
  const int8_t* P = packed.data_ptr<int8_t>();
  float* W = w.data_ptr<float>();
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int64_t g = 0; g < groups; ++g)
        for (int j = 0; j < GRID_ROWS && blk * GRID_ROWS + j < N; ++j)
          for (int64_t k = 0; k < G; k += GL)
            g_store(W + (blk * GRID_ROWS + j) * K + g * G + k, grid_w(P + (blk * groups + g) * stride, G, offset, j, k));
  });
  return w;
}

// whether grid_dequant(packed, N, K, G, offset) equals weight (float32 [N, K]) in every element (as
// torch.equal), without writing the dequantized copy: one read of each, stopping at the first difference
bool grid_equals(torch::Tensor packed, int64_t N, int64_t K, int64_t G, bool offset, torch::Tensor weight) {
  check_grid(packed, N, K, G, offset);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.dim() == 2 && weight.size(0) == N && weight.size(1) == K,
              "grid_equals: weight must be float32 [N, K]");
  auto wc = weight.contiguous();
  const int64_t groups = K / G, stride = grid_stride(G, offset), nblocks = (N + GRID_ROWS - 1) / GRID_ROWS;
  const int8_t* P = packed.data_ptr<int8_t>();
  const float* W = wc.data_ptr<float>();
  std::atomic<bool> same{true};
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1 && same.load(std::memory_order_relaxed); ++blk)
      for (int64_t g = 0; g < groups; ++g)
        for (int j = 0; j < GRID_ROWS && blk * GRID_ROWS + j < N; ++j)
          for (int64_t k = 0; k < G; k += GL)
            if (!g_equal(grid_w(P + (blk * groups + g) * stride, G, offset, j, k),
                         g_load(W + (blk * GRID_ROWS + j) * K + g * G + k))) {
              same.store(false, std::memory_order_relaxed);
              return;
            }
  });
  return same.load();
}

// torch.argmax(x, dim=-1) of x [M, V] float (V >= 1) -> int64 [M] (river_ops::argmax_row: the first index of
// the largest value, the first NaN's where there is one). One pass over the row in eight lanes; ATen's
// argmax compares one value at a time (~80 us for a 152k vocabulary, ~9 for its amax).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) > 0,
              "river_int4 argmax_rows: x must be float [M, V > 0]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), V = xc.size(1);
  auto out = torch::empty({M}, torch::kLong);
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) op[m] = river_ops::argmax_row(xp + m * V, V);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack int32 [N, K] 4-bit values with fp16 scales and zeros for river_int4_mm");
  m.def("mm", &mm, "river-int4 product");
  m.def("attention_in", &attention_in, "Llama-family exit layer: input norm, q/k/v product, rotary");
  m.def("set_product_clock", &set_product_clock, "start (true) or stop adding up the products' wall time");
  m.def("product_ns", &product_ns, "nanoseconds of products added up while the product clock was on");
  m.def("dense_mm", &dense_mm, "river-fp32: fp32 rows times an nn.Linear weight [N, K], read once for all rows");
  m.def("grid_pack", &grid_pack, "river-grid: int8 grid values with fp32 group scales (and offsets) into one stream per 4 rows");
  m.def("grid_mm", &grid_mm, "river-grid: fp32 rows times a packed grid weight, the fp32 product on the same weights");
  m.def("grid_dequant", &grid_dequant, "the fp32 weight grid_mm multiplies by");
  m.def("grid_equals", &grid_equals, "whether the fp32 weight grid_mm multiplies by equals a given weight");
  m.def("attention_out", &attention_out, "Llama-family exit layer: SDPA, o product, norm, gate/up, silu*up, down");
  m.def("attend_one_token", &attend_one_token, "one query token's grouped-query attention over a cache slot");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of float rows, in one vectorized pass");
  m.def("exit_stack", &exit_stack, "Llama-family exit layers of one decode step, KV cache slots updated, in one call");
  py::class_<ExitStackHandle>(m, "ExitStackHandle")
      .def(py::init<std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>, std::vector<int64_t>,
                    std::vector<torch::Tensor>, std::vector<double>, int64_t, int64_t, int64_t, double>())
      .def("set_rooms", &ExitStackHandle::set_rooms, "the layers' key and value buffers")
      .def("run", &ExitStackHandle::run, "exit_stack of one decode step on the held layers and buffers");
}
