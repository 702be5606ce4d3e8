// The values a step's ranks sum in one all-reduce, each concern in a slot of its own reserved by name: the loss
// sums, the votes on a stop request and on a background checkpoint, each rank's compute time. A slot is reserved
// (zeroed) before the sum, this rank's values are written into it, and after the sum every rank reads the totals
// there. The slots lie in the order they were reserved, so every rank must reserve the same ones in the same order;
// a fingerprint of the layout rides along in the sum and a rank whose layout differs from another's is stopped
// with both layouts named, instead of reading another concern's numbers.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace trainer {

class RankExchange {
   public:
    struct Slot {
        int offset = -1, width = 0;
        bool reserved() const { return offset >= 0; }
    };

    // A new exchange: no slots.
    void clear();
    // `width` zeros named `name` (unique in this exchange), after the slots reserved before it.
    Slot reserve(const std::string& name, int width = 1);
    // The slot reserved as `name` (refused where there is none).
    Slot slot(const std::string& name) const;
    // The slot's values: this rank's before sum(), every rank's totals after.
    double* at(Slot s);
    const double* at(Slot s) const;
    double& value(Slot s) { return *at(s); }
    double value(Slot s) const { return *at(s); }
    // Sums every slot over the `world` ranks with `all_reduce_sum` (in place, over n doubles), one call, and checks
    // the layouts' fingerprint. `world` 0: a collective that carries no values (the plan's dry run), not checked.
    void sum(const std::function<void(double*, int)>& all_reduce_sum, int world);
    // "loss[3] stop_votes[3] ...": the slots in order, for messages.
    std::string layout() const;
    int size() const { return static_cast<int>(values_.size()); }

   private:
    std::vector<std::pair<std::string, Slot>> slots_;
    std::vector<double> values_;
};

}  // namespace trainer
