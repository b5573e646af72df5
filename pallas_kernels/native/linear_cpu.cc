// A dense layer's matmul on CPU as an XLA FFI custom call: y = x @ w with w held in column panels,
// the semantics of pallas_kernels/native_linear.py `linear_ref`.
//
// Axis legend: T tokens (rows of x), I input width, O output width, P panels (O / 64).
//
// Operands: x f32[T, I], w f32 or bf16 [P, I, 64] or [G, P, I, 64] (models/panel_layout.py: panel p
// holds columns [64p, 64p + 64) of the [I, O] weight, each panel one contiguous block; G: the
// groups of a scanned layer stack, all of them, so that the scan never copies a group's slice
// out), group s32[] (which of the G; 0 for a rank-3 w), live s32[T] (0: a padding row of the
// step, whose result is written as zeros and never computed). Result y f32[T, O].
//
// One work item is one (panel, group of up to kRowsPerItem live rows) pair; items are spread over
// XLA's intra-op threads. Within an item a register tile of up to 6 rows x 64 columns (24
// accumulators) walks the input width once: per input index it loads the panel's 64 weights (one
// cache line pair, the next ones in memory) and broadcasts one input per row. A panel streams from
// memory front to back, where the hardware prefetchers keep up, and stays in L2 (147 KB at
// I = 576 in f32) while the item's row tiles pass over it. bf16 panels (a bf16 model's) are widened
// to f32 as they are loaded: half the bytes to stream, the same f32 arithmetic. A row-major [I, O] weight read the same way
// would jump O * 4 bytes between input indices, a new page every row or two, and XLA's dot
// repacks the weight on every call: a decode step's skinny matmuls run ~1.5x faster here. Tiles
// gather the live rows wherever they are, so a step's padding (the tail of each prefill row, the
// decode rows past the batch) costs no multiply-adds.
//
// Each output element is sum_i x[t, i] * w[i, o], accumulated in order of i from 0 in f32 (one
// multiply-add per i), whatever the tile, item or T it falls in: a row's result does not depend
// on the other rows of the step.
//
// PaxpageLinearQCpu reads a quantised weight (models/quant.py) in the same panels: q s8[(G,) P, I,
// 64], scale f32[(G,) P, I / Q, 64] (one per Q consecutive inputs of a column: Q = I for int8 per
// output channel, 32 or 16 for a GGUF block format) and offset likewise, or f32[0] for none. Each
// weight is dequantised as it is loaded, w = q * scale (+ offset) in f32, rounded as numpy's
// expansion rounds it (quant.dequantize_flat: the same weights bit for bit, so the same sums as
// the f32 model's), and enters the same register tiles: a quarter of f32's bytes to stream (1.25
// bytes a weight for a 32-block format with offsets) for a convert and a multiply per weight
// vector, which the tile's rows share. An item with more rows than one tile expands its panel
// into a per-thread f32 buffer once and runs the f32 tiles over it.

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

constexpr int kPanelVectors = 4;      // 16-lane vectors per panel (64 columns)
constexpr int kPanel = kPanelVectors * kLanes;
constexpr int kTileRows = 6;          // rows per register tile (6 x 4 accumulators)
constexpr int64_t kRowsPerItem = 48;  // rows of one work item (a multiple of kTileRows)
constexpr int64_t kRowsPerQuantItem = 192;  // the same for a quantised weight

struct Operands {
  const float* x;
  float* y;
  int64_t in, out;
};

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// A panel of float weights (W float, or uint16_t holding bf16): one group spanning the input width.
template <typename W>
struct FloatPanel {
  const W* w;
  int64_t group_size(int64_t in) const { return in; }
  FloatPanel at(int64_t) const { return *this; }  // the group's reader
  v16 load(int64_t i, int v) const { return load16(w + i * kPanel + v * kLanes); }
};

// A panel of quantised weights: q s8[I, 64], scale (and offset, if kOffset) f32[I / Q, 64], read a
// group of Q inputs at a time (`at` points the reader at group g's scales).
template <bool kOffset>
struct QuantPanel {
  const int8_t* q;
  const float* scale;
  const float* offset;
  int64_t size;  // Q
  int64_t group_size(int64_t) const { return size; }
  QuantPanel at(int64_t g) const { return {q, scale + g * kPanel, kOffset ? offset + g * kPanel : offset, size}; }
  v16 load(int64_t i, int v) const {
    v16 w = load16(q + i * kPanel + v * kLanes) * load16(scale + v * kLanes);
    if (kOffset) {
      // rounded before the offset is added, as numpy's expansion (quant.dequantize_flat) rounds
      // it: no fused multiply-add, so a weight equals its f32 expansion bit for bit
      asm("" : "+x"(w));
      w += load16(offset + v * kLanes);
    }
    return w;
  }
  // The whole panel's weights as f32 [I, 64] into out (the values load gives).
  void expand(int64_t in, float* out) const {
    for (int64_t start = 0; start < in; start += size) {
      const QuantPanel group = at(start / size);
      for (int64_t i = start; i < start + size; ++i)
        for (int v = 0; v < kPanelVectors; ++v) store16(out + i * kPanel + v * kLanes, group.load(i, v));
    }
  }
};

