// Decode attention of many sessions in one call (CPU, float32).
//
// Each session brings one new token (a decode step) and owns its own KV cache
// tensor [num_layers, KVH, max_len, D]. In Python that is a loop of ~10 small
// tensor ops per session per layer; here it is one call per layer that writes
// the new key/value rows into every cache and attends, in parallel over
// (session, kv head). Grouped-query attention: the H / KVH query heads sharing
// a kv head are read against that head's keys in one pass.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // independent partial sums: vectorizable without -ffast-math

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  // Fold the lanes pairwise (a tree, not a chain of 15 dependent adds).
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  float s = acc[0];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp(x), branch-free so the compiler vectorizes the loops that call it (the softmax's,
// silu's). Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for
// exp(r), then 2^n built in the exponent bits; about 1 ulp, like the vectorized exp
// PyTorch's kernels use. x is held to [-87, 88]: below, exp is under 2^-125 (nothing
// next to a softmax's largest 1, or to silu's 1 + exp); above, 2^n would overflow the
// exponent (silu(x) = x / (1 + exp(-x)) below x = -88 is then x * 6e-39 where it is
// smaller still: under 1e-36 either way).
inline float exp_bounded(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}


#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define ZMQLLM_AVX512_ATTENTION 1
#include <immintrin.h>

// Heads of 64 (the default model's): a query, a key or a value row is four 512-bit
// vectors, held in registers instead of re-read through a generic loop.
constexpr int64_t kWide = 64;

// s[j] = scale * q . k_j for the len keys from kc (rows kWide apart); the largest.
inline float scores64(const float* qr, const float* kc, int64_t len, float scale, float* s) {
  const __m512 q0 = _mm512_loadu_ps(qr), q1 = _mm512_loadu_ps(qr + 16);
  const __m512 q2 = _mm512_loadu_ps(qr + 32), q3 = _mm512_loadu_ps(qr + 48);
  float mx = -INFINITY;
  for (int64_t j = 0; j < len; ++j) {
    const float* k = kc + j * kWide;
    // Two chains, summed at the end: a key's four products need not wait on each other.
    __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
    __m512 b = _mm512_mul_ps(q1, _mm512_loadu_ps(k + 16));
    a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), a);
    b = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), b);
    s[j] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
    mx = std::max(mx, s[j]);
  }
  return mx;
}

// out = sum_j p[j] * v_j over the len value rows from vc (rows kWide apart).
inline void weighted_values64(const float* p, const float* vc, int64_t len, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const float* v = vc + j * kWide;
    const __m512 w = _mm512_set1_ps(p[j]);
    a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a0);
    a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), a1);
    a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), a2);
    a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), a3);
  }
  _mm512_storeu_ps(out, a0);
  _mm512_storeu_ps(out + 16, a1);
  _mm512_storeu_ps(out + 32, a2);
  _mm512_storeu_ps(out + 48, a3);
}
#endif

}  // namespace

// The decode sessions of one forward (ops.h): its checks.
DecodeBatch::DecodeBatch(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v,
                         std::vector<int64_t> r, std::vector<int64_t> p, std::vector<int64_t> l)
    : kcache(std::move(k)), vcache(std::move(v)), rows(std::move(r)), pos(std::move(p)),
      lo(std::move(l)) {
  const size_t n = rows.size();
  TORCH_CHECK(kcache.size() == n && vcache.size() == n && pos.size() == n && lo.size() == n,
              "DecodeBatch: one cache pair, row, position and window start per session");
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(kcache[i].dim() == 4 && kcache[i].sizes() == vcache[i].sizes(),
                "DecodeBatch: caches are [layers, kv heads, max_len, head dim]");
    TORCH_CHECK(kcache[i].scalar_type() == torch::kFloat32 && kcache[i].is_contiguous() &&
                    vcache[i].scalar_type() == torch::kFloat32 && vcache[i].is_contiguous(),
                "DecodeBatch: caches must be contiguous float32");
    TORCH_CHECK(0 <= lo[i] && lo[i] <= pos[i] && pos[i] < kcache[i].size(2),
                "DecodeBatch: position outside the cache");
  }
}

