// river-int4: 4-bit weight-only products with int8 activations on AVX-512 VNNI (vpdpbusd).
//
// Weights: asymmetric 4-bit groups of G input channels, w ~= (q - 8) * scale + zero with q in [0, 15] (the
// grid and layout of torch-int4's tinygemm, quant/modules.py). Activations: each row quantized per group of
// G to int8, symmetric (x ~= xs * qx, xs = max|x| / 127), with the exact fp32 sum of the group kept for
// the zero term:
//   sum_k w_k x_k  ~=  scale * xs * sum_k (q_k - 8) qx_k  +  zero * sum_k x_k.
// The int8 dot products run on vpdpbusd, which multiplies unsigned by signed bytes: the activations go in
// as qx + 128 (unsigned), the centred weights q - 8 as signed, and 128 * sum_k (q_k - 8) per output and
// group (``corr``, made at packing) is taken off again. Centring the weights keeps the activations'
// rounding error from being multiplied by the weights' mean.
//
// Packed layout (river_int4_pack): output channels in blocks of 16, each block's K in steps of 8:
// 64 bytes = 16 lanes x 4 bytes; byte b of lane j holds q[n0 + j][k + b] in its low nibble and
// q[n0 + j][k + 4 + b] in its high nibble. One block's steps lie contiguously along K, so a block's
// weights are read as one stream. Scales and zeros are fp32 [N / 16][K / G][16], corr int32 likewise.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <cstring>

namespace {

constexpr int kLanes = 16;

// q: int32 [N, K] with values in [0, 15] -> uint8 [N / 16, K / 8, 64] (the nibbles q, unsigned)
torch::Tensor pack(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt32, "river_int4_pack: q must be int32 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % kLanes == 0 && K % 8 == 0, "river_int4_pack: N % 16 and K % 8 must be 0");
  auto qc = q.contiguous();
  auto out = torch::empty({N / kLanes, K / 8, 64}, torch::kUInt8);
  const int32_t* src = qc.data_ptr<int32_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t nb = 0; nb < N / kLanes; ++nb)
    for (int64_t ks = 0; ks < K / 8; ++ks)
      for (int j = 0; j < kLanes; ++j)
        for (int b = 0; b < 4; ++b) {
          const int32_t* row = src + (nb * kLanes + j) * K + ks * 8;
          const uint8_t lo = static_cast<uint8_t>(row[b] & 15), hi = static_cast<uint8_t>(row[4 + b] & 15);
          dst[((nb * (K / 8) + ks) * kLanes + j) * 4 + b] = static_cast<uint8_t>(lo | (hi << 4));
        }
  return out;
}

// x: float [M, K] -> qx + 128 uint8 [M, K], xs float [M, K / G], xsum float [M, K / G]
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, uint8_t* qx, float* xs, float* xsum) {
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
      uint8_t* qg = qx + m * K + g * G;
      const __m512i offset = _mm512_set1_epi32(128);
      for (int64_t k = 0; k < G; k += 16) {
        __m512i r = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + k), vinv),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        r = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127)),
                             offset);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + k), _mm512_cvtusepi32_epi8(r));
      }
    }
}

// y [M, N] float = x [M, K] (float or bfloat16) times the packed weights, plus bias [N] if given.
constexpr int64_t kRows = 4;

struct Block {  // one block of 16 output channels
  const uint8_t* w;
  const float* scales;
  const float* zeros;
  const int32_t* corr;
  const float* bias;
  int64_t groups, G;
};

struct Rows {  // up to kRows activation rows and where their 16 outputs go
  const uint8_t* qx;
  const float* xs;
  const float* xsum;
  float* y;
  int64_t K, groups, N;
};

