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

// Programmatic dependent launch (sm_90+, as kernel/pdl.py's pdl_wait for the Triton kernels): wait until the
// previous kernel's writes are visible, then let the next kernel launch. A no-op in a launch without PDL.
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace stage4
