// Decode attention of one (session, kv head) task on AVX-512: its group of query heads
// against the kv head's keys and values, read from memory once.
//
// A key's score is a dot product of D floats: NV = D / 16 vector products whose 16
// lanes then need summing. Summing each key's lanes on its own (a horizontal add per
// key and head) cost more than its products; here 16 keys' partial vectors are summed
// together by a shuffle tree (sum16) into one vector of 16 scores, about three
// operations a key. The keys of a block of 16 stay in L1 while each head of the group
// reads them; the values are read a block at a time in the same way, so a long context
// is fetched from memory once for the whole group.
#include "attention_avx512.h"

#if defined(ZMQLLM_ATTENTION_AVX512)
#include <immintrin.h>

#include <algorithm>

#include "exp_bounded.h"

namespace {

// Heads one pass of attend takes (its per-head maxima and sums live on the stack); a
// larger group (3 in the default model, 4 in Mistral 7B) goes in passes of this many.
constexpr int64_t kMaxGroup = 16;

// 16 cached floats as a vector: float32 as they are, bfloat16 (its bits, uint16_t) widened
// exactly by moving them to the top half of float32's.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// count (a multiple of 16) cached numbers as float32: float32 where they lie, bfloat16
// widened into buf once, so that every head of the group reads floats.
inline const float* as_float(const float* p, int64_t, float*) { return p; }
inline const float* as_float(const uint16_t* p, int64_t count, float* buf) {
  for (int64_t i = 0; i < count; i += 16) _mm512_storeu_ps(buf + i, load16(p + i));
  return buf;
}

// v[j] holds key j's 16 partial sums; the result's lane j is the sum of v[j]'s lanes.
// Four rounds, each adding pairs: within 128-bit lanes by unpack and shuffle, then
// across them.
inline __m512 sum16(const __m512 v[16]) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i) {
    // per 128-bit lane: (a0 + a2, b0 + b2, a1 + a3, b1 + b3) for a = v[2i], b = v[2i + 1]
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    // per 128-bit lane: that lane's sum for keys 4i, 4i + 1, 4i + 2, 4i + 3
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // x0's 128-bit lanes: w[0]'s lanes 0 + 1 and 2 + 3, then w[1]'s; x1 the same of w[2]
  // and w[3]. The last round adds those pairs: lane l of the result is w[l]'s four lanes
  // summed, the scores of keys 4l .. 4l + 3.
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[j0, j0 + 16) = scale * q . k_j for a block of keys from kc (n of them live: the rest
// repeat the last, their scores ignored); returns the scores as a vector.
template <int NV>
inline __m512 score_block(const __m512 qv[NV], const float* kc, int64_t n, float scale) {
  constexpr int64_t D = 16 * NV;
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    const float* k = kc + std::min<int64_t>(j, n - 1) * D;
    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k + 16 * v), a);
    acc[j] = a;
  }
  return _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
}

// out[0, D) += sum_j p[j] * v_j over n value rows from vc; two sets of accumulators
// (even and odd rows) so that each FMA need not wait on the last.
template <int NV>
inline void add_values(const float* p, const float* vc, int64_t n, float* out) {
  constexpr int64_t D = 16 * NV;
  __m512 a[NV], b[NV];
  for (int v = 0; v < NV; ++v) {
    a[v] = _mm512_loadu_ps(out + 16 * v);
    b[v] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
    const float* v0 = vc + j * D;
    for (int v = 0; v < NV; ++v) {
      a[v] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * v), a[v]);
      b[v] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v0 + D + 16 * v), b[v]);
    }
  }
  if (j < n) {
    const __m512 p0 = _mm512_set1_ps(p[j]);
    for (int v = 0; v < NV; ++v)
      a[v] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vc + j * D + 16 * v), a[v]);
  }
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + 16 * v, _mm512_add_ps(a[v], b[v]));
}

template <int NV, typename T>
void attend(const float* q, int64_t q_stride, const T* kc, const T* vc, int64_t len,
            int64_t group, float scale, float* s, float* out) {
  constexpr int64_t D = 16 * NV;
  const int64_t padded = (len + 15) / 16 * 16;
  // bfloat16 keys (16 rows) and values (kBlock rows) widened: 16 KB, in L1.
  constexpr int64_t kBlock = 4096 / D;
  alignas(64) float wide[kBlock * D];
  float mx[kMaxGroup];
  std::fill(mx, mx + group, -INFINITY);
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - j0);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    const float* keys = as_float(kc + j0 * D, n * D, wide);
    for (int64_t g = 0; g < group; ++g) {
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(q + g * q_stride + 16 * v);
      const __m512 sc = score_block<NV>(qv, keys, n, scale);
      _mm512_storeu_ps(s + g * padded + j0, sc);
      mx[g] = std::max(mx[g], _mm512_mask_reduce_max_ps(live, sc));
    }
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * padded;
    const float m = mx[g];
    for (int64_t j = 0; j < len; ++j) sg[j] = exp_bounded(sg[j] - m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - j0);
      sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1),
                                                     sg + j0));
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(sum);
    std::fill(out + g * D, out + (g + 1) * D, 0.f);
  }
  // The values a block at a time (16 KB of them): every head of the group reads a
  // block while it is in L1.
  for (int64_t j0 = 0; j0 < len; j0 += kBlock) {
    const int64_t n = std::min(kBlock, len - j0);
    const float* values = as_float(vc + j0 * D, n * D, wide);
    for (int64_t g = 0; g < group; ++g) {
      add_values<NV>(s + g * padded + j0, values, n, out + g * D);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m512 f = _mm512_set1_ps(inv[g]);
    for (int v = 0; v < NV; ++v) {
      float* o = out + g * D + 16 * v;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), f));
    }
  }
}

}  // namespace

bool attend_avx512(const float* q, int64_t q_stride, const void* kc, const void* vc,
                   bool bf16, int64_t len, int64_t D, int64_t group, float scale,
                   float* scratch, float* out) {
  if (D % 16 != 0 || D < 16 || D > 128 || group < 1) return false;
  for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
    const int64_t g = std::min(kMaxGroup, group - g0);
    const float* qg = q + g0 * q_stride;
    float* og = out + g0 * D;
    switch (D / 16) {
#define ZMQLLM_ATTEND(nv)                                                                \
  case nv:                                                                               \
    if (bf16) {                                                                          \
      attend<nv>(qg, q_stride, static_cast<const uint16_t*>(kc),                         \
                 static_cast<const uint16_t*>(vc), len, g, scale, scratch, og);          \
    } else {                                                                             \
      attend<nv>(qg, q_stride, static_cast<const float*>(kc), static_cast<const float*>(vc), \
                 len, g, scale, scratch, og);                                            \
    }                                                                                    \
    break;
      ZMQLLM_ATTEND(1)
      ZMQLLM_ATTEND(2)
      ZMQLLM_ATTEND(3)
      ZMQLLM_ATTEND(4)
      ZMQLLM_ATTEND(5)
      ZMQLLM_ATTEND(6)
      ZMQLLM_ATTEND(7)
      ZMQLLM_ATTEND(8)
#undef ZMQLLM_ATTEND
    }
  }
  return true;
}
#endif
