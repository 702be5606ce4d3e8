// Grouped-query attention's shared key/value heads: expanded so every query head has its own k and v before the
// attention kernels run, and the gradients of the copies summed back into the shared heads. The twin of
// kernels/cuda/kv_heads.cu.
#include <algorithm>
#include <cstddef>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"

namespace trainer::cpu {
namespace {

// The query heads a shared head serves, and the widths of q (C) and of k and v (KV).
struct Heads {
    int group, C, KV;
};
Heads heads_of(int NH, int KVH, int HS) {
    check_shared_heads(NH, KVH);
    return {NH / KVH, NH * HS, KVH * HS};
}

}  // namespace

template <typename T>
void kv_heads_expand(T* out, const T* inp, int N, int NH, int KVH, int HS) {
    const auto [group, C, KV] = heads_of(NH, KVH, HS);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        const T* in = inp + static_cast<size_t>(n) * (C + 2 * KV);
        T* o = out + static_cast<size_t>(n) * 3 * C;
        std::copy_n(in, C, o);
        for (int h = 0; h < NH; ++h) {
            const int j = h / group;
            std::copy_n(in + C + j * HS, HS, o + C + h * HS);
            std::copy_n(in + C + KV + j * HS, HS, o + 2 * C + h * HS);
        }
    }
}

template <typename T>
void kv_heads_reduce(T* dinp, const T* dout, int N, int NH, int KVH, int HS) {
    const auto [group, C, KV] = heads_of(NH, KVH, HS);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        const T* d = dout + static_cast<size_t>(n) * 3 * C;
        T* di = dinp + static_cast<size_t>(n) * (C + 2 * KV);
        std::copy_n(d, C, di);
        for (int part = 1; part <= 2; ++part) {  // k, then v
            for (int j = 0; j < KVH; ++j) {
                for (int i = 0; i < HS; ++i) {
                    T sum = 0;  // the group's heads in order, as the CUDA kernel adds them
                    for (int g = 0; g < group; ++g) sum += d[part * C + (j * group + g) * HS + i];
                    di[C + (part - 1) * KV + j * HS + i] = sum;
                }
            }
        }
    }
}

template void kv_heads_expand<float>(float*, const float*, int, int, int, int);
template void kv_heads_expand<double>(double*, const double*, int, int, int, int);
template void kv_heads_reduce<float>(float*, const float*, int, int, int, int);
template void kv_heads_reduce<double>(double*, const double*, int, int, int, int);

}  // namespace trainer::cpu
