// The CUB device algorithms kernels/cuda/embedding.cu calls, for the emulated build: CUB's two-phase protocol (a
// call with no temporary storage asks its size; the next runs with it, queued on the stream), the results computed
// on the CPU when the stream reaches them. The storage asked for is checked to have been given.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace cub {
namespace simt_detail {

// The bytes each algorithm asks for: enough that a caller who gives less is caught.
inline size_t temp_bytes(int n) { return 256 + static_cast<size_t>(n < 0 ? 0 : n) * 8; }

template <class Work>
cudaError_t run(void* temp, size_t& bytes, int n, cudaStream_t stream, const char* what, Work work) {
    if (n < 0) return cudaErrorInvalidValue;
    if (temp == nullptr) {
        bytes = temp_bytes(n);
        return cudaSuccess;
    }
    if (bytes < temp_bytes(n) || !simt::rt::device_accessible(temp, temp_bytes(n))) return cudaErrorInvalidValue;
    return simt::rt::enqueue(stream, what, work);
}

}  // namespace simt_detail

struct DeviceRadixSort {
    // A stable sort of (key, value) pairs by the key's bits [begin_bit, end_bit).
    template <class K, class V>
    static cudaError_t SortPairs(void* temp, size_t& bytes, const K* keys_in, K* keys_out, const V* values_in,
                                 V* values_out, int n, int begin_bit = 0, int end_bit = sizeof(K) * 8,
                                 cudaStream_t stream = nullptr) {
        return simt_detail::run(temp, bytes, n, stream, "cub::DeviceRadixSort::SortPairs", [=] {
            const uint64_t mask = (end_bit - begin_bit >= 64 ? ~0ULL : ((1ULL << (end_bit - begin_bit)) - 1))
                                  << begin_bit;
            std::vector<int> order(static_cast<size_t>(n));
            std::iota(order.begin(), order.end(), 0);
            auto bits = [&](int i) { return static_cast<uint64_t>(keys_in[i]) & mask; };
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return bits(a) < bits(b); });
            std::vector<K> k(static_cast<size_t>(n));
            std::vector<V> v(static_cast<size_t>(n));
            for (int i = 0; i < n; ++i) k[i] = keys_in[order[i]], v[i] = values_in[order[i]];
            std::copy(k.begin(), k.end(), keys_out);
            std::copy(v.begin(), v.end(), values_out);
        });
    }
};

struct DeviceRunLengthEncode {
    // The runs of equal consecutive items: each run's item, its length, and the number of runs.
    template <class T, class C, class N>
    static cudaError_t Encode(void* temp, size_t& bytes, const T* in, T* unique_out, C* counts_out, N* num_runs_out,
                              int n, cudaStream_t stream = nullptr) {
        return simt_detail::run(temp, bytes, n, stream, "cub::DeviceRunLengthEncode::Encode", [=] {
            N runs = 0;
            for (int i = 0; i < n;) {
                int j = i + 1;
                while (j < n && in[j] == in[i]) ++j;
                unique_out[runs] = in[i];
                counts_out[runs] = static_cast<C>(j - i);
                ++runs;
                i = j;
            }
            *num_runs_out = runs;
        });
    }
};

struct DeviceScan {
    template <class T, class U>
    static cudaError_t ExclusiveSum(void* temp, size_t& bytes, const T* in, U* out, int n,
                                    cudaStream_t stream = nullptr) {
        return simt_detail::run(temp, bytes, n, stream, "cub::DeviceScan::ExclusiveSum", [=] {
            U sum = 0;
            for (int i = 0; i < n; ++i) {
                const U x = static_cast<U>(in[i]);
                out[i] = sum;
                sum += x;
            }
        });
    }
};

}  // namespace cub
