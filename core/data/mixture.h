// A mixture of data sources (data.sources, OLMo-core's source mixture keys): groups of token files, each with a
// target share of every global batch.
//
// The order is exact and closed-form, so a run resumes at any step and any world size on the same stream:
//  * Draws: of the first n instances of the run, source k takes draws(k, n), a nested split: source 0 takes
//    floor(r_0 n + 1/2), source 1 floor(r_1 / (r_1 + ... ) m + 1/2) of the m left, and so on, the last source what
//    remains. Each is nondecreasing in n (floor(a n + 1/2) and n - floor(a n + 1/2) both are, for 0 <= a <= 1), so
//    global batch `step` holds draws(k, (step + 1) G) - draws(k, step G) instances of source k. Each level's
//    rounding moves at most half an instance onto the sources after it, so over any prefix of the run source k
//    (from 0) is within (k + 1) / 2 instances of its ratio: two sources within half an instance each.
//  * Within a source, its j-th draw is instance j mod N_k of its epoch j / N_k, each epoch a seeded permutation of
//    its N_k instances (InstanceOrder::permutation; unshuffled: in file order). A source is repeated only as far as
//    its max_repetition_ratio allows (checked before the run).
//  * Each global batch is then shuffled with a seed of its own, so every rank's micro-batches mix the sources.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/data/data.h"

namespace trainer {

struct MixtureSource {
    std::string name;
    int64_t first = 0, count = 0;  // its instances: [first, first + count) of the dataset
    double ratio = 0.0;
};

// The sources of `data` (data.sources) over `dataset`, which holds their files in order: each source's instances,
// its name and its ratio.
std::vector<MixtureSource> mixture_sources(const DataConfig& data, const TokenDataset& dataset);

class MixtureOrder : public BatchOrder {
   public:
    // UserError when a source has no instance or the ratios do not sum to 1 (each named).
    MixtureOrder(std::vector<MixtureSource> sources, int64_t global_batch_size, uint64_t seed, bool shuffle);
    void global_batch(int64_t step, std::vector<int64_t>& out) const override;
    // Draws of source k among the run's first n instances.
    int64_t draws(size_t k, int64_t n) const;
    const std::vector<MixtureSource>& sources() const { return sources_; }
    // UserError when a run of `steps` global batches would read a source more than `max_repetition_ratio[k]`
    // times over, naming the source, the draws it needs and the instances it holds.
    void check_repetition(int64_t steps, const std::vector<double>& max_repetition_ratio) const;

   private:
    std::vector<MixtureSource> sources_;
    std::vector<double> share_of_rest_;  // ratio_k / (ratio_k + ... + ratio_last)
    int64_t global_batch_size_ = 0;
    uint64_t seed_ = 0;
    bool shuffle_ = true;
    mutable std::vector<int64_t> cached_epoch_;  // per source
    mutable std::vector<std::vector<int64_t>> order_;
};

}  // namespace trainer
