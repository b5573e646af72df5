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

struct Operands {
  const float* x;
  float* y;
  int64_t in, out;
};

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// y[the R rows named by rows, the 64 columns from col] from the panel w (rows kPanel values apart;
// W float, or uint16_t holding bf16).
template <int R, typename W>
void tile(const Operands& op, const W* w, const int64_t* rows, int64_t col) {
  v16 acc[R][kPanelVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanelVectors; ++v) acc[r][v] = v16{};
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = op.x + rows[r] * op.in;
  for (int64_t i = 0; i < op.in; ++i) {
    const W* wi = w + i * kPanel;
    v16 b[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) b[v] = load16(wi + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const v16 a = v16{} + x[r][i];
      for (int v = 0; v < kPanelVectors; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = op.y + rows[r] * op.out + col;
    for (int v = 0; v < kPanelVectors; ++v) store16(y + v * kLanes, acc[r][v]);
  }
}

// The `count` rows named by rows, of one panel.
template <typename W>
void panel_rows(const Operands& op, const W* w, const int64_t* rows, int64_t count, int64_t col) {
  int64_t r = 0;
  for (; r + kTileRows <= count; r += kTileRows) tile<kTileRows, W>(op, w, rows + r, col);
  switch (count - r) {
    case 5: tile<5, W>(op, w, rows + r, col); break;
    case 4: tile<4, W>(op, w, rows + r, col); break;
    case 3: tile<3, W>(op, w, rows + r, col); break;
    case 2: tile<2, W>(op, w, rows + r, col); break;
    case 1: tile<1, W>(op, w, rows + r, col); break;
    default: break;
  }
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
  const int32_t* is_live = live.typed_data();
  std::vector<int64_t> rows;
  rows.reserve(xd[0]);
  for (int64_t t = 0; t < xd[0]; ++t) {
    if (is_live[t] && op.in > 0) rows.push_back(t);
    else std::memset(op.y + t * op.out, 0, op.out * sizeof(float));
  }
  const int64_t count = static_cast<int64_t>(rows.size());
  if (count == 0 || num_panels == 0) return ffi::Error::Success();
  const int64_t groups = (count + kRowsPerItem - 1) / kRowsPerItem;
  parallel_for(pool, num_panels * groups, 1, [&](int64_t item) {
    const int64_t p = item / groups, g = item % groups;
    const int64_t first = g * kRowsPerItem;
    const int64_t n = std::min(kRowsPerItem, count - first);
    if (bf16) {
      panel_rows(op, w16 + p * op.in * kPanel, rows.data() + first, n, p * kPanel);
    } else {
      panel_rows(op, w32 + p * op.in * kPanel, rows.data() + first, n, p * kPanel);
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