// out    [T, H * D]   written at the decode rows only
// q      [T, H, D]    head dim contiguous (a view into the fused qkv output)
// k_new  [T, KVH, D]  roped keys of this forward, same layout
// v_new  [T, KVH, D]
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new,
                      const DecodeBatch& batch, int64_t layer, double scale) {
  const auto& kcache = batch.kcache;
  const auto& vcache = batch.vcache;
  const auto& rows = batch.rows;
  const auto& pos = batch.pos;
  const auto& lo = batch.lo;
  const int64_t n = static_cast<int64_t>(rows.size());
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_new.scalar_type() == torch::kFloat32 &&
                  v_new.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "decode_attention: float32 only");
  TORCH_CHECK(out.is_contiguous() && q.stride(2) == 1 && k_new.stride(2) == 1 &&
                  v_new.stride(2) == 1,
              "decode_attention: out contiguous, head dims contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_new.size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && out.size(0) == T && out.size(1) == H * D,
              "decode_attention: shapes do not agree");
  const int64_t G = H / KVH;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= rows[i] && rows[i] < T, "decode_attention: row outside the batch");
    TORCH_CHECK(0 <= layer && layer < kcache[i].size(0) && kcache[i].size(1) == KVH &&
                    kcache[i].size(3) == D,
                "decode_attention: cache shape does not match");
  }
  const float fscale = static_cast<float>(scale);
  float* out_p = out.data_ptr<float>();
  const float* q_p = q.data_ptr<float>();
  const float* kn_p = k_new.data_ptr<float>();
  const float* vn_p = v_new.data_ptr<float>();

  // This forward's key/value rows go in first: every query head of a kv head reads them.
  for (int64_t it = 0; it < n * KVH; ++it) {
    const int64_t i = it / KVH, kh = it % KVH;
    const int64_t block = (layer * KVH + kh) * kcache[i].size(2) * D;
    std::memcpy(kcache[i].data_ptr<float>() + block + pos[i] * D,
                kn_p + rows[i] * k_new.stride(0) + kh * k_new.stride(1), D * sizeof(float));
    std::memcpy(vcache[i].data_ptr<float>() + block + pos[i] * D,
                vn_p + rows[i] * v_new.stride(0) + kh * v_new.stride(1), D * sizeof(float));
  }
  // One task per (session, kv head), its G query heads reading the keys while they
  // are in cache; with fewer such tasks than twice the threads (a single stream: 3
  // kv heads on 2 threads, one thread idle a third of the time), one per query head.
  const int64_t per = n * KVH >= 2 * at::get_num_threads() ? G : 1;
  const int64_t units = n * KVH * (G / per);
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t head0 = (u % (H / per)) * per;  // first query head of this task
      const int64_t i = u / (H / per), kh = head0 / G, row = rows[i];
      const int64_t max_len = kcache[i].size(2);
      // This layer's, this head's [max_len, D] block of the session's cache.
      const int64_t block = (layer * KVH + kh) * max_len * D;
      const float* kc = kcache[i].data_ptr<float>() + block;
      const float* vc = vcache[i].data_ptr<float>() + block;
      const int64_t first = lo[i], len = pos[i] + 1 - first;
      scores.resize(per * len);
      for (int64_t g = 0; g < per; ++g) {
        const float* qr = q_p + row * q.stride(0) + (head0 + g) * q.stride(1);
        float* s = scores.data() + g * len;
        float mx = -INFINITY;
#if defined(ZMQLLM_AVX512_ATTENTION)
        if (D == kWide) {
          mx = scores64(qr, kc + first * D, len, fscale, s);
        } else
#endif
        for (int64_t j = 0; j < len; ++j) {
          s[j] = dot(qr, kc + (first + j) * D, D) * fscale;
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j < len; ++j) s[j] = exp_bounded(s[j] - mx);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) sum += s[j];
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; ++j) s[j] *= inv;
      }