// R rows of one block: each 64-byte weight load is unpacked once and used for every row
template <int R>
inline void block_rows(const Block& blk, const Rows& r) {
  const __m512i mask = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = blk.bias ? _mm512_loadu_ps(blk.bias) : _mm512_setzero_ps();
  const int64_t steps = blk.G / 8;
  for (int64_t g = 0; g < blk.groups; ++g) {
    // one row: two dependency chains (low and high nibbles), two steps per iteration, else vpdpbusd's
    // latency bounds the call; several rows: one chain per row (the rows are the independent chains)
    __m512i lo[R], hi[R];
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
    const uint8_t* wg = blk.w + g * steps * 64;
    const int64_t unroll = R == 1 ? 2 : 1;
    for (int64_t s = 0; s < steps; s += unroll) {
      for (int64_t u = 0; u < unroll; ++u) {
        const __m512i v = _mm512_loadu_si512(wg + (s + u) * 64);
        const __m512i w0 = _mm512_sub_epi8(_mm512_and_si512(v, mask), eight);
        const __m512i w1 = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), eight);
        for (int i = 0; i < R; ++i) {
          const uint8_t* xg = r.qx + i * r.K + g * blk.G + (s + u) * 8;
          int32_t a0, a1;
          std::memcpy(&a0, xg, 4);
          std::memcpy(&a1, xg + 4, 4);
          if (R == 1) {
            lo[i] = _mm512_dpbusd_epi32(lo[i], _mm512_set1_epi32(a0), w0);
            hi[i] = _mm512_dpbusd_epi32(hi[i], _mm512_set1_epi32(a1), w1);
          } else {
            lo[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo[i], _mm512_set1_epi32(a0), w0), _mm512_set1_epi32(a1), w1);
          }
        }
      }
    }
    const __m512 scale = _mm512_loadu_ps(blk.scales + g * kLanes);
    const __m512 zero = _mm512_loadu_ps(blk.zeros + g * kLanes);
    const __m512i corr = _mm512_loadu_si512(blk.corr + g * kLanes);
    for (int i = 0; i < R; ++i) {
      const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(lo[i], hi[i]), corr));
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(r.xs[i * r.groups + g])), d, acc[i]);
      acc[i] = _mm512_fmadd_ps(zero, _mm512_set1_ps(r.xsum[i * r.groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(r.y + i * r.N, acc[i]);
}

// scales, zeros: float [N / 16, K / G, 16]; corr: int32 [N / 16, K / G, 16] = 128 * sum over the group of q - 8
// With ``silu_mul``: x is [M, 2K] = [gate | up] and the product's input is silu(gate) * up; with ``norm``
// (float [K]): the input is RMS-normalized first (eps ``eps``); with ``residual`` (float [M, N]): it is
// added to the output. Each by torch's own op (at::silu, at::mul, at::rms_norm, add_), called from here
// instead of from Python: the same numbers as the architecture's code, bit for bit. That matters: the
// activations are then rounded to int8, where an input one float rounding away can land one int8 step
// off, which moves a layer's update by about 1e-3 relative.
torch::Tensor mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros,
                 torch::Tensor corr, c10::optional<torch::Tensor> bias, int64_t group,
                 c10::optional<torch::Tensor> norm, double eps, bool silu_mul, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2, "river_int4_mm: x must be [M, K]");
  const int64_t M = x.size(0), K = packed.size(1) * 8;
  const int64_t NB = packed.size(0);
  const int64_t N = NB * kLanes, G = group, groups = K / G;
  TORCH_CHECK(x.size(1) == (silu_mul ? 2 * K : K) && K % G == 0 && G % 16 == 0, "river_int4_mm: shapes do not match");
  torch::Tensor xf = x.scalar_type() == torch::kFloat ? x : x.to(torch::kFloat);
  if (silu_mul) xf = at::mul(at::silu(xf.narrow(1, 0, K)), xf.narrow(1, K, K));
  if (norm.has_value()) xf = at::rms_norm(xf, {K}, *norm, eps);
  xf = xf.contiguous();
  auto qx = torch::empty({M, K}, torch::kUInt8);
  auto xs = torch::empty({M, groups}, torch::kFloat);
  auto xsum = torch::empty({M, groups}, torch::kFloat);
  quantize_rows(xf.data_ptr<float>(), M, K, G, qx.data_ptr<uint8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>());
  auto y = torch::empty({M, N}, torch::kFloat);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  const int32_t* cp = corr.data_ptr<int32_t>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* qxp = qx.data_ptr<uint8_t>();
  const float* xsp = xs.data_ptr<float>();
  const float* xsump = xsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // one weight stream per block; a few blocks per task keep the two threads' streams long
  at::parallel_for(0, NB, 4, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t m = 0; m < M; m += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
        const Block blk{w + nb * (K / 8) * 64, sc + nb * groups * kLanes, zp + nb * groups * kLanes,
                        cp + nb * groups * kLanes, b ? b + nb * kLanes : nullptr, groups, G};
        const Rows r{qxp + m * K, xsp + m * groups, xsump + m * groups, yp + m * N + nb * kLanes, K, groups, N};
        switch (rows) {
          case 1: block_rows<1>(blk, r); break;
          case 2: block_rows<2>(blk, r); break;
          case 3: block_rows<3>(blk, r); break;
          default: block_rows<4>(blk, r); break;
        }
      }
  });
  if (residual.has_value()) {
    TORCH_CHECK(residual->numel() == M * N, "river_int4_mm: the residual must be [M, out_features]");
    y = at::add(residual->view({M, N}), y);  // residual + product, the architecture's order
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack int32 [N, K] 4-bit values for river_int4_mm");
  m.def("mm", &mm, "river-int4 product");
}
