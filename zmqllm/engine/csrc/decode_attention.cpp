// Decode attention of many sessions in one call (CPU, float32).
//
// Each session brings one new token (a decode step) and owns its own KV cache
// tensor [num_layers, KVH, max_len, D]. In Python that is a loop of ~10 small
// tensor ops per session per layer; here it is one call per layer that writes
// the new key/value rows into every cache and attends, in parallel over
// (session, kv head). Grouped-query attention: the H / KVH query heads sharing
// a kv head are read against that head's keys in one pass.
#include <torch/extension.h>
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

// exp(x) for x <= 0 (scores minus their max), branch-free so the compiler
// vectorizes the softmax loop. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
// a degree-6 polynomial for exp(r), then 2^n built in the exponent bits; about
// 1 ulp, like the vectorized exp PyTorch's attention kernel uses.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below, exp is under 2^-125: nothing next to the max's 1
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

}  // namespace

// The decode sessions of one forward, built once and used by every layer.
// kcache, vcache: per session [num_layers, KVH, max_len, D], contiguous float32;
// rows[i]: the row of session i in the flat batch; pos[i]: where its token goes
// in the cache (its past length); lo[i]: the first key it sees (sliding window).
struct DecodeBatch {
  std::vector<torch::Tensor> kcache, vcache;
  std::vector<int64_t> rows, pos, lo;

  DecodeBatch(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v, std::vector<int64_t> r,
              std::vector<int64_t> p, std::vector<int64_t> l)
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
};

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

  at::parallel_for(0, n * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t i = it / KVH, kh = it % KVH, row = rows[i];
      const int64_t max_len = kcache[i].size(2);
      // This layer's, this head's [max_len, D] block of the session's cache.
      const int64_t block = (layer * KVH + kh) * max_len * D;
      float* kc = kcache[i].data_ptr<float>() + block;
      float* vc = vcache[i].data_ptr<float>() + block;
      std::memcpy(kc + pos[i] * D, kn_p + row * k_new.stride(0) + kh * k_new.stride(1),
                  D * sizeof(float));
      std::memcpy(vc + pos[i] * D, vn_p + row * v_new.stride(0) + kh * v_new.stride(1),
                  D * sizeof(float));
      const int64_t first = lo[i], len = pos[i] + 1 - first;
      scores.resize(G * len);
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = q_p + row * q.stride(0) + (kh * G + g) * q.stride(1);
        float* s = scores.data() + g * len;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j) {
          s[j] = dot(qr, kc + (first + j) * D, D) * fscale;
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j < len; ++j) s[j] = exp_nonpositive(s[j] - mx);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) sum += s[j];
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const float* vr = vc + (first + j) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + j];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        std::memcpy(out_p + row * H * D + (kh * G + g) * D, acc.data() + g * D, D * sizeof(float));
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeBatch>(m, "DecodeBatch")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>());
  m.def("decode_attention", &decode_attention,
        "write one new key/value row per session and attend, all sessions in one call");
}
