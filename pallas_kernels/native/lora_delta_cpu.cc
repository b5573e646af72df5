// The mixed-adapter LoRA delta of one linear layer on CPU as an XLA FFI custom call: the
// semantics of pallas_kernels/native_lora.py `lora_delta_ref` (and models/lora_ops.py).
//
// Axis legend: T tokens, S slots, I input width, R rank, O output width.
//
// Operands: x f32[T, I], a f32[S, I, R], b f32[S, R, O], token_slots i32[T] (-1, or any slot
// outside [0, S): the base model). Result: delta f32[T, O], row t = (x[t] @ a[s]) @ b[s] for
// s = token_slots[t], exactly 0 for base tokens.
//
// Tokens are grouped by slot (a counting sort), and each work item is up to kTokens tokens of
// one slot: every row of A[s] and B[s] read is used by all of them while it is in registers, and
// consecutive items of one slot find A and B in cache. h = x[t] @ A[s] runs 16 ranks per vector
// (two partial sums, even and odd i, each in order, then added), then delta[t] = h @ B[s] 16
// outputs per vector, four vectors per pass over B's rows (a sum over r in order). Each token's
// sums have that fixed order, whatever the other tokens of the step or of its item (every item
// size runs the same expression per token), so its row is the same alone and in any batch.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace paxpage_native;  // simd.h, parallel.h

constexpr int kTokens = 4;   // tokens of one slot per work item (their accumulators in registers)
constexpr int kMaxRank = 256;  // h's buffer per token; larger ranks are refused

struct Operands {
  const float* x;
  const float* a;
  const float* b;
  float* out;
  int64_t in, rank, out_width;
};

// Up to 16 floats from p (n of them, the rest 0), and the store of n lanes back.
inline v16 load_n(const float* p, int64_t n) {
  if (n == kLanes) return load16(p);
  v16 v = {};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}

inline void store_n(float* p, v16 v, int64_t n) { std::memcpy(p, &v, n * sizeof(float)); }

// h[j][r, r + 16) = x_j @ A[:, r, r + 16) for N tokens, n <= 16 ranks of A's rows (the rest 0).
// Two partial sums per token (even and odd i) keep twice as many FMA chains in flight; they add
// in that order at the end.
template <int N, bool kFull>
inline void x_times_a(const float* const* x, const float* a, int64_t in, int64_t rank, int64_t r, int64_t n,
                      float (*h)[kMaxRank]) {
  v16 even[N], odd[N];
  for (int j = 0; j < N; ++j) even[j] = odd[j] = v16{};
  auto row = [&](int64_t i) { return kFull ? load16(a + i * rank + r) : load_n(a + i * rank + r, n); };
  int64_t i = 0;
  for (; i + 2 <= in; i += 2) {
    const v16 row0 = row(i), row1 = row(i + 1);
    for (int j = 0; j < N; ++j) {
      even[j] += x[j][i] * row0;
      odd[j] += x[j][i + 1] * row1;
    }
  }
  if (i < in) {
    const v16 row0 = row(i);
    for (int j = 0; j < N; ++j) even[j] += x[j][i] * row0;
  }
  for (int j = 0; j < N; ++j) {
    const v16 sum = even[j] + odd[j];
    std::memcpy(h[j] + r, &sum, sizeof(v16));  // h has room: r + 16 <= kMaxRank
  }
}

// out_j[o, o + kChunks * 16) = h_j @ B[:, o, ...) for N tokens: kChunks full vectors of outputs
// per token held in registers while B's rows stream past.
template <int N, int kChunks>
inline void h_times_b(const float (*h)[kMaxRank], const float* b, int64_t rank, int64_t width, int64_t o,
                      float* const* out) {
  v16 acc[N][kChunks];
  for (int j = 0; j < N; ++j)
    for (int c = 0; c < kChunks; ++c) acc[j][c] = v16{};
  for (int64_t r = 0; r < rank; ++r) {
    v16 rows[kChunks];
    for (int c = 0; c < kChunks; ++c) rows[c] = load16(b + r * width + o + c * kLanes);
    for (int j = 0; j < N; ++j) {
      const float hj = h[j][r];
      for (int c = 0; c < kChunks; ++c) acc[j][c] += hj * rows[c];
    }
  }
  for (int j = 0; j < N; ++j)
    for (int c = 0; c < kChunks; ++c) std::memcpy(out[j] + o + c * kLanes, &acc[j][c], sizeof(v16));
}

