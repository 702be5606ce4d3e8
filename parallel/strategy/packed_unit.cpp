// QLoRA's packed frozen units (see packed_unit.h).
#include "parallel/strategy/packed_unit.h"

#include <cstring>

#include "base/common.h"
#include "kernels/cpu/ops.h"

namespace trainer {
namespace {

size_t align4(size_t n) { return (n + 3) / 4 * 4; }
// An NF4 part's codes, padded to 4 bytes, then its absmaxes.
size_t codes_bytes(size_t n) { return align4((n + 1) / 2); }

}  // namespace

bool nf4_stored(const ParamSpec& p) { return p.kind == ParamKind::kLinearWeight && p.layer >= 0; }

PackedUnit::PackedUnit(const Unit& unit, bool quantize) : numel_(unit.numel) {
    for (const ParamSpec& p : unit.params) {
        const bool nf4 = quantize && nf4_stored(p);
        if (!nf4 && !parts_.empty() && !parts_.back().nf4 && parts_.back().offset + parts_.back().numel == p.offset) {
            parts_.back().numel += p.numel;  // consecutive fp32 parameters: one copy
        } else {
            parts_.push_back({p.offset, p.numel, 0, nf4});
        }
    }
    for (Part& part : parts_) {
        part.at = bytes_;
        const size_t size = part.nf4 ? codes_bytes(part.numel) + 4 * cpu::nf4_blocks(part.numel) : 4 * part.numel;
        bytes_ += size;
        if (part.nf4) nf4_numel_ += part.numel, nf4_bytes_ += size;
    }
}

void PackedUnit::pack(const float* unit, uint8_t* packed) const {
    std::memset(packed, 0, bytes_);
    for (const Part& p : parts_) {
        if (!p.nf4) {
            std::memcpy(packed + p.at, unit + p.offset, 4 * p.numel);
            continue;
        }
        std::vector<float> absmax(cpu::nf4_blocks(p.numel));
        cpu::nf4_quantize(packed + p.at, absmax.data(), unit + p.offset, p.numel);
        std::memcpy(packed + p.at + codes_bytes(p.numel), absmax.data(), 4 * absmax.size());
    }
}

void PackedUnit::unpack(Backend& backend, float* unit, const uint8_t* packed) const {
    for (const Part& p : parts_) {
        if (!p.nf4) {
            backend.copy_device_to_device(unit + p.offset, packed + p.at, 4 * p.numel);
            continue;
        }
        backend.nf4_dequantize(unit + p.offset, packed + p.at,
                               reinterpret_cast<const float*>(packed + p.at + codes_bytes(p.numel)), p.numel);
    }
}

void PackedUnit::round_trip(float* unit) const {
    for (const Part& p : parts_) {
        if (!p.nf4) continue;
        std::vector<uint8_t> codes((p.numel + 1) / 2);
        std::vector<float> absmax(cpu::nf4_blocks(p.numel));
        cpu::nf4_quantize(codes.data(), absmax.data(), unit + p.offset, p.numel);
        cpu::nf4_dequantize(unit + p.offset, codes.data(), absmax.data(), p.numel);
    }
}

}  // namespace trainer
