// Paged attention on CPU as an XLA FFI custom call: the semantics of
// pallas_kernels/reference.py `paged_attention_ref` (row layout, causal, optional sliding window
// and soft cap, GQA), reading each row's K/V pages once, straight from the pool.
//
// Axis legend: B rows, Tq query tokens per row, N query heads, K kv heads, G = N / K, D head dim,
// P pages.
//
// Operands: q f32[B, Tq, N, D] (already f32; the Python wrapper casts), kv_pages f32, bf16, int8
// or float8_e4m3fn [2, P, page_size, K, D], kv_scales f32 or bf16 [2, P, page_size, K] for an
// int8 / fp8 pool (token j of head h holds kv_pages[..., j, h, :] * kv_scales[..., j, h]) or f32[0]
// for a plain one, page_indices i32[B, pages_per_seq], kv_lens i32[B], q_lens i32[B],
// sinks f32[N] (gpt-oss: a per-query-head logit in the softmax's denominator only) or f32[0] for none.
// Attributes: sm_scale, sliding_window (0 = none), soft_cap (0 = none). Result f32[B, Tq, N, D].
//
// Work items are rows (decode steps, Tq == 1: every kv head, each page read once front to back)
// or (row, kv head) pairs (Tq > 1, so a step of a few prefill rows still spreads), spread over
// XLA's intra-op pool by parallel.h.
//
// Per item: each query head (scaled by sm_scale) folds the row's pages into an online softmax in
// f32, page by page. A query at position p = kv_len - q_len + t sees keys max(0, p - W + 1)..p;
// values of keys it cannot see are never read, so stale or NaN slots cannot reach the output
// (their scores may be computed, then replaced by -inf). Query tokens t >= q_len (and padding
// rows, q_len 0) are zeros, as in the reference. A sink joins the normaliser once, after the
// last page: l * exp(m - m') + exp(sink - m') with m' = max(m, sink), so the fold is unchanged.
//
// Speed (decode, memory-bound): head dims that are multiples of 16 run in 16-lane vectors
// (GCC vector extensions: AVX-512 with -march=native, split into narrower registers elsewhere);
// with page_size % 16 == 0 the scores of 16 keys are reduced together by a shuffle tree, exp is a
// vectorised polynomial, and the accumulators stay in registers across a page's keys. Other head
// dims take plain loops. A quantised pool is read as stored (1 byte a value): a key's score is its
// scale times q . k, and a value's weight p times its scale, so nothing is dequantised in memory.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace paxpage_native;  // simd.h, parallel.h
using paxpage_native::load16;  // overloaded below for fp8: a using-directive alone would be hidden

// Pages ahead whose lines are prefetched (tiny 256 x 1536 on the 2-core EPYC: 1-4 within noise).
constexpr int64_t kPrefetchPages = 2;

// A non-temporal prefetch of the line holding p. Inline asm on x86: GCC's vectoriser deletes
// __builtin_prefetch from the loops it vectorises, which left the built library without a single
// prefetch instruction.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetchnta %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 0);
#endif
}

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {  // bf16 -> f32: the high half of the f32 bits
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// int8 values of a quantised pool (the scale applies outside: see attend).
inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }

// float8_e4m3fn values (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities,
// S.1111.111 is NaN), decoded through a 256-entry table.
struct Fp8 {
  uint8_t bits;
};

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      float x = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 15 && mantissa == 7) x = std::numeric_limits<float>::quiet_NaN();
      value[b] = (b & 128) ? -x : x;
    }
  }
};
const Fp8Table kFp8;

inline float load(const Fp8* p, int64_t i) { return kFp8.value[p[i].bits]; }

inline v16 load16(const Fp8* p) {
  v16 x;
  for (int j = 0; j < kLanes; ++j) x[j] = kFp8.value[p[j].bits];
  return x;
}

// Pools stored with a scale per (token, kv head).
template <typename KV>
constexpr bool kScaled = std::is_same_v<KV, int8_t> || std::is_same_v<KV, Fp8>;

// Demand-loads every 64-byte line of [k, k + bytes) and of [v, v + bytes), the two runs
// interleaved in address order (the result is discarded). Folding a page reads it head by head, a
// strided order that leaves few misses in flight; loading it line by line first keeps many in
// flight, and the fold then reads L1. With the spread prefetch in run_item, tiny 256 x 1536 went
// from 18 to 32-35 GB/s (kernel alone, one layer; shared 2-core EPYC).
inline void touch_lines(const char* k, const char* v, int64_t bytes) {
  v16 x = {}, y = {};
  for (int64_t off = 0; off < bytes; off += 64) {
    v16 a, b;
    std::memcpy(&a, k + off, sizeof(a));
    std::memcpy(&b, v + off, sizeof(b));
    x += a;
    y += b;
  }
  x += y;
  asm volatile("" : : "x"(x[0]));
}

