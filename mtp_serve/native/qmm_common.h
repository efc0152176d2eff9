// What the native primitives' sources share (quantized_matmul.cpp, quantized_attention.cpp,
// gated_delta.cpp, activations.cpp): the dtype of MLX's affine scales and biases, one of them
// loaded as fp32, an eval's outputs claimed, inputs read row-major whatever their strides, and
// gradients from MLX's reference computation.
// Included inside each source's own namespace, after <immintrin.h>, <cstdint>, <cstring>,
// <stdexcept>, <vector> and MLX's headers.
#pragma once

enum ScaleType { F32 = 0, BF16 = 1, F16 = 2 };

template <int ST>
inline float ld1(const void* p, long i) {
  if constexpr (ST == F32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (ST == BF16) {
    uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  }
}

// A kernel's scratch memory, 64-byte aligned: heap vectors (and MLX's arrays) are 8 or 16 bytes past a
// line, and a 64-byte vector or tile row that straddles two lines costs two (measured: an AMX block as
// the windows pipeline it took 1.5x as long with its operands 8 bytes off a line, bench/amx_tiles.c;
// the 4-bit AMX products 1.08-1.2x).
template <class T>
class Aligned64 {
 public:
  T* data() { return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw_.data()) + 63) & ~uintptr_t(63)); }
  // At least n elements (their values undefined).
  T* reserve(size_t n) {
    if (raw_.size() < n * sizeof(T) + 64) raw_.resize(n * sizeof(T) + 64);
    return data();
  }

 private:
  std::vector<unsigned char> raw_;
};

inline int scale_type(mx::Dtype d) {
  if (d == mx::float32) return F32;
  if (d == mx::bfloat16) return BF16;
  if (d == mx::float16) return F16;
  throw std::invalid_argument("mtp qmm: scales and biases must be float32, bfloat16 or float16");
}

// The outputs' memory and the CPU encoder's bookkeeping of inputs and outputs, as every eval_cpu starts.
inline mx::cpu::CommandEncoder& claim_outputs(mx::Stream s, const std::vector<mx::array>& inputs,
                                              std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(s);
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    enc.set_output_array(out);
  }
  return enc;
}

inline mx::cpu::CommandEncoder& claim_output(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out) {
  std::vector<mx::array> outputs = {out};  // a handle: its data is out's
  return claim_outputs(s, inputs, outputs);
}

// An input read in row-major order whatever its strides: its own memory when it is
// row-contiguous (weights, most activations), else a packed copy made when the task runs.
// Taking inputs as they come, instead of through mx::contiguous, saves a graph node an input
// (a 0.8B decode step runs ~190 products of 4 inputs, each node ~1-1.5 us of eval).
// Made in eval_cpu (the input's memory and strides are set by then); read with get() inside
// the dispatched task, where the input has been computed. Copies share the packed buffer.
class RowMajor {
 public:
  RowMajor() = default;
  explicit RowMajor(const mx::array& a)
      : src_(a.data<char>()), esz_(a.itemsize()), shape_(a.shape()), strides_(a.strides()),
        packed_(a.flags().row_contiguous || a.size() == 0) {
    if (!packed_) buf_ = std::make_shared<std::vector<char>>(a.size() * esz_);
  }

  template <class T>
  const T* get() const {
    if (packed_) return reinterpret_cast<const T*>(src_);
    pack();
    return reinterpret_cast<const T*>(buf_->data());
  }

 private:
  void pack() const {
    const int nd = int(shape_.size());
    std::vector<int> idx(nd, 0);
    char* out = buf_->data();
    const long inner = nd ? shape_[nd - 1] : 1;
    const int64_t step = nd ? strides_[nd - 1] * int64_t(esz_) : 0;
    for (size_t done = 0, total = buf_->size() / esz_; done < total; done += inner) {
      int64_t off = 0;
      for (int d = 0; d < nd - 1; d++) off += int64_t(idx[d]) * strides_[d];
      const char* p = src_ + off * int64_t(esz_);
      for (long i = 0; i < inner; i++, p += step, out += esz_) std::memcpy(out, p, esz_);
      for (int d = nd - 2; d >= 0; d--) {
        if (++idx[d] < shape_[d]) break;
        idx[d] = 0;
      }
    }
  }

  const char* src_ = nullptr;
  size_t esz_ = 4;
  mx::Shape shape_;
  mx::Strides strides_;
  bool packed_ = true;
  std::shared_ptr<std::vector<char>> buf_;
};

// Gradients through a native primitive (training a model that runs it, as the tests' scripted
// checkpoints do): MLX's own computation of the same values, differentiated. `f` takes the
// differentiable inputs (the first `n` of the primitive's), the others it captures.
inline std::vector<mx::array> reference_vjp(
    const std::function<std::vector<mx::array>(const std::vector<mx::array>&)>& f, size_t n,
    const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents, const std::vector<int>& argnums) {
  std::vector<mx::array> in(primals.begin(), primals.begin() + std::min(n, primals.size()));
  auto grads = mx::vjp(f, in, cotangents).second;
  std::vector<mx::array> out;
  for (int a : argnums) {
    if (size_t(a) >= grads.size()) throw std::invalid_argument("mtp native: no gradient for this input");
    out.push_back(grads[a]);
  }
  return out;
}
