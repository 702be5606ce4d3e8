// Generation's ops: RoPE at each row's own position, and attention with a KV cache (the rows' k and v written into
// the caches, then each row's query over its sequence's cache up to its own position). The twin of
// kernels/cuda/kv_cache.cu; the reference the tests hold both it and the model's decode path to is the training
// forward (rope_forward, attention_forward) over the whole sequence.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"

namespace trainer::cpu {

void rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS, float theta, int S) {
    TRAINER_CHECK(HS % 2 == 0, "rope needs an even head size, got {}", HS);
    for (int n = 0; n < N; ++n)
        TRAINER_CHECK(positions[n] >= 0 && positions[n] < S, "position {} of {}", positions[n], S);
    const int half = HS / 2, W = (NH + 2 * KVH) * HS;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        // The angles as rope_table_f32 computes them for row t = positions[n], so the rotation is rope_forward's.
        std::vector<float> cs(half), sn(half);
        for (int i = 0; i < half; ++i) {
            const float angle = static_cast<float>(positions[n]) * rope_inv_freq_f32(i, HS, theta);
            cs[i] = cosf(angle), sn[i] = sinf(angle);
        }
        float* base = qkv + static_cast<size_t>(n) * W;
        for (int head = 0; head < NH + KVH; ++head) {  // the q heads, then the k heads
            float* lo = base + static_cast<size_t>(head) * HS;
            float* hi = lo + half;
            for (int i = 0; i < half; ++i) {
                const float x0 = lo[i], x1 = hi[i];
                lo[i] = x0 * cs[i] - x1 * sn[i];
                hi[i] = x1 * cs[i] + x0 * sn[i];
            }
        }
    }
}

void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                          const int32_t* positions, int N, int NH, int KVH, int HS, int S) {
    check_shared_heads(NH, KVH);
    const int C = NH * HS, KV = KVH * HS, W = C + 2 * KV, group = NH / KVH;
    const auto cache_at = [&](float* cache, int seq, int h, int pos) {
        return cache + ((static_cast<size_t>(seq) * KVH + h) * S + pos) * HS;
    };
    for (int n = 0; n < N; ++n) {
        TRAINER_CHECK(positions[n] >= 0 && positions[n] < S, "position {} outside the cache of {}", positions[n], S);
        const float* row = qkv + static_cast<size_t>(n) * W;
        for (int h = 0; h < KVH; ++h) {
            std::copy_n(row + C + h * HS, HS, cache_at(kcache, seqs[n], h, positions[n]));
            std::copy_n(row + C + KV + h * HS, HS, cache_at(vcache, seqs[n], h, positions[n]));
        }
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
#pragma omp parallel for collapse(2) schedule(static)
    for (int n = 0; n < N; ++n) {
        for (int h = 0; h < NH; ++h) {
            const int len = positions[n] + 1;
            const float* q = qkv + static_cast<size_t>(n) * W + h * HS;
            const float* keys = cache_at(kcache, seqs[n], h / group, 0);
            const float* values = cache_at(vcache, seqs[n], h / group, 0);
            std::vector<float> p(len);
            float max = -INFINITY;
            for (int j = 0; j < len; ++j) {
                float s = 0.0f;
                for (int d = 0; d < HS; ++d) s += q[d] * keys[static_cast<size_t>(j) * HS + d];
                p[j] = s * scale;
                max = std::max(max, p[j]);
            }
            float sum = 0.0f;
            for (int j = 0; j < len; ++j) sum += (p[j] = std::exp(p[j] - max));
            float* o = out + static_cast<size_t>(n) * C + h * HS;
            std::fill_n(o, HS, 0.0f);
            for (int j = 0; j < len; ++j) {
                const float w = p[j] / sum;
                for (int d = 0; d < HS; ++d) o[d] += w * values[static_cast<size_t>(j) * HS + d];
            }
        }
    }
}

}  // namespace trainer::cpu
