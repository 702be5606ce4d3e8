// Fused softmax + cross-entropy + dlogits over the (N, V) logits, V = 50304 wide: the one
// activation that does not fit in cache, so each row is read from memory once for the loss (an
// online max + sum over L1-sized chunks) and written once with its gradient, in place.
// Sums run in double over a fixed chunk order, one row per task: bitwise repeatable for any thread
// count. Targets < 0 are ignored (loss 0, gradient row 0), as PyTorch's ignore_index.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "core/common.h"
#include "kernels/cpu/ops.h"

namespace trainer::cpu {

namespace {

// Columns per online-softmax chunk: the chunk is read once for its max and again, from L1, for the
// exponentials, which costs one rescale of the running sum per chunk instead of per element.
constexpr int kChunk = 1024;

}  // namespace

template <typename T>
void classifier_forward_backward(T* logits, T* losses, const int32_t* targets, int N, int V, T dloss_scale,
                                 bool compute_grad) {
    // Checked before the parallel loop: an exception cannot leave an OpenMP region.
    for (int n = 0; n < N; ++n) {
        TRAINER_CHECK(targets[n] < V, "target {} of row {} is outside the vocabulary of {}", targets[n], n, V);
    }
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        T* __restrict row = logits + static_cast<size_t>(n) * V;
        const int target = targets[n];
        if (target < 0) {
            losses[n] = T(0);
            if (compute_grad) std::fill(row, row + V, T(0));
            continue;
        }
        T m = -std::numeric_limits<T>::infinity();
        double sum = 0.0;
        for (int c0 = 0; c0 < V; c0 += kChunk) {
            const int c1 = std::min(V, c0 + kChunk);
            T cm = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : cm)
            for (int j = c0; j < c1; ++j) cm = std::max(cm, row[j]);
            if (cm > m) {
                // The first chunk rescales a zero sum; exp(-inf) = 0 keeps it zero.
                sum *= std::exp(static_cast<double>(m) - static_cast<double>(cm));
                m = cm;
            }
            T chunk_sum = T(0);
            for (int j = c0; j < c1; ++j) chunk_sum += std::exp(row[j] - m);
            sum += static_cast<double>(chunk_sum);
        }
        const double lse = static_cast<double>(m) + std::log(sum);
        losses[n] = static_cast<T>(lse - static_cast<double>(row[target]));
        if (compute_grad) {
            const T lse_t = static_cast<T>(lse);
            for (int j = 0; j < V; ++j) row[j] = std::exp(row[j] - lse_t) * dloss_scale;
            row[target] -= dloss_scale;
        }
    }
}

template void classifier_forward_backward<float>(float*, float*, const int32_t*, int, int, float, bool);
template void classifier_forward_backward<double>(double*, double*, const int32_t*, int, int, double, bool);

}  // namespace trainer::cpu
