// The sampler's proposal draw on CPU as an XLA FFI custom call: the semantics of
// pallas_kernels/native_sampling.py `proposal_draw_ref` (and of the proposal path of
// paxpage/sampling/draw.py), one row per work item, each row's logits read from memory once.
//
// Axis legend: R rows, V vocabulary, N blocks of kBlock tokens.
//
// Operands: logits f32[R, V], temperature f32[R], best f32[R] (max(logits) / temperature),
// l_min f32[R] (min-p's logit floor, -inf off), top_p f32[R] (1 off), keys u32[R, 2] (the row
// keys), active i32[R] (0: skip the row). Results: token i32[R], accepted i32[R] (0 / 1;
// skipped rows 0, 0).
//
// Per active row, with w_i = exp(logits_i / T - best) for logits_i > -inf (else 0, NaN too):
//   block sums S_n over blocks of kBlock tokens, total = their sum;
//   the block: the first argmax of log S_n + gumbel(key, 0, n); inside it the token: the first
//   argmax of logits_i / T - best + gumbel(key, 1, i) over its kept tokens (i the token id;
//   gumbel is paxpage/sampling/noise.py's counter hash, the same integer operations);
//   accepted = value >= l_min and (top_p >= 1 or the weight of {logits > value} < top_p * total),
//   where value is the drawn token's logit.
// The first pass computes w into a per-thread buffer (the row stays in L2 for the rest), the
// top-p test sums it again; exp is the 16-lane polynomial of simd.h (relative error ~2e-7) and
// sums run in another order than XLA's, so a draw can differ from the XLA path's only where two
// noisy scores tie to within that rounding.

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

constexpr int64_t kBlock = 256;  // tokens per block: paxpage/sampling/draw.py _BLOCK

struct Rows {
  const float* logits;
  const float* temperature;
  const float* best;
  const float* l_min;
  const float* top_p;
  const uint32_t* keys;  // [R, 2]
  const int32_t* active;
  int32_t* token;
  int32_t* accepted;
  int64_t vocab;
};

// paxpage/sampling/noise.py, operation for operation.
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

struct Noise {  // a row's two words for one stream
  uint32_t a, b;
  Noise(const uint32_t* key, uint32_t stream) {
    a = fmix32(key[0] ^ fmix32(stream + 0x632BE5ABu));
    b = fmix32(key[1] + a);
  }
  float gumbel(uint32_t index) const {
    const uint32_t h = fmix32(fmix32(index * 0x9E3779B9u + a) ^ b);
    const float v = std::min((static_cast<float>(h) + 0.5f) * 0x1p-32f, 1.0f - 0x1p-24f);
    return -std::log(-std::log1p(-v));
  }
};

constexpr uint32_t kBlockStream = 0, kTokenStream = 1;  // round 0 of paxpage/sampling/noise.py's streams

void draw_row(const Rows& rs, int64_t r, std::vector<float>& w, std::vector<float>& sums) {
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
  sums.resize(num_blocks);
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
    sums[n] = block_sum;
  }
  const float total = running;
  const uint32_t* key = rs.keys + 2 * r;
  const Noise block_noise(key, kBlockStream), token_noise(key, kTokenStream);
  int64_t block = 0;
  float top = neg_inf;
  for (int64_t n = 0; n < num_blocks; ++n) {
    if (!(sums[n] > 0.0f)) continue;  // log 0: never drawn
    const float score = std::log(sums[n]) + block_noise.gumbel(static_cast<uint32_t>(n));
    if (score > top) top = score, block = n;
  }
  int64_t token = block * kBlock;
  top = neg_inf;
  for (int64_t i = block * kBlock, end = std::min(i + kBlock, vocab); i < end; ++i) {
    if (!(x[i] > neg_inf)) continue;
    const float score = (x[i] / rs.temperature[r] - best) + token_noise.gumbel(static_cast<uint32_t>(i));
    if (score > top) top = score, token = i;
  }
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
                        ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::S32> active,
                        ffi::ResultBuffer<ffi::S32> token, ffi::ResultBuffer<ffi::S32> accepted) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || dims[1] <= 0)
    return ffi::Error::InvalidArgument("proposal_draw_cpu: logits must be [R, V] with V > 0");
  const int64_t num_rows = dims[0];
  for (const auto* b : {&temperature, &best, &l_min, &top_p})
    if (b->dimensions().size() != 1 || b->dimensions()[0] != num_rows)
      return ffi::Error::InvalidArgument("proposal_draw_cpu: per-row operands must be [R]");
  if (keys.dimensions().size() != 2 || keys.dimensions()[0] != num_rows || keys.dimensions()[1] != 2)
    return ffi::Error::InvalidArgument("proposal_draw_cpu: keys must be [R, 2]");
  if (active.dimensions().size() != 1 || active.dimensions()[0] != num_rows)
    return ffi::Error::InvalidArgument("proposal_draw_cpu: active must be [R]");
  const Rows rs{logits.typed_data(), temperature.typed_data(), best.typed_data(), l_min.typed_data(),
                top_p.typed_data(), keys.typed_data(), active.typed_data(), token->typed_data(),
                accepted->typed_data(), dims[1]};
  parallel_for(pool, num_rows, 8, [&rs](int64_t r) {
    thread_local std::vector<float> w, sums;
    draw_row(rs, r, w, sums);
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
                                  .Arg<ffi::Buffer<ffi::U32>>()    // keys
                                  .Arg<ffi::Buffer<ffi::S32>>()    // active
                                  .Ret<ffi::Buffer<ffi::S32>>()    // token
                                  .Ret<ffi::Buffer<ffi::S32>>());  // accepted
