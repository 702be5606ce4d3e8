// LoRA's packed frozen units (see packed_unit.h).
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

// n bf16 words into the first 2n bytes of the fp32 region `region` (n elements): where a Linear weight's words are
// named (LinearWords::kPlace).
void place_words(Backend& backend, float* region, const uint16_t* words, size_t n) {
    backend.copy_device_to_device(region, words, 2 * n);
}

}  // namespace

bool nf4_stored(const ParamSpec& p) { return p.kind == ParamKind::kLinearWeight && p.layer >= 0; }
bool bf16_linear_stored(const ParamSpec& p) { return p.kind == ParamKind::kLinearWeight; }

FrozenForm frozen_form(const Unit& unit, bool bf16_params) {
    if (!unit.frozen) return FrozenForm::kFp32;
    if (unit.nf4) return FrozenForm::kNf4;
    if (bf16_params) return FrozenForm::kBf16;
    return unit.bf16_gemms ? FrozenForm::kBf16Linears : FrozenForm::kFp32;
}

PackedUnit::PackedUnit(const Unit& unit, FrozenForm form, bool double_quant)
    : double_quant_(form == FrozenForm::kNf4 && double_quant),
      nf4_bf16_(form == FrozenForm::kNf4 && unit.bf16_gemms),
      numel_(unit.numel) {
    for (const ParamSpec& p : unit.params) {
        Store store = Store::kFp32;
        if (form == FrozenForm::kNf4 && nf4_stored(p)) store = Store::kNf4;
        if (form == FrozenForm::kBf16 || (form == FrozenForm::kBf16Linears && bf16_linear_stored(p)))
            store = Store::kBf16;
        // Consecutive fp32 or bf16 parameters alike in being Linear weights or not: one part (one copy or cast); an
        // NF4 weight is a part of its own.
        const bool linear = bf16_linear_stored(p);
        if (store != Store::kNf4 && !parts_.empty() && parts_.back().store == store &&
            parts_.back().linears == linear && parts_.back().offset + parts_.back().numel == p.offset) {
            parts_.back().numel += p.numel;
        } else {
            parts_.push_back({p.offset, p.numel, 0, store, linear});
        }
    }
    for (Part& part : parts_) {
        part.at = bytes_;
        size_t size = 4 * part.numel;
        if (part.store == Store::kBf16) size = align4(2 * part.numel);
        if (part.store == Store::kNf4) size = nf4_part_bytes(part.numel, double_quant_);
        bytes_ += size;
        if (part.store == Store::kNf4) nf4_numel_ += part.numel, nf4_bytes_ += size;
    }
}

