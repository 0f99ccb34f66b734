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

// ---- long groups: the whole block stages their rows ---------------------------
//
// Under Zipf skew one id can own a tenth of all rows, and the threads of its
// columns would walk them alone while the rest of the GPU idles. So each op
// is two launches on one stream: the per-thread kernel sums the short groups
// (reduce_short_groups) and skips the long ones; the long-group kernel
// (reduce_long_groups) gives each (long group, tile of columns) a whole block:
// all its threads copy chunks of the group's rows into shared memory,
// coalesced and many loads in flight, while the group's own column threads
// add the previous chunk. Each column is still summed by one thread, row
// after row in input order, from the same start value: the same float adds as
// reduce_group_column, so the same bits. Two kernels keep the staging's
// registers out of the short groups' kernel, whose occupancy they would cut.

// Threads per block the staging is written for; sparsecomm/_cuda.py's BLOCK.
// Another block size still gives exact results, through the per-thread path.
// The host sets the threshold (sparsecomm/_library/_rows.py, LONG_ROWS); the
// short groups' kernel lists the long groups it skips, in device memory
// (long_groups, *num_long: in no fixed order, which changes no sum: each
// group is summed by one block in row order), and the long groups' kernel
// reads that list. No host sync between the two launches: where no group is
// long (uniform ids), the second launch finds an empty list and returns.
constexpr int kBlock = 256;

// A staged chunk is `chunk` rows x `cols` columns, row-major in shared memory.
// Thread i loads column i % cols of rows i / cols + m * (kBlock / cols),
// m < kLoads: a warp reads neighbouring columns (coalesced), and each of its
// loads needs only one row index. Threads past the last whole row of the
// block's width (i >= (kBlock / cols) * cols) load nothing.
template <typename T>
struct Stage {
  // Values in flight per thread: the long-group kernel runs a few blocks, so
  // registers matter less than loads in flight.
  static constexpr int kLoads = sizeof(T) > 4 ? 8 : 16;
  static constexpr int kElems = kBlock * kLoads;  // 16 KiB fp32 and fp64, 8 KiB 16-bit
};

// Rows per chunk for `cols` columns: as many as the loads cover, at most kBlock.
template <typename T>
__device__ __forceinline__ int chunk_rows(int cols) {
  const int rows = (kBlock / cols) * Stage<T>::kLoads;
  return rows < kBlock ? rows : kBlock;
}

// Loads this thread's elements of a chunk's first `rows` rows into v: row r,
// column c is values[idx[r] * d + c0 + c].
template <typename T>
__device__ __forceinline__ void stage_load(T (&v)[Stage<T>::kLoads], const T* __restrict__ values,
                                           const index_t* idx, int rows, int cols, index_t d,
                                           index_t c0) {
  const int step = kBlock / cols;
  const int r0 = threadIdx.x / cols;
  if (r0 >= step) return;
  const T* column = values + c0 + (threadIdx.x - r0 * cols);
#pragma unroll
  for (int m = 0; m < Stage<T>::kLoads; ++m) {
    const int r = r0 + m * step;
    if (r < rows) v[m] = column[idx[r] * d];
  }
}

// Stores what stage_load loaded to the chunk in shared memory.
template <typename T>
__device__ __forceinline__ void stage_store(const T (&v)[Stage<T>::kLoads], T* staged, int rows,
                                            int cols) {
  const int step = kBlock / cols;
  const int r0 = threadIdx.x / cols;
  if (r0 >= step) return;
  T* column = staged + (threadIdx.x - r0 * cols);
#pragma unroll
  for (int m = 0; m < Stage<T>::kLoads; ++m) {
    const int r = r0 + m * step;
    if (r < rows) column[r * cols] = v[m];
  }
}

// acc plus column `col` of `rows` staged rows of `cols` columns, in row order.
template <typename T>
__device__ __forceinline__ typename Accum<T>::type add_staged(typename Accum<T>::type acc,
                                                              const T* staged, int rows, int cols,
                                                              int col) {
#pragma unroll 4
  for (int r = 0; r < rows; ++r) acc += Accum<T>::load(staged[r * cols + col]);
  return acc;
}

inline __device__ int min_rows(index_t a, int b) { return a < b ? static_cast<int>(a) : b; }

// Returns acc plus rows order[k : end] of columns c0 .. c0 + cols of `values`,
// summed by the block: every thread of the block calls it with the same k,
// end, c0 and cols; thread `col >= 0` adds column c0 + col and gets the sum,
// the others only load. Double-buffered: chunk i + 1's values travel into
// registers and chunk i + 2's row indices arrive while chunk i is added.
template <typename T>
__device__ typename Accum<T>::type block_sum_rows(const T* __restrict__ values,
                                                  const index_t* __restrict__ order, index_t k,
                                                  index_t end, index_t d, index_t c0, int cols,
                                                  int col, typename Accum<T>::type acc) {
  __shared__ T staged[Stage<T>::kElems];
  __shared__ index_t idx[kBlock];
  const int chunk = chunk_rows<T>(cols);
  const int tid = threadIdx.x;
  T v[Stage<T>::kLoads];
  index_t next = tid < chunk && k + tid < end ? order[k + tid] : 0;
  __syncthreads();  // a previous call is done with the shared buffers
  idx[tid] = next;
  __syncthreads();
  stage_load<T>(v, values, idx, min_rows(end - k, chunk), cols, d, c0);
  next = tid < chunk && k + chunk + tid < end ? order[k + chunk + tid] : 0;
  for (; k < end; k += chunk) {
    const int rows = min_rows(end - k, chunk);
    __syncthreads();  // the previous chunk is added and its successor's indices read
    stage_store<T>(v, staged, rows, cols);
    idx[tid] = next;
    __syncthreads();
    if (k + chunk < end) {
      stage_load<T>(v, values, idx, min_rows(end - k - chunk, chunk), cols, d, c0);
      const index_t ahead = k + 2 * chunk + tid;
      next = tid < chunk && ahead < end ? order[ahead] : 0;
    }
    if (col >= 0) acc = add_staged<T>(acc, staged, rows, cols, col);
  }
  return acc;
}