// y[the R rows named by rows, the 64 columns from col] from the panel read by `panel`.
template <int R, typename Panel>
void tile(const Operands& op, const Panel& panel, const int64_t* rows, int64_t col) {
  v16 acc[R][kPanelVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanelVectors; ++v) acc[r][v] = v16{};
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = op.x + rows[r] * op.in;
  const int64_t size = panel.group_size(op.in);
  for (int64_t start = 0; start < op.in; start += size) {
    const Panel group = panel.at(start / size);
    for (int64_t i = start; i < start + size; ++i) {
      v16 b[kPanelVectors];
      for (int v = 0; v < kPanelVectors; ++v) b[v] = group.load(i, v);
      for (int r = 0; r < R; ++r) {
        const v16 a = v16{} + x[r][i];
        for (int v = 0; v < kPanelVectors; ++v) acc[r][v] += a * b[v];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = op.y + rows[r] * op.out + col;
    for (int v = 0; v < kPanelVectors; ++v) store16(y + v * kLanes, acc[r][v]);
  }
}

// The `count` rows named by rows, of one panel.
template <typename Panel>
void panel_rows(const Operands& op, const Panel& panel, const int64_t* rows, int64_t count, int64_t col) {
  int64_t r = 0;
  for (; r + kTileRows <= count; r += kTileRows) tile<kTileRows>(op, panel, rows + r, col);
  switch (count - r) {
    case 5: tile<5>(op, panel, rows + r, col); break;
    case 4: tile<4>(op, panel, rows + r, col); break;
    case 3: tile<3>(op, panel, rows + r, col); break;
    case 2: tile<2>(op, panel, rows + r, col); break;
    case 1: tile<1>(op, panel, rows + r, col); break;
    default: break;
  }
}

// The live rows of x (the others of y zeroed), and every (panel, row group) item run by
// run(panel index, rows, count) over the pool's threads.
template <typename Run>
void for_items(ffi::ThreadPool& pool, const Operands& op, const int32_t* is_live, int64_t num_tokens,
               int64_t num_panels, int64_t rows_per_item, Run run) {
  std::vector<int64_t> rows;
  rows.reserve(num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (is_live[t] && op.in > 0) rows.push_back(t);
    else std::memset(op.y + t * op.out, 0, op.out * sizeof(float));
  }
  const int64_t count = static_cast<int64_t>(rows.size());
  if (count == 0 || num_panels == 0) return;
  const int64_t groups = (count + rows_per_item - 1) / rows_per_item;
  parallel_for(pool, num_panels * groups, 1, [&](int64_t item) {
    const int64_t p = item / groups, g = item % groups;
    const int64_t first = g * rows_per_item;
    run(p, rows.data() + first, std::min(rows_per_item, count - first));
  });
}

ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w_any,
                  ffi::Buffer<ffi::S32> group, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd_all = w_any.dimensions(), ld = live.dimensions(), yd = y->dimensions();
  const size_t lead = wd_all.size() == 4 ? 1 : 0;  // the groups axis of a stacked w
  const bool bf16 = w_any.element_type() == ffi::DataType::BF16;
  if ((w_any.element_type() != ffi::DataType::F32 && !bf16) || (wd_all.size() != 3 && wd_all.size() != 4) ||
      xd.size() != 2 || ld.size() != 1 || yd.size() != 2 || group.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "linear_cpu: x must be [T, I], w f32 or bf16 [(G,) P, I, 64], group [], live [T], y [T, O]");
  const int64_t num_panels = wd_all[lead], width_in = wd_all[lead + 1];
  if (wd_all[lead + 2] != kPanel || width_in != xd[1] || ld[0] != xd[0] || yd[0] != xd[0] ||
      yd[1] != num_panels * kPanel)
    return ffi::Error::InvalidArgument("linear_cpu: x [T, I], w [(G,) P, I, 64], live [T] and y [T, O] disagree");
  const int64_t g = group.typed_data()[0], num_groups = lead ? wd_all[0] : 1;
  if (g < 0 || g >= num_groups) return ffi::Error::InvalidArgument("linear_cpu: group outside [0, G)");
  const int64_t w0 = g * num_panels * width_in * kPanel;  // the group's first value
  const float* w32 = static_cast<const float*>(w_any.untyped_data()) + w0;
  const uint16_t* w16 = static_cast<const uint16_t*>(w_any.untyped_data()) + w0;
  const Operands op{x.typed_data(), y->typed_data(), xd[1], yd[1]};
  for_items(pool, op, live.typed_data(), xd[0], num_panels, kRowsPerItem, [&](int64_t p, const int64_t* rows,
                                                                              int64_t n) {
    if (bf16) {
      panel_rows(op, FloatPanel<uint16_t>{w16 + p * op.in * kPanel}, rows, n, p * kPanel);
    } else {
      panel_rows(op, FloatPanel<float>{w32 + p * op.in * kPanel}, rows, n, p * kPanel);
    }
  });
  return ffi::Error::Success();
}

ffi::Error LinearQ(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                   ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> group,
                   ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), ld = live.dimensions(),
             yd = y->dimensions();
  const size_t lead = qd.size() == 4 ? 1 : 0;  // the groups axis of a stacked weight
  const bool with_offset = offset.element_count() != 0;
  if ((qd.size() != 3 && qd.size() != 4) || sd.size() != qd.size() || xd.size() != 2 || ld.size() != 1 ||
      yd.size() != 2 || group.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "linear_q_cpu: x must be [T, I], q s8 [(G,) P, I, 64], scale f32 [(G,) P, I / Q, 64], group [], live [T], "
        "y [T, O]");
  const int64_t num_panels = qd[lead], width_in = qd[lead + 1], num_blocks = sd[lead + 1];
  bool same = qd[lead + 2] == kPanel && sd[lead + 2] == kPanel && sd[lead] == num_panels && (!lead || sd[0] == qd[0]);
  same = same && width_in == xd[1] && ld[0] == xd[0] && yd[0] == xd[0] && yd[1] == num_panels * kPanel;
  if (!same || (num_blocks == 0 && width_in > 0) || (num_blocks > 0 && width_in % num_blocks != 0))
    return ffi::Error::InvalidArgument(
        "linear_q_cpu: x [T, I], q [(G,) P, I, 64], scale [(G,) P, I / Q, 64], live [T] and y [T, O] disagree");
  if (with_offset && offset.element_count() != scale.element_count())
    return ffi::Error::InvalidArgument("linear_q_cpu: offset must be shaped as scale, or f32[0] for none");
  const int64_t g = group.typed_data()[0], num_groups = lead ? qd[0] : 1;
  if (g < 0 || g >= num_groups) return ffi::Error::InvalidArgument("linear_q_cpu: group outside [0, G)");
  const int64_t size = num_blocks ? width_in / num_blocks : 1;  // Q
  const int8_t* q0 = q.typed_data() + g * num_panels * width_in * kPanel;
  const int64_t s0 = g * num_panels * num_blocks * kPanel;
  const float* scale0 = scale.typed_data() + s0;
  const float* offset0 = with_offset ? offset.typed_data() + s0 : nullptr;
  const Operands op{x.typed_data(), y->typed_data(), xd[1], yd[1]};
  // items of more rows: each expands its panel once for them all
  for_items(pool, op, live.typed_data(), xd[0], num_panels, kRowsPerQuantItem, [&](int64_t p, const int64_t* rows,
                                                                                   int64_t n) {
    const int8_t* qp = q0 + p * width_in * kPanel;
    const int64_t sp = p * num_blocks * kPanel;
    const QuantPanel<true> affine{qp, scale0 + sp, offset0 + sp, size};
    const QuantPanel<false> scaled{qp, scale0 + sp, nullptr, size};
    if (n > kTileRows) {  // several row tiles: expand the panel once (it stays in L2), then f32 tiles
      thread_local std::vector<float> expanded;
      expanded.resize(width_in * kPanel);
      if (with_offset) affine.expand(width_in, expanded.data());
      else scaled.expand(width_in, expanded.data());
      panel_rows(op, FloatPanel<float>{expanded.data()}, rows, n, p * kPanel);
    } else if (with_offset) {
      panel_rows(op, affine, rows, n, p * kPanel);
    } else {
      panel_rows(op, scaled, rows, n, p * kPanel);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxpageLinearCpu, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Arg<ffi::AnyBuffer>()           // w panels [(G,) P, I, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // group
                                  .Arg<ffi::Buffer<ffi::S32>>()    // live rows
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxpageLinearQCpu, LinearQ,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Arg<ffi::Buffer<ffi::S8>>()     // q panels [(G,) P, I, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scale panels [(G,) P, I / Q, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // offset panels, or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // group
                                  .Arg<ffi::Buffer<ffi::S32>>()    // live rows
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
