// Squared L2 norm for gradient clipping. Fixed 64K-element chunks are summed in double, then the
// chunk partials are added in index order: the result depends on neither the thread count nor the
// schedule, so every rank and every rerun clips by exactly the same coefficient.
#include <algorithm>
#include <cstddef>
#include <vector>

#include "kernels/cpu/ops.h"

namespace trainer::cpu {

namespace {

constexpr size_t kChunk = size_t(1) << 16;
constexpr size_t kLanes = 16;

}  // namespace

template <typename T>
double squared_norm(const T* x, size_t n) {
    const long nchunks = static_cast<long>((n + kChunk - 1) / kChunk);
    std::vector<double> partial(static_cast<size_t>(nchunks), 0.0);
#pragma omp parallel for schedule(static) if (nchunks > 1)
    for (long c = 0; c < nchunks; ++c) {
        const size_t begin = static_cast<size_t>(c) * kChunk;
        const size_t end = std::min(n, begin + kChunk);
        // Explicit lanes, not an omp simd reduction: the compiler may peel a few elements to align
        // the loads, and then the rounding would depend on where the buffer happens to start.
        double lanes[kLanes] = {};
        size_t i = begin;
        for (; i + kLanes <= end; i += kLanes) {
#pragma omp simd
            for (size_t l = 0; l < kLanes; ++l) {
                const double xi = static_cast<double>(x[i + l]);
                lanes[l] += xi * xi;
            }
        }
        for (size_t l = 0; i < end; ++i, ++l) {
            const double xi = static_cast<double>(x[i]);
            lanes[l] += xi * xi;
        }
        double sum = 0.0;
        for (size_t l = 0; l < kLanes; ++l) sum += lanes[l];
        partial[static_cast<size_t>(c)] = sum;
    }
    double total = 0.0;
    for (const double p : partial) total += p;
    return total;
}

template double squared_norm<float>(const float*, size_t);
template double squared_norm<double>(const double*, size_t);

}  // namespace trainer::cpu