// ---- the two kernels' bodies ---------------------------------------------------

// Target says where the sum of (group g, column col) goes, t = g * d + col:
//   T* dst(g, col, t) const   the output element, or 0 to skip the pair;
//   kAccumulate               true: the sum starts from *dst (scatter-add);
//                             false: from the group's first row (coalesce).

__device__ __forceinline__ bool is_long(const index_t* __restrict__ seg_start, index_t g, index_t long_rows) {
  return seg_start[g + 1] - seg_start[g] > long_rows;
}

// One (group, column) pair summed by its own thread.
template <typename T, typename Target>
__device__ __forceinline__ void reduce_pair(const T* __restrict__ values,
                                            const index_t* __restrict__ order,
                                            const index_t* __restrict__ seg_start, index_t g,
                                            index_t col, index_t d, index_t t,
                                            const Target& target) {
  T* dst = target.dst(g, col, t);
  if (dst == 0) return;
  const T* init = Target::kAccumulate ? dst : 0;
  *dst = Accum<T>::store(reduce_group_column<T>(values, order, seg_start, g, col, d, init));
}

// The short groups' kernel: grid-stride over the (group, column) pairs, one
// thread a pair; groups of more than long_rows rows are appended (by their
// column-0 thread) to long_groups[0 .. capacity) and counted in *num_long,
// for reduce_long_groups (or, with a block size other than kBlock, summed
// here too).
template <typename T, typename Target>
__device__ __forceinline__ void reduce_short_groups(const T* __restrict__ values,
                                                    const index_t* __restrict__ order,
                                                    const index_t* __restrict__ seg_start,
                                                    index_t num_groups, index_t d, index_t long_rows,
                                                    index_t* __restrict__ long_groups,
                                                    index_t* __restrict__ num_long, index_t capacity,
                                                    const Target& target) {
  const index_t total = num_groups * d;
  const bool all = blockDim.x != kBlock;
  for (index_t t = global_thread_index(); t < total; t += grid_stride()) {
    const index_t g = t / d;
    const index_t col = t - g * d;
    if (all || !is_long(seg_start, g, long_rows)) {
      reduce_pair<T>(values, order, seg_start, g, col, d, t, target);
    } else if (col == 0) {
      const index_t at = static_cast<index_t>(atomicAdd(reinterpret_cast<unsigned long long*>(num_long), 1ULL));
      if (at < capacity) long_groups[at] = g;  // the host sizes the list for every possible long group
    }
  }
}

// The long groups' kernel: block-stride over (long group, tile of kBlock
// columns) items, long_groups[0 .. *num_long) listing the long groups (the
// short groups' kernel listed them). Launched with capacity * ceil(d / kBlock)
// * kBlock "elements" (one block an item, the grid capped): the host does not
// wait to learn how many there are.
template <typename T, typename Target>
__device__ void reduce_long_groups(const T* __restrict__ values, const index_t* __restrict__ order,
                                   const index_t* __restrict__ seg_start,
                                   const index_t* __restrict__ long_groups,
                                   const index_t* __restrict__ num_long_at, index_t capacity,
                                   index_t d, const Target& target) {
  typedef Accum<T> A;
  if (blockDim.x != kBlock) return;  // reduce_short_groups summed every pair
  const index_t num_long = *num_long_at < capacity ? *num_long_at : capacity;
  const index_t tiles = (d + kBlock - 1) / kBlock;
  for (index_t item = blockIdx.x; item < num_long * tiles; item += gridDim.x) {
    const index_t at = item / tiles;
    const index_t g = long_groups[at];
    const index_t c0 = (item - at * tiles) * kBlock;
    const int cols = static_cast<int>(d - c0 < kBlock ? d - c0 : kBlock);
    const int col = static_cast<int>(threadIdx.x) < cols ? static_cast<int>(threadIdx.x) : -1;
    const index_t t = g * d + c0 + col;
    T* dst = col >= 0 ? target.dst(g, c0 + col, t) : 0;
    const index_t start = seg_start[g];
    typename A::type acc = 0;
    index_t k = start;
    if (Target::kAccumulate) {
      if (dst != 0) acc = A::load(*dst);
    } else {
      if (col >= 0) acc = A::load(values[order[start] * d + c0 + col]);
      ++k;
    }
    acc = block_sum_rows<T>(values, order, k, seg_start[g + 1], d, c0, cols, col, acc);
    if (dst != 0) *dst = A::store(acc);
  }
}

}  // namespace sparsecomm

#endif  // SPARSECOMM_CUDA_COMMON_CUH_
