// Shared helpers of the copy kernels: plain CUDA (no torch headers), so `nvcc -c` builds each .cu on its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace stage4 {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;

// The widest vector (16/8/4/2/1 bytes) that divides every size, stride and address we copy with.
inline int vector_bytes(std::uintptr_t alignment_mask) {
  for (int bytes = 16; bytes > 1; bytes /= 2) {
    if ((alignment_mask & static_cast<std::uintptr_t>(bytes - 1)) == 0) return bytes;
  }
  return 1;
}

template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> { using type = uint4; };
template <>
struct VecOf<8> { using type = uint2; };
template <>
struct VecOf<4> { using type = uint32_t; };
template <>
struct VecOf<2> { using type = uint16_t; };
template <>
struct VecOf<1> { using type = uint8_t; };

}  // namespace stage4
