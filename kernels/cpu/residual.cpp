// Residual-stream adds and in-place scaling: pure bandwidth, so one fused pass each.
// No __restrict: out may alias a or b, and every element reads and writes only its own index.
#include <cstddef>

#include "kernels/cpu/ops.h"

namespace trainer::cpu {

template <typename T>
void residual_forward(T* out, const T* a, const T* b, size_t n) {
    const long count = static_cast<long>(n);
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < count; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void scale_inplace(T* x, size_t n, T s) {
    const long count = static_cast<long>(n);
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < count; ++i) x[i] *= s;
}

template void residual_forward<float>(float*, const float*, const float*, size_t);
template void residual_forward<double>(double*, const double*, const double*, size_t);
template void scale_inplace<float>(float*, size_t, float);
template void scale_inplace<double>(double*, size_t, double);

}  // namespace trainer::cpu
