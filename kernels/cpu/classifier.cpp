// Fused softmax + cross-entropy + dlogits over the (N, V) logits, V = 50304 wide: the one
// activation that does not fit in cache, so each row is read from memory once for the loss (an
// online max + sum over L1-sized chunks) and written once with its gradient, in place.
// Sums run in double over a fixed chunk order, one row per task: bitwise repeatable for any thread
// count. The exponentials are element.h's exp_simd, which vectorises where expf would not.
// Targets < 0 are ignored (loss 0, gradient row 0), as PyTorch's ignore_index. The z-loss (PaLM's, OLMo's
// softmax_auxiliary_loss) needs nothing more than the row's logsumexp the loss already has: it scales the
// softmax part of the gradient by 1 + 2 z lse (exactly 1 without it, so the plain path is unchanged).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "base/common.h"
#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace trainer::cpu {

namespace {

// Columns per online-softmax chunk: the chunk is read once for its max and again, from L1, for the
// exponentials, which costs one rescale of the running sum per chunk instead of per element.
constexpr int kChunk = 1024;
// Explicit partial sums instead of an omp simd reduction, whose lane assignment would depend on how
// the compiler peels the loop for alignment and so on where the row happens to start.
constexpr int kLanes = 16;

// max_j x[j] over n > 0 elements (lane-wise, which vectorises where a max reduction did not).
template <typename T>
T max_of(const T* __restrict x, int n) {
    T lanes[kLanes];
    for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<T>::infinity();
    int j = 0;
    for (; j + kLanes <= n; j += kLanes) {
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
    }
    for (int l = 0; j < n; ++j, ++l) lanes[l] = x[j] > lanes[l] ? x[j] : lanes[l];
    T m = lanes[0];
    for (int l = 1; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
    return m;
}

// sum_j e^(x[j] - m) over n elements.
template <typename T>
T sum_exp(const T* __restrict x, int n, T m) {
    T lanes[kLanes] = {};
    int j = 0;
    for (; j + kLanes <= n; j += kLanes) {
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) lanes[l] += exp_simd(x[j + l] - m);
    }
    for (int l = 0; j < n; ++j, ++l) lanes[l] += exp_simd(x[j] - m);
    T sum = T(0);
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    return sum;
}

}  // namespace

template <typename T>
void classifier_forward_backward(T* logits, T* losses, const int32_t* targets, int N, int V, T dloss_scale,
                                 bool compute_grad, T z_loss_multiplier, T* z_losses) {
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
            if (z_losses != nullptr) z_losses[n] = T(0);
            if (compute_grad) std::fill(row, row + V, T(0));
            continue;
        }
        T m = -std::numeric_limits<T>::infinity();
        double sum = 0.0;
        for (int c0 = 0; c0 < V; c0 += kChunk) {
            const int c1 = std::min(V, c0 + kChunk);
            const T cm = max_of(row + c0, c1 - c0);
            if (cm > m) {
                // The first chunk rescales a zero sum; exp(-inf) = 0 keeps it zero.
                sum *= std::exp(static_cast<double>(m) - static_cast<double>(cm));
                m = cm;
            }
            sum += static_cast<double>(sum_exp(row + c0, c1 - c0, m));
        }
        const double lse = static_cast<double>(m) + std::log(sum);
        losses[n] = static_cast<T>(lse - static_cast<double>(row[target]));
        const T lse_t = static_cast<T>(lse);
        if (z_losses != nullptr) z_losses[n] = z_loss_multiplier * lse_t * lse_t;
        if (compute_grad) {
            // d(z lse^2)/d logit_j = 2 z lse softmax_j: the softmax term's scale grows by 2 z lse.
            const T softmax_scale =
                z_loss_multiplier != T(0) ? dloss_scale * (T(1) + T(2) * z_loss_multiplier * lse_t) : dloss_scale;
#pragma omp simd
            for (int j = 0; j < V; ++j) row[j] = exp_simd(row[j] - lse_t) * softmax_scale;
            row[target] -= dloss_scale;
        }
    }
}

template void classifier_forward_backward<float>(float*, float*, const int32_t*, int, int, float, bool, float, float*);
template void classifier_forward_backward<double>(double*, double*, const int32_t*, int, int, double, bool, double,
                                                  double*);

}  // namespace trainer::cpu
