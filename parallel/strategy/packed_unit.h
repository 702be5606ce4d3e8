// A frozen unit's storage (LoRA's base) in a narrower form than its fp32 layout:
// - QLoRA (lora.quantize nf4): each of its block Linear weights as NF4 (kernels/element.h: the codes, two a byte,
//   then one fp32 absmax a block of 64 values, as bitsandbytes stores a Linear4bit weight; with double quantization
//   the absmaxes one byte each instead, then one fp32 a block of 256 of them and their offset);
// - under amp_bf16 and amp_fp8: each of its Linear weights (the blocks' and an untied LM head's) as bf16, the value
//   amp_bf16's GEMMs read anyway, so on CUDA the run computes what it computed with the weights in fp32 (amp_fp8's
//   casts start from the bf16 value; the CPU, which computes in fp32, reads the same bf16 values);
// - under bf16 parameters (FSDP's mixed and pure precision): every parameter as bf16;
// every other parameter as fp32, packed back to back in the unit's order, each part 4-byte aligned. This packed
// form is what a strategy keeps (the memory report's frozen_parameters), what FSDP shards and all-gathers, and what
// is unpacked into the unit's fp32 layout for compute. Packing happens once, on the host, when the base is loaded;
// unpacking on the device (Backend::nf4_dequantize, cast_bf16_to_float).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/layout.h"
#include "kernels/backend.h"

namespace trainer {

// Which form a frozen unit is stored in (above).
enum class FrozenForm {
    kFp32,         // every parameter fp32: the packed form is the unit
    kBf16Linears,  // the Linear weights bf16 (amp_bf16, amp_fp8)
    kBf16,         // every parameter bf16 (bf16 parameters)
    kNf4,          // the block Linear weights NF4 (QLoRA)
};
// A frozen unit's form: kNf4 for QLoRA's, else kBf16 where the strategy keeps bf16 parameters (`bf16_params`), else
// kBf16Linears under bf16 GEMMs, else kFp32 (a trained unit too).
FrozenForm frozen_form(const Unit& unit, bool bf16_params);

class PackedUnit {
   public:
    PackedUnit() = default;
    // `double_quant` (kNf4): the absmaxes double-quantized (kernels/element.h).
    PackedUnit(const Unit& unit, FrozenForm form, bool double_quant = false);

    // Whether the packed form is smaller than the unit (some part is narrower than fp32): a strategy keeps the unit
    // packed only then.
    bool narrower() const { return bytes_ < 4 * numel_; }

    size_t numel() const { return numel_; }  // the unit's fp32 elements
    size_t bytes() const { return bytes_; }  // the packed form's size, a multiple of 4
    size_t floats() const { return bytes_ / 4; }
    // Of those, the elements stored in NF4 and their bytes (codes and absmaxes).
    size_t nf4_numel() const { return nf4_numel_; }
    size_t nf4_bytes() const { return nf4_bytes_; }

    // The unit's fp32 values (host, numel) into the packed form (host, bytes).
    void pack(const float* unit, uint8_t* packed) const;
    // The packed form (device) into the unit's fp32 layout (device): what compute reads. `skip_linears`: the bf16
    // Linear weights are not written (a backend whose GEMMs read their words, Backend::gemms_read_aliases; `alias`
    // names them).
    void unpack(Backend& backend, float* unit, const uint8_t* packed, bool skip_linears = false) const;
    // Names the bf16 Linear weights of `packed` (device) as the words of their values in `unit`, its unpacked copy
    // (Backend::alias_bf16), so the GEMMs read them without a cast; `unalias` drops those names before `unit` holds
    // anything else.
    void alias(Backend& backend, const float* unit, const uint8_t* packed) const;
    void unalias(Backend& backend, const float* unit) const;
    // In place on the host: each value as unpack gives it back (the NF4 or bf16 weights' round trip).
    void round_trip(float* unit) const;

   private:
    enum class Store { kFp32, kBf16, kNf4 };
    struct Part {
        size_t offset = 0, numel = 0;  // elements of the unit
        size_t at = 0;                 // bytes into the packed form
        Store store = Store::kFp32;
        bool linears = false;  // Linear weights only (bf16_linear_stored): read by GEMMs alone
    };
    std::vector<Part> parts_;
    bool double_quant_ = false;
    size_t numel_ = 0, bytes_ = 0, nf4_numel_ = 0, nf4_bytes_ = 0;
};

// Whether a parameter is stored in NF4 under QLoRA: a Linear weight inside a block (the embedding, the LM head, the
// norms and the biases stay as they are, as bitsandbytes' QLoRA leaves them).
bool nf4_stored(const ParamSpec& p);
// Whether a parameter is stored in bf16 in kBf16Linears: a Linear weight (the blocks' and an untied LM head's), which
// only GEMMs read. The embedding (read by its lookup in fp32, and by a tied head), the norms and the biases are not.
bool bf16_linear_stored(const ParamSpec& p);

}  // namespace trainer
