// Host tensors as read from safetensors files: contiguous, 64-byte aligned storage with a
// DLPack dtype and shape. The compiled step copies them into TVM tensors on its device.
#ifndef DSV4C_SRC_TENSOR_H_
#define DSV4C_SRC_TENSOR_H_

#include <dlpack/dlpack.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

namespace dsv4c {

inline constexpr DLDataType kF32{kDLFloat, 32, 1};
inline constexpr DLDataType kI32{kDLInt, 32, 1};
inline constexpr DLDataType kU8{kDLUInt, 8, 1};

struct Tensor {
  std::shared_ptr<void> data;
  DLDataType dtype = kF32;
  std::vector<int64_t> shape;

  /// New zero-filled storage on a 64-byte boundary.
  static Tensor zeros(std::vector<int64_t> shape, DLDataType dtype = kF32) {
    Tensor t{nullptr, dtype, std::move(shape)};
    // aligned_alloc wants a multiple of the alignment; an empty tensor still gets a valid pointer.
    size_t bytes = std::max<size_t>(64, (t.nbytes() + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    t.data = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
    return t;
  }

  /// New storage that a read fills: 64-byte aligned; from 4 MiB on 2 MiB aligned and advised as
  /// transparent huge pages, as numpy does for the Python runtime's reads: the CPU kernels stream
  /// huge pages faster than the page cache's 4 KiB ones (runtime/weights.py).
  static Tensor for_reading(std::vector<int64_t> shape, DLDataType dtype = kF32) {
    Tensor t{nullptr, dtype, std::move(shape)};
    const size_t align = t.nbytes() >= (size_t{4} << 20) ? size_t{2} << 20 : 64;
    size_t bytes = std::max<size_t>(align, (t.nbytes() + align - 1) / align * align);
    void* p = std::aligned_alloc(align, bytes);
    if (!p) throw std::bad_alloc();
    if (align > 64) ::madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP, plain pages
    t.data = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
    return t;
  }

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * (dtype.bits / 8) * dtype.lanes; }
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data.get());
  }
  /// Whether kernels can take the storage as it is (TVM wants 64-byte aligned data).
  bool aligned() const { return reinterpret_cast<uintptr_t>(data.get()) % 64 == 0; }
};

}  // namespace dsv4c

#endif  // DSV4C_SRC_TENSOR_H_
