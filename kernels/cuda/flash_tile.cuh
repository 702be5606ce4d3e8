// The register-level pieces our two flash attention forwards share (attention_flash.cu on mma.sync,
// attention_flash_sm90a.cu on Hopper's wgmma): both hold a warp's 16-row m-tiles of S and O in mma.sync's
// accumulator layout (per 8 columns j: (row g, columns 8 j + 2 t, + 1) and (row g + 8, the same); g = lane / 4,
// t = lane % 4), so the online softmax, the P operand and the epilogue are the same code. Compiled by nvcc, and by
// g++ onto tests/simt's emulator (the CUDA names from its shim).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace trainer::cuda::flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// log2(e) / sqrt(D): exp(x / sqrt(D)) = exp2(x * this), the same constant in the forwards and the backward.
inline float scale_log2e(int D) { return kLog2e / std::sqrt(static_cast<float>(D)); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// The A fragment (16 x 16, k-step kk) of a 16-row product from the accumulators of its two 8-column
// n-tiles (c0,c1 row g; c2,c3 row g + 8): FlashAttention-2's reuse of S / P / dS as an A operand.
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_bf16(lo[0], lo[1]), a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]), a[3] = pack_bf16(hi[2], hi[3]);
}

// One key tile's online softmax for a warp's MT m-tiles of S (kK keys from k0; the warp's first query w0):
// scale to base 2, the causal mask where `diagonal` (a key of the tile may lie past one of the warp's queries),
// the running maximum m and (quad-partial) sum l, O rescaled; S becomes P = exp2(S - m).
template <int MT, int kK, int D>
__device__ __forceinline__ void online_softmax(float (&s)[MT][kK / 8][4], float (&m)[MT][2], float (&l)[MT][2],
                                               float (&o)[MT][D / 8][4], int k0, int w0, bool diagonal,
                                               float scale_log2, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int row_lo = w0 + mt * 16 + g;
        float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
        for (int nt = 0; nt < kK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1), row = row_lo + (e >> 1) * 8;
                float x = s[mt][nt][e] * scale_log2;
                if (diagonal && key > row) x = -INFINITY;
                s[mt][nt][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        float alpha[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; ++r) alpha[r] = exp2f(m[mt][r] - mx[r]), m[mt][r] = mx[r];
#pragma unroll
        for (int nt = 0; nt < kK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[mt][nt][e] = exp2f(s[mt][nt][e] - m[mt][e >> 1]);
                rs[e >> 1] += s[mt][nt][e];
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[mt][r] = l[mt][r] * alpha[r] + rs[r];  // quad-partial, reduced at the end
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            o[mt][nt][0] *= alpha[0], o[mt][nt][1] *= alpha[0];
            o[mt][nt][2] *= alpha[1], o[mt][nt][3] *= alpha[1];
        }
    }
}

// The epilogue: O normalised by the row sums, as bf16 into out (B, T, NH * D), and the natural-log lse of the
// scaled scores into lse (B, NH, T), for the warp's MT m-tiles of (batch b, head h) from query w0; rows >= T are
// not written.
template <int MT, int D, typename Bf16>
__device__ __forceinline__ void write_rows(Bf16* out, float* lse, const float (&o)[MT][D / 8][4],
                                           const float (&m)[MT][2], const float (&l)[MT][2], int b, int h, int T,
                                           int NH, int w0, int g, int t) {
    const size_t out_stride = static_cast<size_t>(NH) * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = w0 + mt * 16 + g + r * 8;
            if (row >= T) continue;
            const float inv = 1.0f / sum;
            Bf16* dst = out + (static_cast<size_t>(b) * T + row) * out_stride + static_cast<size_t>(h) * D;
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                *reinterpret_cast<uint32_t*>(dst + nt * 8 + 2 * t) =
                    pack_bf16(o[mt][nt][2 * r] * inv, o[mt][nt][2 * r + 1] * inv);
            }
            if (t == 0) lse[(static_cast<size_t>(b) * NH + h) * T + row] = (m[mt][r] + log2f(sum)) * kLn2;
        }
    }
}

}  // namespace trainer::cuda::flash
