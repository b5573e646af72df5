// 16-lane f32 vectors for the native CPU kernels (GCC vector extensions): the type, unaligned
// loads (f32, bf16 and int8 values to f32 lanes), a lane sum and a lane-wise exp.

#ifndef PAXPAGE_NATIVE_SIMD_H_
#define PAXPAGE_NATIVE_SIMD_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace paxpage_native {

constexpr int kLanes = 16;  // f32 lanes of v16: one AVX-512 register

// 16 f32 lanes in GCC's vector extension: -march=native maps it to one AVX-512 register, or
// splits it into two AVX2 / four SSE ones; the fold below stays in registers either way.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline v16 load16(const uint16_t* p) {  // 16 bf16 values (their bits) -> f32: the high half of each
  uint16_t h[kLanes];
  std::memcpy(h, p, sizeof(h));
  v16i bits;
  for (int j = 0; j < kLanes; ++j) bits[j] = static_cast<int32_t>(static_cast<uint32_t>(h[j]) << 16);
  v16 x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline v16 load16(const int8_t* p) {  // 16 int8 values -> f32
#if defined(__AVX512F__)
  // GCC's generic vector conversions extract int8 lanes one at a time (g++ 12): one vpmovsxbd here
  const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  v16 out;
  std::memcpy(&out, &x, sizeof(out));
  return out;
#else
  int8_t h[kLanes];
  std::memcpy(h, p, sizeof(h));
  v16i x;
  for (int j = 0; j < kLanes; ++j) x[j] = h[j];
  return __builtin_convertvector(x, v16);
#endif
}

inline float fold16(v16 x) {  // the sum of the 16 lanes, by halving shuffles
  x += __builtin_shuffle(x, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x += __builtin_shuffle(x, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x += __builtin_shuffle(x, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x += __builtin_shuffle(x, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return x[0];
}

// exp(x) lane-wise for x <= 0: 2^n * poly(r), n = round(x / ln 2) (by the 1.5 * 2^23 trick, whose
// low mantissa bits then hold n), r = x - n ln 2; relative error ~2e-7. Inputs below -87 (-inf
// included) give ~1e-38, a weight that vanishes next to the maximum's 1.
inline v16 exp16(v16 x) {
  const v16 lowest = v16{} - 87.0f;
  x = x < lowest ? lowest : x;
  const float magic = 12582912.0f;  // 0x4B400000
  const v16 t = x * 1.44269504f + magic;
  const v16 n = t - magic;
  const v16 r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  v16 p = r * (1.0f / 720) + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v16i scale = (((v16i)t - 0x4B400000) + 127) << 23;
  return p * (v16)scale;
}

}  // namespace paxpage_native

#endif  // PAXPAGE_NATIVE_SIMD_H_
