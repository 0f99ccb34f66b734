// Shared device helpers for the sparsecomm CUDA row kernels.
//
// These sources are compiled at run time by NVRTC (through CuPy) and
// compile-checked by nvcc on machines without a GPU, so they include no
// headers at all: fp16/bf16 travel as their raw 16-bit patterns and are
// converted with PTX / bit manipulation. sparsecomm/_cuda.py inlines this file
// into each .cu before handing it to NVRTC (so CuPy's kernel cache sees a
// change here), which is why it must stay self-contained.
//
// Numerics mirror csrc/common.h and csrc/segment_reduce.h bit for bit: every
// group of rows is summed left to right in input order, fp16/bf16 in float32
// with one rounding (round-to-nearest-even) at the end.
#ifndef SPARSECOMM_CUDA_COMMON_CUH_
#define SPARSECOMM_CUDA_COMMON_CUH_

namespace sparsecomm {

// 64-bit everywhere: rows * d overflows 32 bits for large embedding tables.
typedef long long index_t;

// Storage for a 16-bit float. Distinct types, so that overloads and traits can
// tell fp16 from bf16 although both are 16 bits wide.
struct half_bits {
  unsigned short bits;
};
struct bf16_bits {
  unsigned short bits;
};

// Grid-stride loop bounds: launches cap the grid, so one thread may own
// several elements, and element indices exceed 32 bits.
__device__ __forceinline__ index_t global_thread_index() {
  return static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ index_t grid_stride() {
  return static_cast<index_t>(gridDim.x) * blockDim.x;
}

// ---- 16-bit float conversions -------------------------------------------------

__device__ __forceinline__ float half_to_float(unsigned short h) {
  float f;
  // cvt is exact for every fp16 value and needs no cuda_fp16.h.
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short float_to_half(float f) {
  const unsigned int b = __float_as_uint(f);
  // NaN encoded as the CPU kernel does (sign kept, quiet bit set); PTX would
  // return a canonical NaN instead.
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<unsigned short>(((b >> 16) & 0x8000u) | 0x7e00u);
  }
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float bf16_to_float(unsigned short h) {
  return __uint_as_float(static_cast<unsigned int>(h) << 16);
}

__device__ __forceinline__ unsigned short float_to_bf16(float f) {
  // Bit manipulation rather than cvt.rn.bf16.f32, which needs sm_80.
  unsigned int b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<unsigned short>((b >> 16) | 0x40u);  // quiet NaN
  }
  b += 0x7fffu + ((b >> 16) & 1u);  // round to nearest even
  return static_cast<unsigned short>(b >> 16);
}

// ---- accumulator traits -------------------------------------------------------

// The type a value is summed in, and the conversions to and from storage.
template <typename T>
struct Accum;

template <>
struct Accum<float> {
  typedef float type;
  __device__ __forceinline__ static float load(float x) { return x; }
  __device__ __forceinline__ static float store(float x) { return x; }
};

template <>
struct Accum<double> {
  typedef double type;
  __device__ __forceinline__ static double load(double x) { return x; }
  __device__ __forceinline__ static double store(double x) { return x; }
};

template <>
struct Accum<half_bits> {
  typedef float type;
  __device__ __forceinline__ static float load(half_bits x) { return half_to_float(x.bits); }
  __device__ __forceinline__ static half_bits store(float x) {
    half_bits h;
    h.bits = float_to_half(x);
    return h;
  }
};

template <>
struct Accum<bf16_bits> {
  typedef float type;
  __device__ __forceinline__ static float load(bf16_bits x) { return bf16_to_float(x.bits); }
  __device__ __forceinline__ static bf16_bits store(float x) {
    bf16_bits h;
    h.bits = float_to_bf16(x);
    return h;
  }
};

// ---- segment reduction --------------------------------------------------------

// Sums one column of one group of rows, left to right in input order.
//
// The group is order[seg_start[g] : seg_start[g + 1]] (positions into
// `values`, stably sorted by id, so their order is the input order). With
// `init` the sum starts from *init (scatter-add into an existing table row);
// without it, from the group's first row rather than zero, so that a lone
// -0.0 stays -0.0 exactly as on the CPU.
template <typename T>
__device__ __forceinline__ typename Accum<T>::type reduce_group_column(
    const T* __restrict__ values, const index_t* __restrict__ order,
    const index_t* __restrict__ seg_start, index_t g, index_t col, index_t d, const T* init) {
  typedef Accum<T> A;
  index_t k = seg_start[g];
  const index_t end = seg_start[g + 1];
  typename A::type acc;
  if (init != 0) {
    acc = A::load(*init);
  } else {
    acc = A::load(values[order[k] * d + col]);
    ++k;
  }
  // Hot ids under Zipf skew make long groups: issue a batch of independent
  // loads before the dependent adds, so a thread waits for memory once per
  // batch rather than once per row. The adds keep their left-to-right order.
  const int kBatch = 8;
  for (; k + kBatch <= end; k += kBatch) {
    T v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) v[j] = values[order[k + j] * d + col];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) acc += A::load(v[j]);
  }
  for (; k < end; ++k) {
    acc += A::load(values[order[k] * d + col]);
  }
  return acc;
}

}  // namespace sparsecomm

#endif  // SPARSECOMM_CUDA_COMMON_CUH_
