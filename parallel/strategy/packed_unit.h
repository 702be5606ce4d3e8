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
//
// The bf16 words of a Linear weight in an fp32 compute copy (LinearWords::kPlace, LinearRuns). Where the backend's
// GEMMs read the bf16 words of a named region (Backend::gemms_read_aliases: CUDA in amp_bf16 and amp_fp8) and nothing
// else reads a Linear weight, the fp32 values of a Linear weight are never needed: its n words go into the first 2n
// bytes of its own 4n-byte region of the compute copy and are named there (alias_bf16). The copy keeps its size and
// layout (every pointer into it stays what the model expects), a Linear weight costs a 2-byte copy instead of a
// widening, and every GEMM reading it then skips its cast from fp32: what FSDP's mixed precision gathers and DDP's
// (NO_SHARD's) mixed compute copy use, as PyTorch's FSDP computes on the bf16 parameters it gathers.
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

// What unpacking (and LinearRuns) does with the bf16 words of the Linear weights (bf16_linear_stored):
// (NF4 weights are dequantized into bf16 words, placed and named, by both kSkip and kPlace: their words are nowhere
// else.)
enum class LinearWords {
    kWiden,  // widened into their fp32 region, as every other value
    kSkip,   // left unwritten: the GEMMs read the packed words where they stay (PackedUnit::alias), a replica's
    kPlace,  // copied into the first half of their fp32 region and named there (above): words that do not stay (a
             // gather's), or a compute copy rounded from fp32
};

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
    // The packed form (device) into the unit's fp32 layout (device): what compute reads. `linears`: what becomes of
    // the bf16 and NF4 Linear weights (kSkip and kPlace only where Backend::gemms_read_aliases; kPlace names the bf16
    // ones itself, kSkip leaves that to `alias`; both place and name the NF4 ones). A unit computed in bf16
    // (Unit::bf16_gemms) reads its NF4 weights rounded to bf16 however they are unpacked, so the CPU's amp_fp8
    // emulation casts the values CUDA's FP8 casts read.
    void unpack(Backend& backend, float* unit, const uint8_t* packed, LinearWords linears = LinearWords::kWiden) const;
    // Names the bf16 Linear weights of `packed` (device) as the words of their values in `unit`, its unpacked copy
    // (Backend::alias_bf16), so the GEMMs read them without a cast. `unalias` drops those names, and those unpack
    // gave with `linears`, before `unit` holds anything else.
    void alias(Backend& backend, const float* unit, const uint8_t* packed) const;
    void unalias(Backend& backend, const float* unit, LinearWords linears) const;
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
    bool nf4_bf16_ = false;  // the NF4 weights rounded to bf16 after dequantizing (Unit::bf16_gemms)
    size_t numel_ = 0, bytes_ = 0, nf4_numel_ = 0, nf4_bytes_ = 0;
};

// The Linear weights (bf16_linear_stored) of an fp32 compute copy whose values come from bf16 words in the same layout
// (FSDP's gathered units under bf16 parameters) or are rounded to bf16 from fp32 values (DDP's mixed compute copy):
// each maximal run of them is widened or rounded as the rest, or with LinearWords::kPlace its words placed in the
// head of its own region (above), which `alias` then names.
class LinearRuns {
   public:
    // The Linear weights of `unit`, whose parameters start at element `at` of the compute copy. Units are added in
    // layout order.
    void add(const Unit& unit, size_t at);
    // The compute copy `dst` (n fp32 values) from the bf16 words `src` in its layout: every value widened (kWiden,
    // one pass), or the Linear runs' words placed (kPlace) and the rest widened.
    void widen(Backend& backend, float* dst, const uint16_t* src, size_t n, LinearWords linears) const;
    // The same from fp32 values at `src` (not `dst`), each rounded to bf16.
    void round(Backend& backend, float* dst, const float* src, size_t n, LinearWords linears) const;
    // Names the placed words of each run (alias_bf16), or drops those names.
    void alias(Backend& backend, const float* dst) const;
    void unalias(Backend& backend, const float* dst) const;
    bool empty() const { return runs_.empty(); }

   private:
    struct Run {
        size_t offset = 0, numel = 0;
    };
    // gap(at, count) for each stretch of [0, n) between the runs and run(r) for each run, in order; unless `linears`
    // places words, all of [0, n) is one gap (one pass).
    template <typename Gap, typename RunFn>
    void visit(size_t n, LinearWords linears, Gap gap, RunFn run) const {
        if (linears != LinearWords::kPlace) return gap(0, n);
        size_t done = 0;
        for (const Run& r : runs_) {
            if (r.offset > done) gap(done, r.offset - done);
            run(r);
            done = r.offset + r.numel;
        }
        if (n > done) gap(done, n - done);
    }
    std::vector<Run> runs_;  // in order, disjoint, none adjacent to the next
};

// Whether a parameter is stored in NF4 under QLoRA: a Linear weight inside a block (the embedding, the LM head, the
// norms and the biases stay as they are, as bitsandbytes' QLoRA leaves them).
bool nf4_stored(const ParamSpec& p);
// Whether a parameter is stored in bf16 in kBf16Linears: a Linear weight (the blocks' and an untied LM head's), which
// only GEMMs read. The embedding (read by its lookup in fp32, and by a tied head), the norms and the biases are not.
bool bf16_linear_stored(const ParamSpec& p);

}  // namespace trainer