#if defined(ZMQLLM_AVX512_ATTENTION)
      if (D == kWide) {
        for (int64_t g = 0; g < per; ++g) {
          weighted_values64(scores.data() + g * len, vc + first * D, len,
                            out_p + row * H * D + (head0 + g) * D);
        }
        continue;
      }
#endif
      std::fill(acc.begin(), acc.begin() + per * D, 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const float* vr = vc + (first + j) * D;
        for (int64_t g = 0; g < per; ++g) {
          const float p = scores[g * len + j];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
      std::memcpy(out_p + row * H * D + head0 * D, acc.data(), per * D * sizeof(float));
    }
  });
}

// The small per-layer steps of a batched decode forward, one call each instead of
// 4-7 PyTorch ops (each op's dispatch costs about what its work does at 16 rows).

// RMSNorm as transformers computes it in float32: w * (x * rsqrt(mean(x^2) + eps)).
// x [T, D] contiguous, w [D]; returns [T, D].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 &&
                  w.dim() == 1 && w.is_contiguous() && w.scalar_type() == torch::kFloat32 &&
                  w.size(0) == x.size(1),
              "rms_norm: x [T, D] and w [D], contiguous float32");
  const int64_t T = x.size(0), D = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * D;
      const float inv = 1.f / std::sqrt(dot(xr, xr, D) / static_cast<float>(D) + feps);
      float* orow = op + t * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = wp[d] * (xr[d] * inv);
    }
  });
  return out;
}

// Rotary embedding in place (rotate-half layout) on the first `heads` heads of each
// row: qkv [T, >= heads * D] with contiguous rows, cos and sin [T, D / 2] contiguous.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t D) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32 &&
                  qkv.size(1) >= heads * D && D % 2 == 0,
              "rope_: qkv [T, >= heads * D], contiguous float32");
  const int64_t T = qkv.size(0), half = D / 2, width = qkv.size(1);
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == half &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "rope_: cos and sin [T, D / 2], contiguous float32");
  float* p = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = p + t * width + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

// silu(gate) * up for gate_up [T, 2 I] (gate first, as the fused projection has it).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  gate_up.scalar_type() == torch::kFloat32 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up [T, 2 I], contiguous float32");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + exp_bounded(-g[i])) * u[i];
    }
  });
  return out;
}

// A few decode rows through consecutive layers in one call: a single stream's step, a
// speculative pass's rows, a few sessions' steps, each row an entry of ``batch``. Per
// layer two norm weights and four matrices (qkv, o, gate_up, down), float32 or
// quantized. x is [T, hidden]; each session's cache gets its new key/value rows.
torch::Tensor decode_layers(torch::Tensor x, const DecodeBatch& batch,
                            const std::vector<torch::Tensor>& norms,
                            const std::vector<Matrix>& mats, double eps, torch::Tensor cos,
                            torch::Tensor sin, int64_t H, int64_t KVH, int64_t D) {
  const int64_t T = x.size(0);
  TORCH_CHECK(x.dim() == 2 && T >= 1 && T <= kGemvMaxRows && norms.size() % 2 == 0 &&
                  mats.size() == 2 * norms.size() &&
                  static_cast<int64_t>(batch.rows.size()) == T,
              "decode_layers: 1 to ", kGemvMaxRows,
              " rows, each a decode entry; two norms and four matrices per layer");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int64_t layers = static_cast<int64_t>(norms.size() / 2);
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* n = norms.data() + 2 * l;
    const Matrix* w = mats.data() + 4 * l;
    torch::Tensor qkv = matmul(rms_norm(x, n[0], eps), w[0]);  // [T, (H + 2 KVH) * D]
    rope_(qkv, cos, sin, H + KVH, D);
    const torch::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
    const torch::Tensor k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
    const torch::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
    torch::Tensor attn = torch::empty({T, H * D}, x.options());
    decode_attention(attn, q, k, v, batch, l, scale);
    x = x + matmul(attn, w[1]);
    x = x + matmul(silu_mul(matmul(rms_norm(x, n[1], eps), w[2])), w[3]);
  }
  return x;
}
