// What the native primitives' sources share (quantized_matmul.cpp, quantized_attention.cpp,
// gated_delta.cpp, activations.cpp): the dtype of MLX's affine scales and biases, one of them
// loaded as fp32, and an eval's outputs claimed.
// Included inside each source's own namespace, after <immintrin.h>, <cstdint>, <cstring>,
// <stdexcept> and MLX's headers.
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
