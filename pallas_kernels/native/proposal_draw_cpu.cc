// The sampler's proposal draw on CPU as an XLA FFI custom call: the semantics of
// pallas_kernels/native_sampling.py `proposal_draw_ref` (and of the proposal path of
// paxpage/sampling_draw.py), one row per work item, each row's logits read from memory once.
//
// Axis legend: R rows, V vocabulary, N blocks of kBlock tokens.
//
// Operands: logits f32[R, V], temperature f32[R], best f32[R] (max(logits) / temperature),
// l_min f32[R] (min-p's logit floor, -inf off), top_p f32[R] (1 off), u f32[R] (a uniform in
// [0, 1) per row), active i32[R] (0: skip the row). Results: token i32[R], accepted i32[R] (0 / 1;
// skipped rows 0, 0).
//
// Per active row, with w_i = exp(logits_i / T - best) for logits_i > -inf (else 0, NaN too):
//   block sums S_n over blocks of kBlock tokens, their prefix sums c_n, total = c_{N-1};
//   target = u * total; the block: the first n with c_n > target, never past the last block of
//   positive weight; inside it the same over the block's prefix sums, from target - c_{n-1};
//   accepted = value >= l_min and (top_p >= 1 or the weight of {logits > value} < top_p * total),
//   where value is the drawn token's logit.
// The first pass computes w into a per-thread buffer (the row stays in L2 for the rest), the
// top-p test sums it again; exp is the 16-lane polynomial of simd.h (relative error ~2e-7), so a
// draw can differ from the XLA path's only where the uniform lands within rounding of a boundary.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace paxpage_native;  // simd.h, parallel.h

constexpr int64_t kBlock = 256;  // tokens per block: sampling_draw._BLOCK

struct Rows {
  const float* logits;
  const float* temperature;
  const float* best;
  const float* l_min;
  const float* top_p;
  const float* u;
  const int32_t* active;
  int32_t* token;
  int32_t* accepted;
  int64_t vocab;
};

// The first index whose prefix sum exceeds target, capped at the last entry of positive weight
// (sampling_draw._pick): cum[0..n) non-decreasing.
int64_t pick(const float* cum, int64_t n, float target) {
  const float total = cum[n - 1];
  int64_t below = 0, last_positive = 0;
  for (int64_t i = 0; i < n; ++i) {
    below += cum[i] <= target;
    last_positive += cum[i] < total;
  }
  return below < last_positive ? below : last_positive;
}

void draw_row(const Rows& rs, int64_t r, std::vector<float>& w, std::vector<float>& cum) {
  if (!rs.active[r]) {
    rs.token[r] = 0;
    rs.accepted[r] = 0;
    return;
  }
  const int64_t vocab = rs.vocab;
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  const float* x = rs.logits + r * vocab;
  const float inv_t = 1.0f / rs.temperature[r], best = rs.best[r];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  w.resize(num_blocks * kBlock);
  cum.resize(num_blocks);
  // Pass 1: weights and block sums (the padding after the last token weighs 0).
  float running = 0.0f;
  for (int64_t n = 0; n < num_blocks; ++n) {
    const int64_t start = n * kBlock, end = std::min(start + kBlock, vocab);
    float* wb = w.data() + start;
    v16 sum = {};
    int64_t i = start;
    for (; i + kLanes <= end; i += kLanes) {
      const v16 l = load16(x + i);
      const v16 e = exp16(l * inv_t - best);
      const v16 kept = (v16)(l > neg_inf);  // all-ones lanes where kept, else 0 (NaN too)
      const v16 wi = (v16)((v16i)e & (v16i)kept);
      std::memcpy(wb + (i - start), &wi, sizeof(wi));
      sum += wi;
    }
    float block_sum = fold16(sum);
    for (; i < end; ++i) {
      const float e = x[i] > neg_inf ? std::exp(x[i] * inv_t - best) : 0.0f;
      wb[i - start] = e;
      block_sum += e;
    }
    for (; i < start + kBlock; ++i) wb[i - start] = 0.0f;
    running += block_sum;
    cum[n] = running;
  }
  const float total = cum[num_blocks - 1];
  const float target = rs.u[r] * total;
  const int64_t block = pick(cum.data(), num_blocks, target);
  const float before = block > 0 ? cum[block - 1] : 0.0f;
  float inner_cum[kBlock];
  float acc = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) inner_cum[j] = acc += w[block * kBlock + j];
  const int64_t inner = pick(inner_cum, kBlock, target - before);
  const int64_t token = std::min(block * kBlock + inner, vocab - 1);
  const float value = x[token];
  bool ok = value >= rs.l_min[r];
  if (ok && rs.top_p[r] < 1.0f) {
    // Pass 2 (the row is in cache): the weight of the tokens strictly better than the draw.
    v16 above = {};
    const v16 threshold = v16{} + value;
    int64_t i = 0;
    for (; i + kLanes <= vocab; i += kLanes) {
      const v16 wi = load16(w.data() + i);
      above += (v16)((v16i)wi & (v16i)(load16(x + i) > threshold));
    }
    float mass = fold16(above);
    for (; i < vocab; ++i) mass += x[i] > value ? w[i] : 0.0f;
    ok = mass < rs.top_p[r] * total;
  }
  rs.token[r] = static_cast<int32_t>(token);
  rs.accepted[r] = ok ? 1 : 0;
}

ffi::Error ProposalDraw(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                        ffi::Buffer<ffi::F32> best, ffi::Buffer<ffi::F32> l_min, ffi::Buffer<ffi::F32> top_p,
                        ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::S32> active,
                        ffi::ResultBuffer<ffi::S32> token, ffi::ResultBuffer<ffi::S32> accepted) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || dims[1] <= 0)
    return ffi::Error::InvalidArgument("proposal_draw_cpu: logits must be [R, V] with V > 0");
  const int64_t num_rows = dims[0];
  for (const auto* b : {&temperature, &best, &l_min, &top_p, &u})
    if (b->dimensions().size() != 1 || b->dimensions()[0] != num_rows)
      return ffi::Error::InvalidArgument("proposal_draw_cpu: per-row operands must be [R]");
  if (active.dimensions().size() != 1 || active.dimensions()[0] != num_rows)
    return ffi::Error::InvalidArgument("proposal_draw_cpu: active must be [R]");
  const Rows rs{logits.typed_data(), temperature.typed_data(), best.typed_data(), l_min.typed_data(),
                top_p.typed_data(), u.typed_data(), active.typed_data(), token->typed_data(),
                accepted->typed_data(), dims[1]};
  parallel_for(pool, num_rows, 8, [&rs](int64_t r) {
    thread_local std::vector<float> w, cum;
    draw_row(rs, r, w, cum);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxpageProposalDrawCpu, ProposalDraw,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits
                                  .Arg<ffi::Buffer<ffi::F32>>()    // temperature
                                  .Arg<ffi::Buffer<ffi::F32>>()    // best
                                  .Arg<ffi::Buffer<ffi::F32>>()    // l_min
                                  .Arg<ffi::Buffer<ffi::F32>>()    // top_p
                                  .Arg<ffi::Buffer<ffi::F32>>()    // u
                                  .Arg<ffi::Buffer<ffi::S32>>()    // active
                                  .Ret<ffi::Buffer<ffi::S32>>()    // token
                                  .Ret<ffi::Buffer<ffi::S32>>());  // accepted
