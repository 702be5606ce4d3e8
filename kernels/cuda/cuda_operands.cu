// How the CUDA backend's ops read their operands (see cuda_operands.cuh).
#include <algorithm>

#include "base/common.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_operands.cuh"
#include "kernels/cuda/timeline.h"

namespace trainer::cuda {

CudaOperands::~CudaOperands() {
    release(held16_);
    release(b16_);
    release(fp8_scalars_);
    for (auto& pair : fp8_codes_) release(pair[0]), release(pair[1]);
}

void CudaOperands::hold_weight(const float* w) {
    const OpMark mark(*timeline_, "hold_weight");
    held_ = w;
    held_numel_ = 0;  // cast on first use
}

void CudaOperands::alias_bf16(const float* w, const uint16_t* bf16, size_t n) {
    const auto at = reinterpret_cast<uintptr_t>(w);
    aliases_.erase(std::remove_if(aliases_.begin(), aliases_.end(), [&](const Alias& a) { return a.at == at; }),
                   aliases_.end());
    if (bf16 != nullptr && n > 0) aliases_.push_back({at, n, bf16});
}

void CudaOperands::set_linear_precision(LinearPrecision p) {
    TRAINER_CHECK(p == LinearPrecision::kDefault || options_.fp8_linears,
                  "FP8 Linear layers on a backend made without amp_fp8");
    linear_ = p;
}

const uint16_t* CudaOperands::aliased(const float* w, size_t n) const {
    const auto at = reinterpret_cast<uintptr_t>(w);
    for (const Alias& a : aliases_) {
        if (at >= a.at && at + n * sizeof(float) <= a.at + a.n * sizeof(float))
            return a.bf16 + (at - a.at) / sizeof(float);
    }
    return nullptr;
}

GemmOperand CudaOperands::weight_operand(const float* w, size_t n) const {
    const uint16_t* words = aliased(w, n);
    return words != nullptr ? GemmOperand::in_bf16(const_cast<uint16_t*>(words)) : GemmOperand(w);
}

const uint16_t* CudaOperands::weight_bf16(const float* w, size_t n) {
    if (const uint16_t* words = aliased(w, n)) return words;
    if (w == nullptr || w != held_) return to_bf16(b16_, w, n);
    if (held_numel_ != n) {
        to_bf16(held16_, w, n);
        held_numel_ = n;
    }
    return static_cast<const uint16_t*>(held16_.ptr);
}

const uint16_t* CudaOperands::to_bf16(Scratch& s, const float* x, size_t n) {
    auto* out = static_cast<uint16_t*>(grow(s, n * sizeof(uint16_t)));
    cuda::cast_float_to_bf16(out, x, n, stream_);
    return out;
}

const uint16_t* CudaOperands::operand_bf16(Scratch& scratch, GemmOperand x, size_t n) {
    return x.bf16 ? x.b16() : to_bf16(scratch, x.f32(), n);
}

const float* CudaOperands::operand_f32(Scratch& scratch, GemmOperand x, size_t n) {
    if (!x.bf16) return x.f32();
    auto* wide = static_cast<float*>(grow(scratch, n * sizeof(float)));
    cuda::cast_bf16_to_float(wide, x.b16(), n, stream_);
    return wide;
}

CudaOperands::Fp8Cast CudaOperands::to_fp8(Fp8Slot slot, GemmOperand x, int rows, int cols, Fp8Format f, bool row_major,
                                           bool transposed) {
    float *amax = fp8_scalars() + 2 * slot, *descale = amax + 1;
    const size_t n = static_cast<size_t>(rows) * cols;
    const int ld_t = fp8_padded(rows);
    auto* out = row_major ? static_cast<uint8_t*>(grow(fp8_codes_[slot][0], n)) : nullptr;
    auto* out_t =
        transposed ? static_cast<uint8_t*>(grow(fp8_codes_[slot][1], static_cast<size_t>(ld_t) * cols)) : nullptr;
    // The amax its producer wrote beside it (GemmOperand::amax), else a pass of its own.
    if (x.amax != nullptr) {
        amax = x.amax;
    } else {
        amax_pass(amax, x, n);
    }
    if (x.bf16) {
        cuda::fp8_cast_transpose(out, out_t, x.b16(), rows, cols, amax, f, descale, stream_, ld_t);
    } else {
        cuda::fp8_cast_transpose(out, out_t, x.f32(), rows, cols, amax, f, descale, stream_, ld_t);
    }
    return Fp8Cast{{out, f, descale}, {out_t, f, descale}};
}

float* CudaOperands::fp8_scalars() {
    return static_cast<float*>(grow(fp8_scalars_, (2 * kFp8Slots + kNormBlocks) * sizeof(float)));
}

void CudaOperands::amax_pass(float* amax, GemmOperand x, size_t n) {
    float* partials = fp8_scalars() + 2 * kFp8Slots;
    if (x.bf16) return cuda::fp8_amax(amax, x.b16(), n, partials, stream_);
    cuda::fp8_amax(amax, x.f32(), n, partials, stream_);
}

void CudaOperands::producer_amax(GemmOperand out, size_t n) {
    if (out.amax != nullptr) amax_pass(out.amax, out, n);
}

}  // namespace trainer::cuda
