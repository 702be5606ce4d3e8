// QLoRA's storage of a frozen unit (lora.quantize nf4): each of its block Linear weights as NF4 (kernels/element.h:
// the codes, two a byte, then one fp32 absmax a block of 64 values, as bitsandbytes stores a Linear4bit weight; with
// double quantization the absmaxes one byte each instead, then one fp32 a block of 256 of them and their offset),
// every other parameter (norms, and the embedding and head units whole) as fp32, packed back to back in the unit's
// order, each part 4-byte aligned. This packed form is what a strategy keeps (the memory report's frozen_parameters),
// what FSDP shards and all-gathers, and what is unpacked into the unit's fp32 layout for compute. Packing happens once,
// on the host, when the base is loaded; unpacking on the device, through Backend::nf4_dequantize.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/layout.h"
#include "kernels/backend.h"

namespace trainer {

class PackedUnit {
   public:
    PackedUnit() = default;
    // `quantize`: the unit's block Linear weights in NF4; false: every parameter fp32 (the packed form is the unit).
    // `double_quant`: their absmaxes double-quantized (kernels/element.h).
    PackedUnit(const Unit& unit, bool quantize, bool double_quant = false);

    size_t numel() const { return numel_; }  // the unit's fp32 elements
    size_t bytes() const { return bytes_; }  // the packed form's size, a multiple of 4
    size_t floats() const { return bytes_ / 4; }
    // Of those, the elements stored in NF4 and their bytes (codes and absmaxes).
    size_t nf4_numel() const { return nf4_numel_; }
    size_t nf4_bytes() const { return nf4_bytes_; }

    // The unit's fp32 values (host, numel) into the packed form (host, bytes).
    void pack(const float* unit, uint8_t* packed) const;
    // The packed form (device) into the unit's fp32 layout (device): what compute reads.
    void unpack(Backend& backend, float* unit, const uint8_t* packed) const;
    // In place on the host: each value as unpack gives it back (the NF4 weights' round trip).
    void round_trip(float* unit) const;

   private:
    struct Part {
        size_t offset = 0, numel = 0;  // elements of the unit
        size_t at = 0;                 // bytes into the packed form
        bool nf4 = false;
    };
    std::vector<Part> parts_;
    bool double_quant_ = false;
    size_t numel_ = 0, bytes_ = 0, nf4_numel_ = 0, nf4_bytes_ = 0;
};

// Whether a parameter is stored in NF4 under QLoRA: a Linear weight inside a block (the embedding, the LM head, the
// norms and the biases stay as they are, as bitsandbytes' QLoRA leaves them).
bool nf4_stored(const ParamSpec& p);

}  // namespace trainer
