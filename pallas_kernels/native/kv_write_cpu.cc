// The KV write on CPU as an XLA FFI custom call, updating the pool in place: the semantics of
// pallas_kernels/reference.py `write_kv` (slot = page_id * page_size + offset; slot -1 and slots
// past the pool are skipped) for any element type.
//
// Why not XLA's scatter: XLA CPU scatters bf16 and fp8 arrays by converting the whole array to
// f32 / f16 and back, in every layer of every step, and the same holds for a quantised pool's
// bf16 scales. This copies bytes, so every dtype writes at the cost of its rows.
//
// Operands: pool [H, ...] of any type (aliased to the result): H halves (K then V), each R slot
// rows of W elements in order (the canonical pool [2, P, page_size, K, D]: R = P * page_size,
// W = K * D; its scales [2, P, page_size, K]: W = K); rows [H, T, ...] of the same type, W
// elements a token; slots i32[T]. Result: the pool with rows[h, t] at slot row slots[t] of half
// h. Shapes pass as they are: a reshape between the pool and the call makes XLA copy the pool.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteSlots(ffi::AnyBuffer pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slots,
                      ffi::Result<ffi::AnyBuffer> out) {
  auto pool_dims = pool.dimensions();
  auto row_dims = rows.dimensions();
  const int64_t num_tokens = static_cast<int64_t>(slots.element_count());
  if (pool_dims.size() < 2 || row_dims.size() < 2 || row_dims[0] != pool_dims[0] || row_dims[1] != num_tokens ||
      pool.element_type() != rows.element_type()) {
    return ffi::Error::InvalidArgument("kv_write_cpu: expected pool [H, ...], rows [H, T, ...] of its type, slots [T]");
  }
  const int64_t halves = pool_dims[0];
  if (halves * num_tokens == 0) return ffi::Error::Success();
  const size_t row_bytes = rows.size_bytes() / static_cast<size_t>(halves * num_tokens);
  const size_t half_bytes = pool.size_bytes() / static_cast<size_t>(halves);
  if (row_bytes == 0 || half_bytes % row_bytes != 0) {
    return ffi::Error::InvalidArgument("kv_write_cpu: a pool half is not a whole number of rows");
  }
  const int64_t num_slots = static_cast<int64_t>(half_bytes / row_bytes);
  char* dst = static_cast<char*>(out->untyped_data());
  const char* src = static_cast<const char*>(rows.untyped_data());
  if (dst != pool.untyped_data()) {  // not aliased: start from the pool's contents
    std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  }
  const int32_t* slot = slots.typed_data();
  for (int64_t h = 0; h < halves; ++h) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t s = slot[t];
      if (s < 0 || s >= num_slots) continue;  // padding, or past the pool: not written
      std::memcpy(dst + h * half_bytes + s * row_bytes, src + (h * num_tokens + t) * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxpageKvWriteCpu, WriteSlots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pool [H, ...]
                                  .Arg<ffi::AnyBuffer>()         // rows [H, T, ...]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .Ret<ffi::AnyBuffer>());       // the pool, rows written
