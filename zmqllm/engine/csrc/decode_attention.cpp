// Decode attention of many sessions in one call (CPU; float32 math over float32 or
// bfloat16 caches).
//
// Each session brings one new token (a decode step) and owns its own KV cache
// tensor [num_layers, KVH, max_len, D]. In Python that is a loop of ~10 small
// tensor ops per session per layer; here it is one call per layer that writes
// the new key/value rows into every cache and attends, in parallel over
// (session, kv head). Grouped-query attention: the H / KVH query heads sharing
// a kv head are read against that head's keys in one pass.
#include "ops.h"

#include "attention_avx512.h"
#include "exp_bounded.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

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

// A new key or value row of D numbers into the cache at dst (float32, or bfloat16
// rounded by PyTorch's own conversion, so that a row written here and one copied in by
// a prompt's forward agree).
inline void store_row(void* dst, const float* src, int64_t D, bool bf16) {
  if (!bf16) {
    std::memcpy(dst, src, D * sizeof(float));
    return;
  }
  c10::BFloat16* d = static_cast<c10::BFloat16*>(dst);
  for (int64_t j = 0; j < D; ++j) d[j] = c10::BFloat16(src[j]);
}

// n bfloat16 numbers widened (exactly) into buf; returns its data.
inline const float* widen_rows(const c10::BFloat16* src, int64_t n, std::vector<float>& buf) {
  buf.assign(src, src + n);
  return buf.data();
}

}  // namespace

// The decode sessions of one forward (ops.h): its checks.
DecodeBatch::DecodeBatch(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v,
                         std::vector<int64_t> r, std::vector<int64_t> p, std::vector<int64_t> l)
    : kcache(std::move(k)), vcache(std::move(v)), rows(std::move(r)), pos(std::move(p)),
      lo(std::move(l)) {
  const size_t n = rows.size();
  TORCH_CHECK(kcache.size() == n && vcache.size() == n && pos.size() == n && lo.size() == n,
              "DecodeBatch: one cache pair, row, position and window start per session");
  const auto dtype = n > 0 ? kcache[0].scalar_type() : torch::kFloat32;
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "DecodeBatch: caches must be float32 or bfloat16");
  bf16 = dtype == torch::kBFloat16;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(kcache[i].dim() == 4 && kcache[i].sizes() == vcache[i].sizes(),
                "DecodeBatch: caches are [layers, kv heads, max_len, head dim]");
    TORCH_CHECK(kcache[i].scalar_type() == dtype && kcache[i].is_contiguous() &&
                    vcache[i].scalar_type() == dtype && vcache[i].is_contiguous(),
                "DecodeBatch: caches must be contiguous, all float32 or all bfloat16");
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
  const bool bf16 = batch.bf16;
  const int64_t size = bf16 ? 2 : 4;  // bytes of a cached number
  for (int64_t it = 0; it < n * KVH; ++it) {
    const int64_t i = it / KVH, kh = it % KVH;
    const int64_t at = ((layer * KVH + kh) * kcache[i].size(2) + pos[i]) * D * size;
    store_row(static_cast<char*>(kcache[i].data_ptr()) + at,
              kn_p + rows[i] * k_new.stride(0) + kh * k_new.stride(1), D, bf16);
    store_row(static_cast<char*>(vcache[i].data_ptr()) + at,
              vn_p + rows[i] * v_new.stride(0) + kh * v_new.stride(1), D, bf16);
  }
  // One task per (session, kv head), its G query heads reading the keys while they
  // are in cache; with fewer such tasks than twice the threads (a single stream: 3
  // kv heads on 2 threads, one thread idle a third of the time), one per query head.
  const int64_t per = n * KVH >= 2 * at::get_num_threads() ? G : 1;
  const int64_t units = n * KVH * (G / per);
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, kwide, vwide;
    std::vector<float> acc(G * D);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t head0 = (u % (H / per)) * per;  // first query head of this task
      const int64_t i = u / (H / per), kh = head0 / G, row = rows[i];
      const int64_t first = lo[i], len = pos[i] + 1 - first;
      // This layer's, this head's rows [first, pos] of the session's [max_len, D] cache.
      const int64_t at = ((layer * KVH + kh) * kcache[i].size(2) + first) * D * size;
      const void* kc = static_cast<const char*>(kcache[i].data_ptr()) + at;
      const void* vc = static_cast<const char*>(vcache[i].data_ptr()) + at;
      const float* q0 = q_p + row * q.stride(0) + head0 * q.stride(1);
      float* out0 = out_p + row * H * D + head0 * D;
#if defined(ZMQLLM_ATTENTION_AVX512)
      scores.resize(attend_avx512_scratch(len, per));
      if (attend_avx512(q0, q.stride(1), kc, vc, bf16, len, D, per, fscale, scores.data(),
                        out0)) {
        continue;
      }
#endif
      const float* kr = static_cast<const float*>(kc);
      const float* vr = static_cast<const float*>(vc);
      if (bf16) {  // the generic loops read float32: widen this task's rows first
        kr = widen_rows(static_cast<const c10::BFloat16*>(kc), len * D, kwide);
        vr = widen_rows(static_cast<const c10::BFloat16*>(vc), len * D, vwide);
      }
      scores.resize(per * len);
      for (int64_t g = 0; g < per; ++g) {
        const float* qr = q0 + g * q.stride(1);
        float* s = scores.data() + g * len;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j) {
          s[j] = dot(qr, kr + j * D, D) * fscale;
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j < len; ++j) s[j] = exp_bounded(s[j] - mx);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) sum += s[j];
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.begin() + per * D, 0.f);
      for (int64_t j = 0; j < len; ++j) {
        for (int64_t g = 0; g < per; ++g) {
          const float p = scores[g * len + j];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[j * D + d];
        }
      }
      std::memcpy(out0, acc.data(), per * D * sizeof(float));
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