inline float fold16_max(v16 x) {  // the largest of the 16 lanes
  v16 y = __builtin_shuffle(x, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x = x > y ? x : y;
  y = __builtin_shuffle(x, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x = x > y ? x : y;
  y = __builtin_shuffle(x, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x = x > y ? x : y;
  y = __builtin_shuffle(x, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  x = x > y ? x : y;
  return x[0];
}

// The 16 lane sums of a[0..15] as one vector (lane j: the sum of a[j]), by a transposing tree
// of two-input shuffles: 45 vector ops for 16 sums where 16 separate folds take 128.
inline v16 fold16x16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: key i, 8-15: key i + 8
    b[i] = __builtin_shuffle(a[i], a[i + 8], v16i{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(a[i], a[i + 8], v16i{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; ++i)  // quads: keys i, i + 4, i + 8, i + 12
    c[i] = __builtin_shuffle(b[i], b[i + 4], v16i{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(b[i], b[i + 4], v16i{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  for (int i = 0; i < 2; ++i)  // pairs: keys i, i + 2, ..., i + 14
    d[i] = __builtin_shuffle(c[i], c[i + 2], v16i{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(c[i], c[i + 2], v16i{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  return __builtin_shuffle(d[0], d[1], v16i{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
         __builtin_shuffle(d[0], d[1], v16i{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

// dot(q, k) over d. D > 0: the head dim known at compile time, a multiple of 16 (vector
// lanes, fully unrolled); D == 0: any d_len, kLanes partial sums in a plain loop.
template <int D, typename KV>
inline float dot(const float* q, const KV* k, int64_t d_len) {
  if constexpr (D > 0) {
    static_assert(D % kLanes == 0);
    v16 acc = load16(q) * load16(k);
    for (int d0 = kLanes; d0 < D; d0 += kLanes) acc += load16(q + d0) * load16(k + d0);
    return fold16(acc);
  } else {
    float part[kLanes] = {};
    int64_t d0 = 0;
    for (; d0 + kLanes <= d_len; d0 += kLanes) {
      for (int j = 0; j < kLanes; ++j) part[j] += q[d0 + j] * load(k, d0 + j);
    }
    for (int64_t d = d0; d < d_len; ++d) part[d - d0] += q[d] * load(k, d);
    float sum = 0.0f;
    for (int j = 0; j < kLanes; ++j) sum += part[j];
    return sum;
  }
}

template <int D, typename KV>
inline void axpy(float* acc, float p, const KV* v, int64_t d_len) {
  if (D) d_len = D;
  for (int64_t d = 0; d < d_len; ++d) acc[d] += p * load(v, d);
}

struct Problem {
  const float* q;
  const void* kv;
  const void* scales;  // [2, P, page_size, K] of a quantised pool, f32 or bf16 (scales_bf16); else nullptr
  bool scales_bf16;
  const int32_t* page_indices;
  const int32_t* kv_lens;
  const int32_t* q_lens;
  const float* sinks;  // f32[N], or nullptr: none
  float* out;
  int64_t batch, num_q, num_heads, head_dim, num_pages, page_size, num_kv_heads, pages_per_seq;
  int64_t heads_per_item;  // kv heads of one work item: all of them for decode steps
  float sm_scale;
  int64_t window;  // 0: none
  float soft_cap;  // 0: none
};

// Scratch of one thread, reused across items and calls.
struct Scratch {
  std::vector<float> q, acc, m, l, s, ks, vs;
};

inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Keys [first, last) of one page, one kv head: key j at k + j * stride, its value at v + j * stride;
// for a quantised pool their scales ks[j], vs[j] (padded(page_size) floats each, 0 past the page).
template <typename KV>
struct Block {
  const KV* k;
  const KV* v;
  int64_t stride, first, last;
  const float* ks = nullptr;
  const float* vs = nullptr;
};

// Folds one page's keys into the online softmax of the G query heads q [G, D] that share a kv
// head: acc [G, D], running max m [G] and sum l [G]; s: scratch of G * padded(page_size) floats.
template <int D, typename KV>
inline void attend(const Problem& pr, const Block<KV>& blk, int64_t group, int64_t d_len,
                   const float* q, float* acc, float* m, float* l, float* s) {
  const int64_t width = padded(pr.page_size);
  if constexpr (D > 0) {
    constexpr int C = D / kLanes;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < group; ++g) {
      float* sg = s + g * width;
      v16 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = load16(q + g * D + c * kLanes);
      if (pr.page_size % kLanes == 0) {
        // Whole groups of 16 keys (slots outside [first, last) may hold anything, even NaN:
        // their scores are replaced by -inf, and their values are never read).
        for (int64_t j0 = 0; j0 < width; j0 += kLanes) {
          v16 a[kLanes];
          for (int j = 0; j < kLanes; ++j) {
            const KV* kj = blk.k + (j0 + j) * blk.stride;
            a[j] = qv[0] * load16(kj);
            for (int c = 1; c < C; ++c) a[j] += qv[c] * load16(kj + c * kLanes);
          }
          v16 sc = fold16x16(a);
          if constexpr (kScaled<KV>) sc *= load16(blk.ks + j0);
          for (int j = 0; j < kLanes; ++j)
            if (j0 + j < blk.first || j0 + j >= blk.last) sc[j] = neg_inf;
          std::memcpy(sg + j0, &sc, sizeof(sc));
        }
      } else {
        for (int64_t j = 0; j < blk.first; ++j) sg[j] = neg_inf;
        for (int64_t j = blk.first; j < blk.last; ++j) {
          const KV* kj = blk.k + j * blk.stride;
          v16 a = qv[0] * load16(kj);
          for (int c = 1; c < C; ++c) a += qv[c] * load16(kj + c * kLanes);
          sg[j] = fold16(a);
          if constexpr (kScaled<KV>) sg[j] *= blk.ks[j];
        }
        for (int64_t j = blk.last; j < width; ++j) sg[j] = neg_inf;
      }
      if (pr.soft_cap > 0.0f)
        for (int64_t j = blk.first; j < blk.last; ++j) sg[j] = pr.soft_cap * std::tanh(sg[j] / pr.soft_cap);
      v16 mx = load16(sg);
      for (int64_t j = kLanes; j < width; j += kLanes) {
        const v16 x = load16(sg + j);
        mx = mx > x ? mx : x;
      }
      const float m_new = std::max(m[g], fold16_max(mx));
      const float alpha = std::exp(m[g] - m_new);  // m = -inf: 0
      v16 sum = {};
      for (int64_t j = 0; j < width; j += kLanes) {
        const v16 e = exp16(load16(sg + j) - m_new);
        std::memcpy(sg + j, &e, sizeof(e));
        sum += e;
      }
      l[g] = alpha * l[g] + fold16(sum);
      m[g] = m_new;
      v16 a[C];  // this head's accumulator, in registers across the page's keys
      for (int c = 0; c < C; ++c) a[c] = load16(acc + g * D + c * kLanes) * alpha;
      for (int64_t j = blk.first; j < blk.last; ++j) {
        const KV* vj = blk.v + j * blk.stride;
        float p = sg[j];
        if constexpr (kScaled<KV>) p *= blk.vs[j];
        for (int c = 0; c < C; ++c) a[c] += p * load16(vj + c * kLanes);
      }
      for (int c = 0; c < C; ++c) std::memcpy(acc + g * D + c * kLanes, &a[c], sizeof(v16));
    }
  } else {  // any head dim: scalar loops the compiler vectorises over d where it can
    for (int64_t g = 0; g < group; ++g) {
      float* sg = s + g * width;
      const float* qg = q + g * d_len;
      float* ag = acc + g * d_len;
      float page_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = blk.first; j < blk.last; ++j) {
        float x = dot<0>(qg, blk.k + j * blk.stride, d_len);
        if constexpr (kScaled<KV>) x *= blk.ks[j];
        if (pr.soft_cap > 0.0f) x = pr.soft_cap * std::tanh(x / pr.soft_cap);
        sg[j] = x;
        page_max = std::max(page_max, x);
      }
      const float m_new = std::max(m[g], page_max);
      const float alpha = std::exp(m[g] - m_new);
      float sum = 0.0f;
      for (int64_t d = 0; d < d_len; ++d) ag[d] *= alpha;
      for (int64_t j = blk.first; j < blk.last; ++j) {
        const float p = std::exp(sg[j] - m_new);
        sum += p;
        axpy<0>(ag, kScaled<KV> ? p * blk.vs[j] : p, blk.v + j * blk.stride, d_len);
      }
      l[g] = alpha * l[g] + sum;
      m[g] = m_new;
    }
  }
}

// One work item: row b's kv heads [kh0, kh0 + heads_per_item), every query token. Pages are the
// outer loop, so a decode row reads each page of its pool once, front to back.
template <int D, typename KV>
void run_item(const Problem& pr, int64_t item, Scratch& sc) {
  const int64_t items_per_row = pr.num_kv_heads / pr.heads_per_item;
  const int64_t b = item / items_per_row, kh0 = (item % items_per_row) * pr.heads_per_item;
  const int64_t kh1 = kh0 + pr.heads_per_item;
  const int64_t group = pr.num_heads / pr.num_kv_heads, d_len = D ? D : pr.head_dim;
  const int64_t capacity = pr.pages_per_seq * pr.page_size;
  const int64_t kv_len = std::clamp<int64_t>(pr.kv_lens[b], 0, capacity);
  const int64_t q_len = std::clamp<int64_t>(pr.q_lens[b], 0, pr.num_q);
  const int64_t base = kv_len - q_len;  // position of query token 0
  // Query vector m = (t * heads_per_item + (kh - kh0)) * G + g is head kh * G + g of token t.
  const int64_t heads = pr.heads_per_item * group;
  const int64_t num_m = q_len * heads;
  auto head_row = [&](const float* x, int64_t t) {  // [N, D] of token t, from head kh0 * G
    return x + ((b * pr.num_q + t) * pr.num_heads + kh0 * group) * d_len;
  };
  for (int64_t t = q_len; t < pr.num_q; ++t) {
    float* dst = const_cast<float*>(head_row(pr.out, t));
    std::fill(dst, dst + heads * d_len, 0.0f);
  }
  if (num_m == 0) return;

  sc.q.resize(num_m * d_len);
  sc.acc.assign(num_m * d_len, 0.0f);
  sc.m.assign(num_m, -std::numeric_limits<float>::infinity());
  sc.l.assign(num_m, 0.0f);
  sc.s.resize(group * padded(pr.page_size));
  const int64_t width = padded(pr.page_size);
  if constexpr (kScaled<KV>) {  // [heads_per_item, width] each: one page's scales, as f32
    sc.ks.assign(pr.heads_per_item * width, 0.0f);
    sc.vs.assign(pr.heads_per_item * width, 0.0f);
  }
  for (int64_t t = 0; t < q_len; ++t) {
    const float* src = head_row(pr.q, t);
    float* dst = sc.q.data() + t * heads * d_len;
    for (int64_t i = 0; i < heads * d_len; ++i) dst[i] = src[i] * pr.sm_scale;
  }

  // Keys any query of the item sees: [lo, kv_len).
  const int64_t lo = pr.window > 0 ? std::max<int64_t>(0, base - pr.window + 1) : 0;
  const KV* pool = static_cast<const KV*>(pr.kv);
  const int64_t token_stride = pr.num_kv_heads * d_len;
  const int64_t half = pr.num_pages * pr.page_size * token_stride;  // K pages, then V pages
  const int32_t* table = pr.page_indices + b * pr.pages_per_seq;
  float* s = sc.s.data();  // [G, padded page_size] scores of one (token, kv head)
  const int64_t end_page = (kv_len + pr.page_size - 1) / pr.page_size;
  // Pages are scattered in the pool, so the hardware prefetcher cannot run ahead across them. The
  // item's slice of the page kPrefetchPages ahead is requested (K and V) while this one is folded,
  // a share of it before each kv head's fold (requests spread through the compute keep misses in
  // flight all along; issued at once, most wait); this page's slice is loaded line by line before
  // its fold.
  const int64_t slice_bytes = pr.heads_per_item * d_len * static_cast<int64_t>(sizeof(KV));
  const int64_t v_offset = half * static_cast<int64_t>(sizeof(KV));
  auto page_slice = [&](int64_t pi, int64_t j) {  // token j of page pi's item slice, K half
    const KV* k = pool + std::clamp<int64_t>(table[pi], 0, pr.num_pages - 1) * pr.page_size * token_stride;
    return reinterpret_cast<const char*>(k + j * token_stride + kh0 * d_len);
  };
  auto prefetch = [&](int64_t pi, int64_t part, int64_t parts) {  // share `part` of `parts` of its tokens
    for (int64_t j = part * pr.page_size / parts; j < (part + 1) * pr.page_size / parts; ++j) {
      const char* kj = page_slice(pi, j);
      for (int64_t off = 0; off < slice_bytes; off += 64) {
        prefetch_line(kj + off);
        prefetch_line(kj + v_offset + off);
      }
    }
  };
  auto touch = [&](int64_t pi) {
    if (pr.heads_per_item == pr.num_kv_heads) {  // the whole page: one run of K, one of V
      touch_lines(page_slice(pi, 0), page_slice(pi, 0) + v_offset, pr.page_size * slice_bytes);
      return;
    }
    for (int64_t j = 0; j < pr.page_size; ++j)
      touch_lines(page_slice(pi, j), page_slice(pi, j) + v_offset, slice_bytes);
  };
  const int64_t first_page = lo / pr.page_size;
  for (int64_t pi = first_page; pi < std::min(end_page, first_page + kPrefetchPages); ++pi) prefetch(pi, 0, 1);
  // Decode items (one query token, every kv head) spread the request over the heads' folds.
  const bool spread = pr.num_q == 1 && pr.heads_per_item > 1;
  for (int64_t pi = first_page; pi < end_page; ++pi) {
    const int64_t ahead = pi + kPrefetchPages < end_page ? pi + kPrefetchPages : -1;
    if (ahead >= 0 && !spread) prefetch(ahead, 0, 1);
    touch(pi);
    const int64_t page = std::clamp<int64_t>(table[pi], 0, pr.num_pages - 1);
    const int64_t s0 = pi * pr.page_size;
    const KV* k_page = pool + page * pr.page_size * token_stride;
    const KV* v_page = k_page + half;
    if constexpr (kScaled<KV>) {  // the page's scales of the item's heads (slots past kv_len too:
      // their scores are replaced and their values never read, whatever they hold)
      const int64_t per_half = pr.num_pages * pr.page_size * pr.num_kv_heads;
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        float* ks = sc.ks.data() + (kh - kh0) * width;
        float* vs = sc.vs.data() + (kh - kh0) * width;
        for (int64_t j = 0; j < pr.page_size; ++j) {
          const int64_t i = (page * pr.page_size + j) * pr.num_kv_heads + kh;  // (K half, page, j, kh)
          if (pr.scales_bf16) {
            ks[j] = load(static_cast<const uint16_t*>(pr.scales), i);
            vs[j] = load(static_cast<const uint16_t*>(pr.scales), i + per_half);
          } else {
            ks[j] = static_cast<const float*>(pr.scales)[i];
            vs[j] = static_cast<const float*>(pr.scales)[i + per_half];
          }
        }
      }
    }
    for (int64_t t = 0; t < q_len; ++t) {
      const int64_t pos = base + t;
      const int64_t first = std::max(s0, pr.window > 0 ? pos - pr.window + 1 : int64_t{0}) - s0;
      const int64_t last = std::min(s0 + pr.page_size, pos + 1) - s0;  // exclusive, page-relative
      if (first >= last) continue;
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        if (ahead >= 0 && spread) prefetch(ahead, kh - kh0, pr.heads_per_item);
        const int64_t m0 = (t * pr.heads_per_item + (kh - kh0)) * group;
        const Block<KV> blk{k_page + kh * d_len, v_page + kh * d_len, token_stride, first, last,
                            sc.ks.data() + (kh - kh0) * width, sc.vs.data() + (kh - kh0) * width};
        attend<D>(pr, blk, group, d_len, sc.q.data() + m0 * d_len, sc.acc.data() + m0 * d_len,
                  sc.m.data() + m0, sc.l.data() + m0, s);
      }
    }
  }
  for (int64_t t = 0; t < q_len; ++t) {
    float* dst = const_cast<float*>(head_row(pr.out, t));
    for (int64_t i = 0; i < heads; ++i) {
      const int64_t m = t * heads + i;
      float l = sc.l[m], rescale = 1.0f;
      if (pr.sinks != nullptr) {  // query head kh0 * G + i; m = -inf (no key seen) gives rescale 0
        const float sink = pr.sinks[kh0 * group + i], top = std::max(sc.m[m], sink);
        rescale = std::exp(sc.m[m] - top);
        l = l * rescale + std::exp(sink - top);
      }
      const float inv = l > 0.0f ? rescale / l : 0.0f;
      for (int64_t d = 0; d < d_len; ++d) dst[i * d_len + d] = sc.acc[m * d_len + d] * inv;
    }
  }
}

template <typename KV>
void run_item_any_dim(const Problem& pr, int64_t item, Scratch& sc) {
  switch (pr.head_dim) {
    case 16: return run_item<16, KV>(pr, item, sc);
    case 32: return run_item<32, KV>(pr, item, sc);
    case 64: return run_item<64, KV>(pr, item, sc);
    case 128: return run_item<128, KV>(pr, item, sc);
    case 256: return run_item<256, KV>(pr, item, sc);
    default: return run_item<0, KV>(pr, item, sc);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                          ffi::AnyBuffer kv_scales, ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::F32> sinks, float sm_scale, int64_t sliding_window,
                          float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv_pages.dimensions();
  const auto table_dims = page_indices.dimensions();
  if (q_dims.size() != 4 || kv_dims.size() != 5 || table_dims.size() != 2 || kv_dims[0] != 2)
    return ffi::Error::InvalidArgument("paged_attention_cpu: unexpected operand ranks");
  const auto kv_type = kv_pages.element_type();
  const bool quantised = kv_type == ffi::DataType::S8 || kv_type == ffi::DataType::F8E4M3FN;
  if (kv_type != ffi::DataType::F32 && kv_type != ffi::DataType::BF16 && !quantised)
    return ffi::Error::InvalidArgument("paged_attention_cpu: kv_pages must be f32, bf16, int8 or float8_e4m3fn");
  const auto scale_type = kv_scales.element_type();
  const auto scale_dims = kv_scales.dimensions();
  if (quantised != (kv_scales.element_count() > 0) ||
      (quantised && (scale_dims.size() != 4 || scale_dims[0] != 2 || scale_dims[1] != kv_dims[1] ||
                     scale_dims[2] != kv_dims[2] || scale_dims[3] != kv_dims[3] ||
                     (scale_type != ffi::DataType::F32 && scale_type != ffi::DataType::BF16))))
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: an int8 / fp8 pool needs f32 or bf16 kv_scales [2, P, page_size, K], "
        "a plain one f32[0]");
  Problem pr;
  pr.q = q.typed_data();
  pr.kv = kv_pages.untyped_data();
  pr.scales = quantised ? kv_scales.untyped_data() : nullptr;
  pr.scales_bf16 = scale_type == ffi::DataType::BF16;
  pr.page_indices = page_indices.typed_data();
  pr.kv_lens = kv_lens.typed_data();
  pr.q_lens = q_lens.typed_data();
  pr.sinks = sinks.element_count() > 0 ? sinks.typed_data() : nullptr;
  pr.out = out->typed_data();
  pr.batch = q_dims[0];
  pr.num_q = q_dims[1];
  pr.num_heads = q_dims[2];
  pr.head_dim = q_dims[3];
  pr.num_pages = kv_dims[1];
  pr.page_size = kv_dims[2];
  pr.num_kv_heads = kv_dims[3];
  pr.pages_per_seq = table_dims[1];
  pr.sm_scale = sm_scale;
  pr.window = sliding_window;
  pr.soft_cap = soft_cap;
  if (pr.num_kv_heads <= 0 || pr.num_heads % pr.num_kv_heads != 0 || kv_dims[4] != pr.head_dim ||
      table_dims[0] != pr.batch || pr.num_pages <= 0 ||
      (sinks.element_count() != 0 && sinks.element_count() != pr.num_heads))
    return ffi::Error::InvalidArgument("paged_attention_cpu: inconsistent operand shapes");
  // Decode steps: one item per row (its pages read front to back once); longer query blocks
  // split rows by kv head too, so a step of a few prefill rows still spreads over the threads.
  pr.heads_per_item = pr.num_q == 1 ? pr.num_kv_heads : 1;
  const int64_t num_items = pr.batch * (pr.num_kv_heads / pr.heads_per_item);
  parallel_for(pool, num_items, 4, [&pr, kv_type](int64_t item) {
    thread_local Scratch scratch;
    switch (kv_type) {
      case ffi::DataType::BF16: return run_item_any_dim<uint16_t>(pr, item, scratch);
      case ffi::DataType::S8: return run_item_any_dim<int8_t>(pr, item, scratch);
      case ffi::DataType::F8E4M3FN: return run_item_any_dim<Fp8>(pr, item, scratch);
      default: return run_item_any_dim<float>(pr, item, scratch);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxpagePagedAttentionCpu, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // q
                                  .Arg<ffi::AnyBuffer>()           // kv_pages
                                  .Arg<ffi::AnyBuffer>()           // kv_scales: [2, P, page_size, K] or f32[0]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()    // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()    // q_lens
                                  .Arg<ffi::Buffer<ffi::F32>>()    // sinks: f32[N] or f32[0]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
