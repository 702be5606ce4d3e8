// The step's named exchange between ranks (see exchange.h).
#include "core/run/exchange.h"

#include <cstdint>

#include "base/common.h"

namespace trainer {
namespace {

// The layout's fingerprint: FNV-1a over the names and widths, cut to 20 bits, so that its sum over up to 2^30 ranks
// is exact in a double.
double fingerprint(const std::vector<std::pair<std::string, RankExchange::Slot>>& slots) {
    uint64_t h = 1469598103934665603ull;
    const auto mix = [&h](unsigned char c) { h = (h ^ c) * 1099511628211ull; };
    for (const auto& [name, slot] : slots) {
        for (const char c : name) mix(static_cast<unsigned char>(c));
        for (int k = 0; k < 4; ++k) mix(static_cast<unsigned char>(slot.width >> (8 * k)));
    }
    return static_cast<double>(h & 0xFFFFFu);
}

}  // namespace

void RankExchange::clear() {
    slots_.clear();
    values_.clear();
}

RankExchange::Slot RankExchange::reserve(const std::string& name, int width) {
    TRAINER_CHECK(width > 0, "exchange slot {}: width {}", name, width);
    for (const auto& [n, s] : slots_) TRAINER_CHECK(n != name, "exchange slot {} reserved twice ({})", name, layout());
    const Slot s{static_cast<int>(values_.size()), width};
    slots_.emplace_back(name, s);
    values_.resize(values_.size() + static_cast<size_t>(width), 0.0);
    return s;
}

RankExchange::Slot RankExchange::slot(const std::string& name) const {
    for (const auto& [n, s] : slots_) {
        if (n == name) return s;
    }
    TRAINER_CHECK(false, "exchange slot {} not reserved ({})", name, layout());
    return {};
}

double* RankExchange::at(Slot s) {
    TRAINER_CHECK(s.reserved() && s.offset + s.width <= size(), "exchange slot at {} not reserved", s.offset);
    return values_.data() + s.offset;
}

const double* RankExchange::at(Slot s) const {
    TRAINER_CHECK(s.reserved() && s.offset + s.width <= size(), "exchange slot at {} not reserved", s.offset);
    return values_.data() + s.offset;
}

std::string RankExchange::layout() const {
    std::string out;
    for (const auto& [name, slot] : slots_) out += fmt::format("{}{}[{}]", out.empty() ? "" : " ", name, slot.width);
    return out;
}

void RankExchange::sum(const std::function<void(double*, int)>& all_reduce_sum, int world) {
    const double mine = fingerprint(slots_);
    values_.push_back(mine);
    all_reduce_sum(values_.data(), size());
    const double total = values_.back();
    values_.pop_back();
    TRAINER_CHECK(world == 0 || total == mine * world,
                  "the ranks' step exchanges differ: this rank's is {} (fingerprint {}), the sum of the fingerprints "
                  "is {} over {} ranks",
                  layout(), mine, total, world);
}

}  // namespace trainer