void PackedUnit::pack(const float* unit, uint8_t* packed) const {
    if (bytes_ == 0) return;  // a unit without parameters (a parameter-free final norm): nothing, maybe no buffer
    std::memset(packed, 0, bytes_);
    for (const Part& p : parts_) {
        if (p.store == Store::kFp32) {
            std::memcpy(packed + p.at, unit + p.offset, 4 * p.numel);
            continue;
        }
        if (p.store == Store::kBf16) {  // round to nearest even, as every bf16 cast of the trainer
            std::vector<uint16_t> words(p.numel);
            cpu::cast_float_to_bf16(words.data(), unit + p.offset, p.numel);
            std::memcpy(packed + p.at, words.data(), 2 * p.numel);
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

void PackedUnit::unpack(Backend& backend, float* unit, const uint8_t* packed, LinearWords linears) const {
    for (const Part& p : parts_) {
        if (p.store == Store::kFp32) {
            backend.copy_device_to_device(unit + p.offset, packed + p.at, 4 * p.numel);
            continue;
        }
        if (p.store == Store::kBf16) {
            const auto* words = reinterpret_cast<const uint16_t*>(packed + p.at);
            if (p.linears && linears == LinearWords::kSkip) continue;
            if (p.linears && linears == LinearWords::kPlace) {
                place_words(backend, unit + p.offset, words, p.numel);
                backend.alias_bf16(unit + p.offset, reinterpret_cast<const uint16_t*>(unit + p.offset), p.numel);
                continue;
            }
            backend.cast_bf16_to_float(unit + p.offset, words, p.numel);
            continue;
        }
        // NF4: dequantized into the fp32 values, or (placed) into the bf16 words in the head of their region.
        float* values = unit + p.offset;
        const bool place = linears != LinearWords::kWiden;
        const GemmOperand out = place ? GemmOperand::in_bf16(reinterpret_cast<uint16_t*>(values)) : GemmOperand(values);
        const uint8_t* rest = packed + p.at + codes_bytes(p.numel);
        if (double_quant_) {
            const auto* absmax2 = reinterpret_cast<const float*>(rest + absmax_codes_bytes(p.numel));
            const size_t blocks2 = cpu::double_quant_blocks(cpu::nf4_blocks(p.numel));
            backend.nf4_dequantize_dq(out, packed + p.at, rest, absmax2, absmax2 + blocks2, p.numel);
        } else {
            backend.nf4_dequantize(out, packed + p.at, reinterpret_cast<const float*>(rest), p.numel);
        }
        if (place) {
            backend.alias_bf16(values, out.b16(), p.numel);
        } else if (nf4_bf16_) {
            backend.round_to_bf16(values, values, p.numel);
        }
    }
}

void PackedUnit::alias(Backend& backend, const float* unit, const uint8_t* packed) const {
    for (const Part& p : parts_) {
        if (p.store == Store::kBf16 && p.linears)
            backend.alias_bf16(unit + p.offset, reinterpret_cast<const uint16_t*>(packed + p.at), p.numel);
    }
}

void PackedUnit::unalias(Backend& backend, const float* unit, LinearWords linears) const {
    for (const Part& p : parts_) {
        const bool named =
            p.store == Store::kBf16 ? p.linears : p.store == Store::kNf4 && linears != LinearWords::kWiden;
        if (named) backend.alias_bf16(unit + p.offset, nullptr, p.numel);
    }
}

void PackedUnit::round_trip(float* unit) const {
    for (const Part& p : parts_) {
        if (p.store == Store::kFp32) continue;
        if (p.store == Store::kBf16) {
            cpu::round_to_bf16(unit + p.offset, unit + p.offset, p.numel);
            continue;
        }
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
        if (nf4_bf16_) cpu::round_to_bf16(unit + p.offset, unit + p.offset, p.numel);
    }
}

void LinearRuns::add(const Unit& unit, size_t at) {
    for (const ParamSpec& p : unit.params) {
        if (!bf16_linear_stored(p) || p.numel == 0) continue;
        const size_t offset = at + p.offset;
        TRAINER_CHECK(runs_.empty() || runs_.back().offset + runs_.back().numel <= offset,
                      "Linear weights added out of order at element {}", offset);
        if (!runs_.empty() && runs_.back().offset + runs_.back().numel == offset) {
            runs_.back().numel += p.numel;
        } else {
            runs_.push_back({offset, p.numel});
        }
    }
}

void LinearRuns::widen(Backend& backend, float* dst, const uint16_t* src, size_t n, LinearWords linears) const {
    visit(
        n, linears, [&](size_t at, size_t count) { backend.cast_bf16_to_float(dst + at, src + at, count); },
        [&](const Run& r) { place_words(backend, dst + r.offset, src + r.offset, r.numel); });
}

void LinearRuns::round(Backend& backend, float* dst, const float* src, size_t n, LinearWords linears) const {
    visit(
        n, linears, [&](size_t at, size_t count) { backend.round_to_bf16(dst + at, src + at, count); },
        [&](const Run& r) {
            backend.cast_float_to_bf16(reinterpret_cast<uint16_t*>(dst + r.offset), src + r.offset, r.numel);
        });
}

void LinearRuns::alias(Backend& backend, const float* dst) const {
    for (const Run& r : runs_)
        backend.alias_bf16(dst + r.offset, reinterpret_cast<const uint16_t*>(dst + r.offset), r.numel);
}

void LinearRuns::unalias(Backend& backend, const float* dst) const {
    for (const Run& r : runs_) backend.alias_bf16(dst + r.offset, nullptr, r.numel);
}

}  // namespace trainer
