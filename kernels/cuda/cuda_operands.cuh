// The CUDA backend's middle layer (cuda_operands.cu): how its ops read their operands. Between the runtime
// (cuda_runtime.cuh: device, memory, streams) and the ops (cuda_backend.cu), so that an op asks for its operand in the
// form its kernel takes and this layer decides where that comes from:
//   - bf16 GEMM weights: the bf16 words a weight is an alias of (alias_bf16: FSDP's gathered units, QLoRA's base), else
//     the held weight's copy cast once while it is held (hold_weight), else a cast now;
//   - activations cast to bf16 or widened to fp32 into the caller's scratch where stored in the other type;
//   - amp_fp8: an operand as FP8 codes (row-major and/or transposed in one pass) with the per-tensor scale of its
//     amax, which its producer wrote beside it or a pass of its own measures.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_runtime.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {

class CudaOperands : public CudaRuntime {
   public:
    explicit CudaOperands(const BackendOptions& options) : CudaRuntime(options) {}
    ~CudaOperands() override;

    void hold_weight(const float* w) override;
    bool gemms_read_aliases() const override { return options_.bf16_matmuls; }
    void alias_bf16(const float* w, const uint16_t* bf16, size_t n) override;
    void set_linear_precision(LinearPrecision p) override;

   protected:
    // The bf16 words a weight of n elements is an alias of (alias_bf16), or null.
    const uint16_t* aliased(const float* w, size_t n) const;
    // A weight as the FP8 casts read it: its aliased bf16 words (whose fp32 copy may be unwritten), else itself.
    GemmOperand weight_operand(const float* w, size_t n) const;
    // A GEMM weight in bf16: the words it is an alias of (alias_bf16); else the held weight's copy, cast once while
    // it is held; any other, cast now.
    const uint16_t* weight_bf16(const float* w, size_t n);
    // x's n elements cast to bf16 into `s`.
    const uint16_t* to_bf16(Scratch& s, const float* x, size_t n);
    // A GEMM operand as bf16: itself where stored so, else cast into `scratch`.
    const uint16_t* operand_bf16(Scratch& scratch, GemmOperand x, size_t n);
    // An fp32 operand (the fp32 GEMMs and the native attention): itself, or widened into `scratch`.
    const float* operand_f32(Scratch& scratch, GemmOperand x, size_t n);

    // ---- amp_fp8: the blocks' Linear layers on FP8 operands (the CPU's emulation: kernels/cpu/fp8_linear.cpp) ----
    // What an operand is cast for (its scratch and its scale's slot).
    enum Fp8Slot { kFp8Input, kFp8Weight, kFp8Gradient, kFp8Slots };
    struct Fp8Cast {
        Gemm::Fp8Matrix rows{}, cols{};  // the codes as stored (rows x cols) and transposed (cols x rows), or null
    };
    // x (rows x cols, fp32 or bf16) as FP8 codes of `f` with the per-tensor scale of its current amax: row-major
    // and/or transposed (one pass for both; the transposed rows padded with zero codes to a multiple of 16, for a
    // GEMM that sums over x's rows), the amax and the descale in the slot's two device floats.
    Fp8Cast to_fp8(Fp8Slot slot, GemmOperand x, int rows, int cols, Fp8Format f, bool row_major, bool transposed);
    // *amax = the largest |value| of x's n elements, by a pass of its own.
    void amax_pass(float* amax, GemmOperand x, size_t n);
    // A producer's output amax (GemmOperand::amax) where its kernel does not write one.
    void producer_amax(GemmOperand out, size_t n);
    static int fp8_padded(int rows) { return (rows + 15) / 16 * 16; }

    LinearPrecision linear_ = LinearPrecision::kDefault;  // amp_fp8 (set_linear_precision): the Linear layers' now

   private:
    // Each slot's amax and descale, then the amax pass's partials.
    float* fp8_scalars();

    struct Alias {
        uintptr_t at;  // the fp32 region's address
        size_t n;      // its elements
        const uint16_t* bf16;
    };
    std::vector<Alias> aliases_;  // alias_bf16's regions (a replica's frozen unit's bf16 parts while it is held)
    const float* held_ = nullptr;
    size_t held_numel_ = 0;
    Scratch held16_;  // the held weight's bf16 copy (hold_weight)
    Scratch b16_;     // any other weight's
    // amp_fp8: each slot's codes (row-major, transposed), the slots' amaxes and descales with the amax's partials.
    Scratch fp8_codes_[kFp8Slots][2];
    Scratch fp8_scalars_;
};

}  // namespace trainer::cuda
