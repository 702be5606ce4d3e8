// A mixture of data sources (see mixture.h).
#include "core/data/mixture.h"

#include <algorithm>
#include <cmath>

#include "base/common.h"

namespace trainer {

std::vector<MixtureSource> mixture_sources(const DataConfig& data, const TokenDataset& dataset) {
    std::vector<MixtureSource> sources;
    size_t file = 0;
    for (const DataSource& s : data.sources) {
        MixtureSource m;
        m.name = s.name;
        m.ratio = s.target_ratio;
        m.first = dataset.first_instance(file);
        file += s.paths.size();
        m.count = dataset.first_instance(file) - m.first;
        sources.push_back(m);
    }
    TRAINER_CHECK(file == dataset.files().size(), "{} sources' files of {}", file, dataset.files().size());
    return sources;
}

MixtureOrder::MixtureOrder(std::vector<MixtureSource> sources, int64_t global_batch_size, uint64_t seed, bool shuffle)
    : sources_(std::move(sources)), global_batch_size_(global_batch_size), seed_(seed), shuffle_(shuffle) {
    TRAINER_CHECK(!sources_.empty(), "a mixture of no sources");
    double sum = 0.0;
    for (const MixtureSource& s : sources_) {
        if (s.count < 1) {
            user_error("config data.sources: source {} holds no whole instance of max_sequence_length tokens", s.name);
        }
        sum += s.ratio;
    }
    TRAINER_CHECK(std::fabs(sum - 1.0) <= 1e-6, "mixture ratios summing to {}", sum);  // validate_config's rule
    double rest = 0.0;
    share_of_rest_.assign(sources_.size(), 1.0);
    for (size_t k = sources_.size(); k-- > 0;) {
        rest += sources_[k].ratio;
        share_of_rest_[k] = rest > 0.0 ? std::clamp(sources_[k].ratio / rest, 0.0, 1.0) : 0.0;
    }
    cached_epoch_.assign(sources_.size(), -1);
    order_.resize(sources_.size());
}

int64_t MixtureOrder::draws(size_t k, int64_t n) const {
    int64_t left = n;
    for (size_t j = 0;; ++j) {
        const int64_t take =
            j + 1 == sources_.size()
                ? left
                : static_cast<int64_t>(std::floor(share_of_rest_[j] * static_cast<double>(left) + 0.5));
        if (j == k) return take;
        left -= take;
    }
}

void MixtureOrder::check_repetition(int64_t steps, const std::vector<double>& max_repetition_ratio) const {
    for (size_t k = 0; k < sources_.size(); ++k) {
        const int64_t need = draws(k, steps * global_batch_size_);
        if (static_cast<double>(need) > max_repetition_ratio.at(k) * static_cast<double>(sources_[k].count)) {
            user_error(
                "config data.sources[{}] ({}): the run of {} steps draws {} instances of it, {:.2f} times the {} it "
                "holds, above its max_repetition_ratio {:g} (add files to it, lower its target_ratio, shorten the run, "
                "or allow the repeats)",
                k, sources_[k].name, steps, need, static_cast<double>(need) / static_cast<double>(sources_[k].count),
                sources_[k].count, max_repetition_ratio[k]);
        }
    }
}

void MixtureOrder::global_batch(int64_t step, std::vector<int64_t>& out) const {
    TRAINER_CHECK(step >= 0, "global batch of step {}", step);
    const int64_t n0 = step * global_batch_size_, n1 = n0 + global_batch_size_;
    out.clear();
    for (size_t k = 0; k < sources_.size(); ++k) {
        const MixtureSource& s = sources_[k];
        for (int64_t j = draws(k, n0), end = draws(k, n1); j < end; ++j) {
            const int64_t epoch = j / s.count, i = j % s.count;
            if (!shuffle_) {
                out.push_back(s.first + i);
                continue;
            }
            if (epoch != cached_epoch_[k]) {
                // Each source's epochs have seeds of their own: the run's seed, the source and the epoch.
                const uint64_t seed = seed_ + 0x9E3779B97F4A7C15ull * (k + 1) + static_cast<uint64_t>(epoch);
                InstanceOrder::permutation(s.count, seed, order_[k]);
                cached_epoch_[k] = epoch;
            }
            out.push_back(s.first + order_[k][static_cast<size_t>(i)]);
        }
    }
    TRAINER_CHECK(static_cast<int64_t>(out.size()) == global_batch_size_, "a mixed batch of {} instances", out.size());
    if (shuffle_) {
        std::vector<int64_t> perm;
        InstanceOrder::permutation(global_batch_size_,
                                   seed_ ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(step + 1)), perm);
        std::vector<int64_t> mixed(out.size());
        for (size_t i = 0; i < out.size(); ++i) mixed[i] = out[static_cast<size_t>(perm[i])];
        out.swap(mixed);
    }
}

}  // namespace trainer
