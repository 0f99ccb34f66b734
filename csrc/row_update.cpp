// Row-wise Adagrad on distinct rows, in one pass: what ShardedAdagrad(rowwise=True) does per update.
//
// For each distinct slot s with gradient row g (d values):
//   acc[s] += mean(g * g);  weight[s] += g * (-lr / (sqrt(acc[s]) + eps))
// The torch version takes seven passes over the rows (square, mean, add into
// acc, gather acc, sqrt, divide, add into weight); this reads each gradient
// row once and touches each weight row once. Rows are distinct, so threads
// never share a row: no atomics, and the result does not depend on the
// thread count. The mean sums a row's squares in eight interleaved running
// sums (a fixed order, whatever the thread count), and the step multiplies by
// lr / std once per row (as fbgemm does): both can differ from torch's
// vectorized mean and (g / std) * -lr in the last bit.
#include <cmath>

#include "binding.h"
#include "ops.h"

namespace sparsecomm {

namespace {

template <typename T>
void rowwise_adagrad_rows(T* weight, T* acc, int64_t d, const int64_t* slots, int64_t k, const T* grad,
                          double lr, double eps, int threads) {
  const T neg_lr = static_cast<T>(-lr);
  const T eps_t = static_cast<T>(eps);
  const T inv_d = static_cast<T>(d);
  constexpr int64_t kAhead = 8;  // weight rows are hit at random: fetch a few slots ahead
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < k; ++i) {
    if (i + kAhead < k) {
      const char* ahead = reinterpret_cast<const char*>(weight + slots[i + kAhead] * d);
      for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(ahead + byte, 1);
      __builtin_prefetch(acc + slots[i + kAhead], 1);
    }
    const int64_t s = slots[i];
    const T* g = grad + i * d;
    // Eight running sums (lanes j mod 8), added in a fixed tree: the compiler keeps them in vector registers,
    // where one in-order sum waits on every add's latency (it was most of this kernel's time).
    T part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j0 = 0;
    for (; j0 + 8 <= d; j0 += 8)
      for (int u = 0; u < 8; ++u) part[u] += g[j0 + u] * g[j0 + u];
    T sq = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (int64_t j = j0; j < d; ++j) sq += g[j] * g[j];
    const T a = acc[s] + sq / inv_d;
    acc[s] = a;
    // One division per row, as fbgemm's row-wise Adagrad (w += g * (lr / std)): a division per element was
    // the kernel's other bottleneck (its throughput, not its latency). It rounds differently from
    // torch's (g / std) * -lr in the last bit.
    const T step = neg_lr / (std::sqrt(a) + eps_t);
    T* w = weight + s * d;
    for (int64_t j = 0; j < d; ++j) w[j] += g[j] * step;
  }
}

}  // namespace

// Row-wise Adagrad on k distinct rows (slots strictly increasing, checked with their bounds before any
// write): acc[s] += mean(g^2); weight[s] += g * (-lr / (sqrt(acc[s]) + eps)). float32/float64.
void rowwise_adagrad(void* weight, void* acc, int64_t num_rows, ValueType vt, int64_t d, const int64_t* slots,
                     int64_t k, const void* grad, double lr, double eps, int threads) {
  if (vt != ValueType::kFloat32 && vt != ValueType::kFloat64)
    throw std::invalid_argument("sparsecomm: rowwise_adagrad takes float32 or float64 rows");
  if (num_rows < 0 || d < 0 || k < 0) throw std::invalid_argument("sparsecomm: rowwise_adagrad: negative size");
  // Every slot in range and strictly increasing (distinct: no two threads write one row), before any write.
  for (int64_t i = 0; i < k; ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_rows)
      throw std::invalid_argument("sparsecomm: rowwise_adagrad: slot " + std::to_string(s) + " outside [0, " +
                                  std::to_string(num_rows) + ")");
    if (i > 0 && s <= slots[i - 1])
      throw std::invalid_argument("sparsecomm: rowwise_adagrad: slots must be strictly increasing (coalesced)");
  }
  if (k == 0) return;
  threads = clamp_threads(threads);
  if (vt == ValueType::kFloat32)
    rowwise_adagrad_rows(static_cast<float*>(weight), static_cast<float*>(acc), d, slots, k,
                         static_cast<const float*>(grad), lr, eps, threads);
  else
    rowwise_adagrad_rows(static_cast<double*>(weight), static_cast<double*>(acc), d, slots, k,
                         static_cast<const double*>(grad), lr, eps, threads);
}

// ---- binding ----

SPARSECOMM_BIND(row_update) {
  m.def("rowwise_adagrad",
        [](uintptr_t weight, uintptr_t acc, int64_t num_rows, int value_code, int64_t d, uintptr_t slots, int64_t k,
           uintptr_t grad, double lr, double eps, int threads) {
          const ValueType vt = to_value_type(value_code);
          py::gil_scoped_release release;
          rowwise_adagrad(ptr(weight), ptr(acc), num_rows, vt, d, ptr<const int64_t>(slots), k, ptr(grad), lr, eps,
                          threads);
        },
        py::arg("weight"), py::arg("acc"), py::arg("num_rows"), py::arg("value_code"), py::arg("d"),
        py::arg("slots"), py::arg("k"), py::arg("grad"), py::arg("lr"), py::arg("eps"), py::arg("threads"));
}

}  // namespace sparsecomm