// The delta rows of N tokens (ids tok[0..N)) of one slot. Every token runs the same operations
// for a given (I, R, O), whatever N: its row does not depend on the others.
template <int N>
void tokens_of_slot(const Operands& op, int32_t slot, const int32_t* tok) {
  const int64_t in = op.in, rank = op.rank, width = op.out_width;
  const float* a = op.a + slot * in * rank;     // [I, R]
  const float* b = op.b + slot * rank * width;  // [R, O]
  const float* x[N];
  float* out[N];
  for (int j = 0; j < N; ++j) {
    x[j] = op.x + static_cast<int64_t>(tok[j]) * in;
    out[j] = op.out + static_cast<int64_t>(tok[j]) * width;
  }
  alignas(64) float h[N][kMaxRank];
  for (int64_t r = 0; r < rank; r += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, rank - r);
    if (n == kLanes) {
      x_times_a<N, true>(x, a, in, rank, r, n, h);
    } else {
      x_times_a<N, false>(x, a, in, rank, r, n, h);
    }
  }
  constexpr int kWide = 4;  // output vectors per pass over B's rows
  int64_t o = 0;
  for (; o + kWide * kLanes <= width; o += kWide * kLanes) h_times_b<N, kWide>(h, b, rank, width, o, out);
  for (; o + kLanes <= width; o += kLanes) h_times_b<N, 1>(h, b, rank, width, o, out);
  if (o < width) {  // the last width % 16 outputs
    const int64_t n = width - o;
    v16 acc[N];
    for (int j = 0; j < N; ++j) acc[j] = v16{};
    for (int64_t r = 0; r < rank; ++r) {
      const v16 row = load_n(b + r * width + o, n);
      for (int j = 0; j < N; ++j) acc[j] += h[j][r] * row;
    }
    for (int j = 0; j < N; ++j) store_n(out[j] + o, acc[j], n);
  }
}

ffi::Error LoraDelta(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a,
                     ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> token_slots, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (xd.size() != 2 || ad.size() != 3 || bd.size() != 3)
    return ffi::Error::InvalidArgument("lora_delta_cpu: x must be [T, I], a [S, I, R], b [S, R, O]");
  const int64_t num_tokens = xd[0], in = xd[1], num_slots = ad[0], rank = ad[2], width = bd[2];
  if (ad[1] != in || bd[0] != num_slots || bd[1] != rank)
    return ffi::Error::InvalidArgument("lora_delta_cpu: x [T, I], a [S, I, R] and b [S, R, O] disagree");
  if (rank > kMaxRank) return ffi::Error::InvalidArgument("lora_delta_cpu: rank above 256");
  if (token_slots.dimensions().size() != 1 || token_slots.dimensions()[0] != num_tokens)
    return ffi::Error::InvalidArgument("lora_delta_cpu: token_slots must be [T]");
  const int32_t* slots = token_slots.typed_data();
  float* dst = out->typed_data();
  // Counting sort of the adapter tokens by slot; base tokens get their zero rows here.
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t s = slots[t];
    if (s >= 0 && s < num_slots) {
      ++start[s + 1];
    } else {
      std::memset(dst + t * width, 0, width * sizeof(float));
    }
  }
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  std::vector<int32_t> order(start[num_slots]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t s = slots[t];
    if (s >= 0 && s < num_slots) order[fill[s]++] = static_cast<int32_t>(t);
  }
  // Work items: up to kTokens consecutive tokens of one slot, as (slot, first index in order).
  std::vector<std::pair<int32_t, int64_t>> items;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t k = start[s]; k < start[s + 1]; k += kTokens) items.emplace_back(static_cast<int32_t>(s), k);
  if (items.empty()) return ffi::Error::Success();
  const Operands op{x.typed_data(), a.typed_data(), b.typed_data(), dst, in, rank, width};
  const int64_t* ends = start.data() + 1;
  parallel_for(pool, static_cast<int64_t>(items.size()), 4, [&](int64_t item) {
    const auto [s, k] = items[item];
    const int32_t* tok = order.data() + k;
    switch (std::min<int64_t>(kTokens, ends[s] - k)) {
      case 4: tokens_of_slot<4>(op, s, tok); break;
      case 3: tokens_of_slot<3>(op, s, tok); break;
      case 2: tokens_of_slot<2>(op, s, tok); break;
      default: tokens_of_slot<1>(op, s, tok); break;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxpageLoraDeltaCpu, LoraDelta,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Arg<ffi::Buffer<ffi::F32>>()    // a
                                  .Arg<ffi::Buffer<ffi::F32>>()    // b
                                  .Arg<ffi::Buffer<ffi::S32>>()    // token_slots
                                  .Ret<ffi::Buffer<ffi::F32>>());  // delta
