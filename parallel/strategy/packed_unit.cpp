// QLoRA's packed frozen units (see packed_unit.h).
#include "parallel/strategy/packed_unit.h"

#include <cstring>

#include "base/common.h"
#include "kernels/cpu/ops.h"

namespace trainer {
namespace {

size_t align4(size_t n) { return (n + 3) / 4 * 4; }
// An NF4 part: its codes, padded to 4 bytes; then its absmaxes (fp32), or double-quantized their codes (padded to 4
// bytes), the fp32 absmax of each block of them and the offset.
size_t codes_bytes(size_t n) { return align4((n + 1) / 2); }
size_t absmax_codes_bytes(size_t n) { return align4(cpu::nf4_blocks(n)); }
size_t nf4_part_bytes(size_t n, bool dq) {
    const size_t blocks = cpu::nf4_blocks(n);
    return codes_bytes(n) + (dq ? absmax_codes_bytes(n) + 4 * cpu::double_quant_blocks(blocks) + 4 : 4 * blocks);
}

}  // namespace

bool nf4_stored(const ParamSpec& p) { return p.kind == ParamKind::kLinearWeight && p.layer >= 0; }

PackedUnit::PackedUnit(const Unit& unit, bool quantize, bool double_quant)
    : double_quant_(quantize && double_quant), numel_(unit.numel) {
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
        const size_t size = part.nf4 ? nf4_part_bytes(part.numel, double_quant_) : 4 * part.numel;
        bytes_ += size;
        if (part.nf4) nf4_numel_ += part.numel, nf4_bytes_ += size;
    }
}

void PackedUnit::pack(const float* unit, uint8_t* packed) const {
    if (bytes_ == 0) return;  // a unit without parameters (a parameter-free final norm): nothing, maybe no buffer
    std::memset(packed, 0, bytes_);
    for (const Part& p : parts_) {
        if (!p.nf4) {
            std::memcpy(packed + p.at, unit + p.offset, 4 * p.numel);
            continue;
        }
        std::vector<float> absmax(cpu::nf4_blocks(p.numel));
        cpu::nf4_quantize(packed + p.at, absmax.data(), unit + p.offset, p.numel);
        uint8_t* rest = packed + p.at + codes_bytes(p.numel);
        if (!double_quant_) {
            std::memcpy(rest, absmax.data(), 4 * absmax.size());
            continue;
        }
        std::vector<float> absmax2(cpu::double_quant_blocks(absmax.size()));
        float offset = 0.0f;
        cpu::double_quantize(rest, absmax2.data(), &offset, absmax.data(), absmax.size());
        rest += absmax_codes_bytes(p.numel);
        std::memcpy(rest, absmax2.data(), 4 * absmax2.size());
        std::memcpy(rest + 4 * absmax2.size(), &offset, 4);
    }
}

void PackedUnit::unpack(Backend& backend, float* unit, const uint8_t* packed) const {
    for (const Part& p : parts_) {
        if (!p.nf4) {
            backend.copy_device_to_device(unit + p.offset, packed + p.at, 4 * p.numel);
            continue;
        }
        const uint8_t* rest = packed + p.at + codes_bytes(p.numel);
        if (!double_quant_) {
            backend.nf4_dequantize(unit + p.offset, packed + p.at, reinterpret_cast<const float*>(rest), p.numel);
            continue;
        }
        const auto* absmax2 = reinterpret_cast<const float*>(rest + absmax_codes_bytes(p.numel));
        const size_t blocks2 = cpu::double_quant_blocks(cpu::nf4_blocks(p.numel));
        backend.nf4_dequantize_dq(unit + p.offset, packed + p.at, rest, absmax2, absmax2 + blocks2, p.numel);
    }
}

void PackedUnit::round_trip(float* unit) const {
    for (const Part& p : parts_) {
        if (!p.nf4) continue;
        std::vector<uint8_t> codes((p.numel + 1) / 2);
        std::vector<float> absmax(cpu::nf4_blocks(p.numel));
        cpu::nf4_quantize(codes.data(), absmax.data(), unit + p.offset, p.numel);
        if (double_quant_) {
            std::vector<uint8_t> absmax_codes(absmax.size());
            std::vector<float> absmax2(cpu::double_quant_blocks(absmax.size()));
            float offset = 0.0f;
            cpu::double_quantize(absmax_codes.data(), absmax2.data(), &offset, absmax.data(), absmax.size());
            cpu::double_dequantize(absmax.data(), absmax_codes.data(), absmax2.data(), offset, absmax.size());
        }
        cpu::nf4_dequantize(unit + p.offset, codes.data(), absmax.data(), p.numel);
    }
}

}  // namespace trainer
