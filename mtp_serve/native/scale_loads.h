// One scale or bias of MLX's affine quantization, whatever its dtype (fp32, bf16, fp16), as fp32.
// Included inside each source's own namespace (quantized_matmul.cpp, quantized_attention.cpp),
// after <immintrin.h>, <cstdint> and <cstring>.
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
