// Shared element types and conversions for the CPU row kernels.
//
// The kernels work on raw buffers handed over from Python (torch tensors'
// data pointers), so the element type travels as a small enum rather than a
// C++ type. fp16/bf16 are stored as their 16-bit patterns and converted to
// float for arithmetic: every kernel accumulates them in float32 and rounds
// once, so results do not depend on how many rows were summed before.
#pragma once

#include <cstdint>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <cstring>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace sparsecomm {

enum class IndexType : int { kInt32 = 0, kInt64 = 1 };
enum class ValueType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

inline size_t value_size(ValueType t) {
  switch (t) {
    case ValueType::kFloat32: return 4;
    case ValueType::kFloat64: return 8;
    case ValueType::kFloat16: return 2;
    case ValueType::kBFloat16: return 2;
  }
  throw std::invalid_argument("sparsecomm: unknown value dtype code");
}

inline IndexType to_index_type(int code) {
  if (code != 0 && code != 1) throw std::invalid_argument("sparsecomm: ids must be int32 or int64");
  return static_cast<IndexType>(code);
}

inline ValueType to_value_type(int code) {
  if (code < 0 || code > 3)
    throw std::invalid_argument("sparsecomm: values must be float32, float64, float16 or bfloat16");
  return static_cast<ValueType>(code);
}

// Reads id i of an int32 or int64 buffer as int64.
inline int64_t load_id(const void* ids, IndexType t, int64_t i) {
  return t == IndexType::kInt32 ? static_cast<const int32_t*>(ids)[i]
                                : static_cast<const int64_t*>(ids)[i];
}

inline void store_id(void* ids, IndexType t, int64_t i, int64_t v) {
  if (t == IndexType::kInt32) static_cast<int32_t*>(ids)[i] = static_cast<int32_t>(v);
  else static_cast<int64_t*>(ids)[i] = v;
}

// ---- 16-bit float conversions (IEEE round-to-nearest-even, NaN preserved) ----

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t b = float_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // quiet NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // Subnormal: value = man * 2^-24, exact in float.
    float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_fp16(float f) {
  uint32_t b = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  b &= 0x7fffffffu;
  if (b > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (b >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf (after rounding)
  if (b < 0x38800000u) {
    // Result is subnormal or zero: scale so the rounding of the float add
    // (round-to-nearest-even) performs the fp16 rounding for us.
    float v = bits_to_float(b) + 0.5f;  // 0.5 = 2^-1: aligns the fp16 subnormal ulp (2^-24) to the float ulp
    return static_cast<uint16_t>(sign | (float_to_bits(v) - 0x3f000000u));
  }
  uint32_t man_odd = (b >> 13) & 1u;
  b += 0xc8000fffu + man_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (b >> 13));
}

// Accumulator traits: the type arithmetic happens in, and load/store of one element.
template <ValueType V> struct Elem;
template <> struct Elem<ValueType::kFloat32> {
  using storage = float; using acc = float;
  static acc load(storage x) { return x; }
  static storage store(acc x) { return x; }
};
template <> struct Elem<ValueType::kFloat64> {
  using storage = double; using acc = double;
  static acc load(storage x) { return x; }
  static storage store(acc x) { return x; }
};
template <> struct Elem<ValueType::kFloat16> {
  using storage = uint16_t; using acc = float;
  static acc load(storage x) { return fp16_to_float(x); }
  static storage store(acc x) { return float_to_fp16(x); }
};
template <> struct Elem<ValueType::kBFloat16> {
  using storage = uint16_t; using acc = float;
  static acc load(storage x) { return bf16_to_float(x); }
  static storage store(acc x) { return float_to_bf16(x); }
};

// Calls f.template operator()<V>() with the ValueType known at compile time.
#define SPARSECOMM_DISPATCH_VALUE(vt, ...)                                  \
  [&] {                                                                    \
    switch (vt) {                                                          \
      case ::sparsecomm::ValueType::kFloat32: {                            \
        constexpr auto V = ::sparsecomm::ValueType::kFloat32; return __VA_ARGS__(); } \
      case ::sparsecomm::ValueType::kFloat64: {                            \
        constexpr auto V = ::sparsecomm::ValueType::kFloat64; return __VA_ARGS__(); } \
      case ::sparsecomm::ValueType::kFloat16: {                            \
        constexpr auto V = ::sparsecomm::ValueType::kFloat16; return __VA_ARGS__(); } \
      case ::sparsecomm::ValueType::kBFloat16: {                           \
        constexpr auto V = ::sparsecomm::ValueType::kBFloat16; return __VA_ARGS__(); } \
    }                                                                      \
    throw std::invalid_argument("sparsecomm: unknown value dtype");        \
  }()

// Outputs at least this large get huge-page advice (advise_huge_pages).
constexpr size_t kHugePageOutputBytes = size_t{4} << 20;

// A fresh output (torch.empty: freshly mmapped, no page behind it yet) costs a page fault per 4 KiB on its
// first writes: 1M Zipf ids x 64 fp32 give a 35 MB output, ~8,600 faults. Transparent huge pages over the
// 2 MiB-aligned interior (honoured where THP is "always" or "madvise") turn those faults into ~16 that map
// and zero 2 MiB each, and the sum's random writes stop missing the TLB: a fresh output then costs about
// what a warm one does. Results do not change; a refused advice (THP "never", another OS) only leaves
// 4 KiB pages. The sharded tables' shards take the same advice (sparsecomm._library.empty_rows): their
// rows are read and updated at random, and with 4 KiB pages every row is a TLB miss.
inline void advise_huge_pages(void* out, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kHugePageOutputBytes) return;
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto base = reinterpret_cast<uintptr_t>(out);
  const uintptr_t lo = (base + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (base + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)out;
  (void)bytes;
#endif
}

inline int clamp_threads(int t) { return t < 1 ? 1 : t; }

// This thread's index and the size of the team OpenMP actually started (it
// may be smaller than requested: OMP_DYNAMIC, OMP_THREAD_LIMIT, nesting).
struct ThreadTeam {
  int id;
  int size;
};
inline ThreadTeam this_thread_team() {
#ifdef _OPENMP
  return {omp_get_thread_num(), omp_get_num_threads()};
#else
  return {0, 1};
#endif
}

// Minimum and maximum id, computed in parallel; (0, -1) for n == 0.
struct IdRange { int64_t min; int64_t max; };
IdRange id_range(const void* ids, IndexType it, int64_t n, int threads);

// Throws std::invalid_argument (Python ValueError) unless every id lies in [0, num_rows).
// num_rows < 0 means "no upper bound" (only negatives are rejected).
IdRange check_ids(const void* ids, IndexType it, int64_t n, int64_t num_rows, int threads,
                  const char* what);

}  // namespace sparsecomm
