// Host tensors handed to the kernels as DLTensor: contiguous, shared storage, 64-byte aligned
// except for index() views (the kernel call passes those as aligned copies, see shareable()).
// Reshapes are views of the same storage (like numpy reshape of a contiguous array).
#ifndef DSV4C_SRC_TENSOR_H_
#define DSV4C_SRC_TENSOR_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "dsv4c/kv_pool.h"

namespace dsv4c {

inline constexpr DLDataType kF32{kDLFloat, 32, 1};
inline constexpr DLDataType kI32{kDLInt, 32, 1};

struct Tensor {
  std::shared_ptr<void> data;  // null: no tensor (a weight or state operand)
  DLDataType dtype = kF32;
  std::vector<int64_t> shape;

  /// New zero-filled storage on a 64-byte boundary.
  static Tensor zeros(std::vector<int64_t> shape, DLDataType dtype = kF32) {
    Tensor t{nullptr, dtype, std::move(shape)};
    auto buffer = std::make_shared<AlignedBuffer>(t.nbytes());
    t.data = std::shared_ptr<void>(buffer, buffer->data<void>());  // shares the buffer's lifetime
    return t;
  }

  /// A view of memory someone else owns (the KV pool's planes).
  static Tensor borrow(void* data, std::vector<int64_t> shape, DLDataType dtype = kF32) {
    return Tensor{std::shared_ptr<void>(data, [](void*) {}), dtype, std::move(shape)};
  }

  /// An int32 copy of host bookkeeping (row lists, positions), 1-d unless `shape` is given.
  template <class T>
  static Tensor int32(const std::vector<T>& values) {
    return int32(values, {static_cast<int64_t>(values.size())});
  }
  template <class T>
  static Tensor int32(const std::vector<T>& values, std::vector<int64_t> shape) {
    Tensor t = zeros(std::move(shape), kI32);
    for (size_t i = 0; i < values.size(); ++i) t.ptr<int32_t>()[i] = static_cast<int32_t>(values[i]);
    return t;
  }

  bool defined() const { return data != nullptr; }
  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
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

  /// The same storage under another shape; one dimension may be -1 (inferred).
  Tensor reshape(std::vector<int64_t> to) const {
    int64_t known = 1, inferred = -1;
    for (size_t i = 0; i < to.size(); ++i) {
      if (to[i] < 0) {
        inferred = static_cast<int64_t>(i);
      } else {
        known *= to[i];
      }
    }
    if (inferred >= 0) to[inferred] = known ? numel() / known : 0;
    Tensor t{data, dtype, std::move(to)};
    if (t.numel() != numel()) throw std::logic_error("reshape changes the element count");
    return t;
  }

  /// The first `rows` rows along axis 0, sharing storage (numpy: x[:rows] of a contiguous x).
  Tensor first_rows(int64_t rows) const {
    Tensor t = *this;
    t.shape[0] = rows;
    return t;
  }

  /// Element `i` along axis 0 (numpy a[i] of a contiguous a), sharing storage. The view starts
  /// i * (row bytes) into the storage, so it need not be 64-byte aligned: see shareable().
  Tensor index(int64_t i) const {
    if (shape.empty() || i < 0 || i >= shape[0]) throw std::logic_error("index out of range along axis 0");
    size_t row_bytes = nbytes() / static_cast<size_t>(shape[0]);
    Tensor t{std::shared_ptr<void>(data, static_cast<char*>(data.get()) + i * row_bytes), dtype,
             std::vector<int64_t>(shape.begin() + 1, shape.end())};
    return t;
  }

  bool aligned() const { return reinterpret_cast<uintptr_t>(data.get()) % 64 == 0; }

  /// This tensor when the kernels can take it as it is (64-byte aligned), else an aligned copy
  /// (Python: backend_tvm._shareable). Only read-only inputs are ever copied.
  Tensor shareable() const {
    if (!defined() || aligned()) return *this;
    Tensor t = zeros(shape, dtype);
    std::memcpy(t.data.get(), data.get(), nbytes());
    return t;
  }

  /// The DLTensor the kernels receive; valid while this Tensor lives.
  DLTensor dl() const {
    return DLTensor{data.get(), DLDevice{kDLCPU, 0}, static_cast<int32_t>(shape.size()), dtype,
                    const_cast<int64_t*>(shape.data()), nullptr, 0};
  }
};

}  // namespace dsv4c

#endif  // DSV4C_SRC_TENSOR_H_
