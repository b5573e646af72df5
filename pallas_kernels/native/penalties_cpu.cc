// The sampler's penalties on CPU as an XLA FFI custom call, in place on the logits: the semantics
// of paxpage/sampling/sampler.py `apply_penalties` (pallas_kernels/native_sampling.py
// `apply_penalties_native` wraps this), touching only the listed tokens of each row.
//
// Axis legend: R rows, V vocabulary, S listed tokens per row, E banned tokens per row.
//
// Operands: logits f32[R, V] (aliased to the result), ids i32[R, S] (a row's distinct penalised
// tokens, -1 padding), counts i32[R, S] (each one's occurrences in the row's output), banned
// i32[R, E] (-1 padding), repetition / frequency / presence f32[R], pending i32[R] (one more
// output token of the row that ids / counts leave out, -1 none). Result: the logits f32[R, V].
//
// Per row, for each listed id with c occurrences (one more when it is the pending token; a
// pending token not listed counts as a listed id with c = 1):
//   x = logits[id]; x = -inf if id is banned; x = x < 0 ? x * rep : x / rep;
//   x -= frequency * c; x -= presence * (c > 0); logits[id] = x
// and logits[id] = -inf for every banned id, in f32 (x / rep a true division, as HF divides; XLA
// CPU multiplies by the reciprocal and fuses some products into FMAs, so the two differ by an ulp
// or two in places, as two XLA builds may). XLA CPU runs the reference's
// scatter one index at a time (~40 ms at 256 rows x 2,048 listed tokens on the 2-core EPYC);
// here a row's updates are a few thousand loads and stores, rows spread over XLA's threads.

#include <cstdint>
#include <cstring>
#include <limits>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace paxpage_native;  // parallel.h

struct Rows {
  float* logits;
  const int32_t* ids;
  const int32_t* counts;
  const int32_t* banned;
  const float* rep;
  const float* freq;
  const float* pres;
  const int32_t* pending;
  int64_t vocab, width, num_banned;
};

inline bool is_banned(const Rows& rs, int64_t r, int32_t id) {
  const int32_t* b = rs.banned + r * rs.num_banned;
  for (int64_t e = 0; e < rs.num_banned; ++e)
    if (b[e] == id) return true;
  return false;
}

inline void penalise(const Rows& rs, int64_t r, int32_t id, int32_t count) {
  float* x = rs.logits + r * rs.vocab + id;
  if (is_banned(rs, r, id)) {
    *x = -std::numeric_limits<float>::infinity();
    return;
  }
  const float rep = rs.rep[r];
  float v = *x < 0 ? *x * rep : *x / rep;
  v -= rs.freq[r] * static_cast<float>(count);
  *x = v - rs.pres[r] * (count > 0 ? 1.0f : 0.0f);
}

void penalise_row(const Rows& rs, int64_t r) {
  const int32_t* ids = rs.ids + r * rs.width;
  const int32_t* counts = rs.counts + r * rs.width;
  const int32_t pending = rs.pending[r];
  bool pending_listed = false;
  for (int64_t s = 0; s < rs.width; ++s) {
    const int32_t id = ids[s];
    if (id < 0 || id >= rs.vocab) continue;
    const bool is_pending = id == pending;
    pending_listed |= is_pending;
    penalise(rs, r, id, counts[s] + (is_pending ? 1 : 0));
  }
  if (pending >= 0 && pending < rs.vocab && !pending_listed) penalise(rs, r, pending, 1);
  const int32_t* b = rs.banned + r * rs.num_banned;
  for (int64_t e = 0; e < rs.num_banned; ++e)
    if (b[e] >= 0 && b[e] < rs.vocab) rs.logits[r * rs.vocab + b[e]] = -std::numeric_limits<float>::infinity();
}

ffi::Error Penalties(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> ids,
                     ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> banned, ffi::Buffer<ffi::F32> rep,
                     ffi::Buffer<ffi::F32> freq, ffi::Buffer<ffi::F32> pres, ffi::Buffer<ffi::S32> pending,
                     ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = logits.dimensions(), id_dims = ids.dimensions(), banned_dims = banned.dimensions();
  if (dims.size() != 2 || id_dims.size() != 2 || banned_dims.size() != 2 || id_dims[0] != dims[0] ||
      banned_dims[0] != dims[0] || counts.dimensions().size() != 2 || counts.element_count() != ids.element_count())
    return ffi::Error::InvalidArgument(
        "penalties_cpu: logits must be [R, V], ids and counts [R, S], banned [R, E]");
  const int64_t num_rows = dims[0];
  for (const auto* b : {&rep, &freq, &pres})
    if (b->dimensions().size() != 1 || b->dimensions()[0] != num_rows)
      return ffi::Error::InvalidArgument("penalties_cpu: per-row operands must be [R]");
  if (pending.dimensions().size() != 1 || pending.dimensions()[0] != num_rows)
    return ffi::Error::InvalidArgument("penalties_cpu: pending must be [R]");
  float* y = out->typed_data();
  if (y != logits.typed_data())  // not aliased after all: start from the input
    std::memcpy(y, logits.typed_data(), logits.element_count() * sizeof(float));
  const Rows rs{y, ids.typed_data(), counts.typed_data(), banned.typed_data(), rep.typed_data(),
                freq.typed_data(), pres.typed_data(), pending.typed_data(), dims[1], id_dims[1], banned_dims[1]};
  parallel_for(pool, num_rows, 16, [&rs](int64_t r) { penalise_row(rs, r); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxpagePenaltiesCpu, Penalties,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()    // ids
                                  .Arg<ffi::Buffer<ffi::S32>>()    // counts
                                  .Arg<ffi::Buffer<ffi::S32>>()    // banned
                                  .Arg<ffi::Buffer<ffi::F32>>()    // repetition penalty
                                  .Arg<ffi::Buffer<ffi::F32>>()    // frequency penalty
                                  .Arg<ffi::Buffer<ffi::F32>>()    // presence penalty
                                  .Arg<ffi::Buffer<ffi::S32>>()    // pending
                                  .Ret<ffi::Buffer<ffi::F32>>());  // logits, penalised
