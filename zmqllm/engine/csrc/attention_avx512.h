// Decode attention of one (session, kv head) task on AVX-512 (attention_avx512.cpp),
// called by decode_attention.cpp; other targets keep its generic loops.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define ZMQLLM_ATTENTION_AVX512 1

// The scratch attend_avx512 needs for ``len`` keys and ``group`` heads, in floats.
inline int64_t attend_avx512_scratch(int64_t len, int64_t group) {
  return group * ((len + 15) / 16 * 16);
}

// out[g * D, (g + 1) * D) = softmax(scale * q_g . K^T) V for the ``group`` query heads
// q_g = q + g * q_stride against one kv head's keys kc and values vc ([len, D], rows D
// apart; float32, or bfloat16 where ``bf16``), len >= 1; scratch holds
// attend_avx512_scratch floats. Each head's result is the same whichever group it was
// computed in. False (nothing written) where D is not a multiple of 16 up to 128.
bool attend_avx512(const float* q, int64_t q_stride, const void* kc, const void* vc,
                   bool bf16, int64_t len, int64_t D, int64_t group, float scale,
                   float* scratch, float* out);
#endif
