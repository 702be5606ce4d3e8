// A training run's checkpoints (see saves.h).
#include "core/run/saves.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <random>

#include "base/common.h"
#include "base/trace.h"
#include "core/run/report.h"
#include "core/weights/checkpoint.h"
#include "parallel/strategy/strategy.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

RunSaves::RunSaves(const TrainConfig& config, const RankEnv& env) : config_(config), env_(env) {
    if (config_.try_load_latest_save && latest_checkpoint_step(*config_.save_folder)) {
        resume_path_ = resolve_checkpoint(config_, "latest");  // OLMo's meaning: over load_path
        resume_latest_ = true;
    } else if (config_.load_path) {
        resume_path_ = resolve_checkpoint(config_, *config_.load_path);
        resume_latest_ = *config_.load_path == "latest";
    }
    // A checkpoint already in save_folder is never replaced unless save_overwrite: a fresh run may not start
    // there, nor may one resuming an older checkpoint (a rollback after a loss spike would overwrite or
    // interleave with what it branched from): OLMo refuses both unless told.
    const std::optional<long> newest =
        config_.save_folder && !config_.save_overwrite ? latest_checkpoint_step(*config_.save_folder) : std::nullopt;
    if (newest && !resume_path_) {
        user_error(
            "save_folder {} already holds checkpoints (newest step{}); resume with --load-path latest, "
            "choose another folder, or set save_overwrite=true",
            *config_.save_folder, *newest);
    }
    if (newest && resume_path_) {
        // Where the resumed checkpoint stands among the folder's: its folder's name (step<N>), else its metadata's
        // step. One whose metadata cannot be read, or names another step than its folder, is left to loading, which
        // refuses it for that, naming one that verifies.
        const std::optional<long> named = step_of_folder_name(*resume_path_);
        std::optional<long> recorded;
        try {
            recorded = checkpoint_step(*resume_path_);
        } catch (const UserError&) {
        }
        long from = *newest;
        if (recorded && (!named || *named == *recorded)) from = *recorded;
        if (*newest > from) {
            user_error(
                "save_folder {} holds checkpoints newer than the one resumed from ({}, step {}): the newest is "
                "step{}, which this run would overwrite or interleave with; save the branch to another folder "
                "(--save-folder), or set save_overwrite=true to replace them",
                *config_.save_folder, *resume_path_, from, *newest);
        }
    }
}

void RunSaves::take_folder(Strategy& strategy) {
    if (!config_.save_folder) return;
    const std::string& folder = *config_.save_folder;
    auto agree = [&](const std::function<void()>& attempt, double* extra, const std::string& elsewhere) {
        std::exception_ptr failure;
        try {
            attempt();
        } catch (const UserError&) {
            failure = std::current_exception();
        }
        double v[2] = {failure ? 1.0 : 0.0, extra ? *extra : 0.0};
        strategy.all_reduce_sum(v, 2);
        if (failure) std::rethrow_exception(failure);
        if (v[0] > 0) user_error("save_folder {}: {} (its error says why)", folder, elsewhere);
        if (extra) *extra = v[1];
    };
    double tag = 0.0;  // rank 0's draw, the same on every rank after the sum
    agree(
        [&] {
            if (env_.rank != 0) return;
            tag = static_cast<double>(std::random_device{}() & 0xFFFFFFu) * 16777216.0 +
                  static_cast<double>(std::random_device{}() & 0xFFFFFFu);  // 48 bits: exact in a double
            lock_ = SaveFolderLock::acquire(folder, fmt::format("{:012x}", static_cast<uint64_t>(tag)));
        },
        &tag, "rank 0 could not take it");
    run_tag_ = fmt::format("{:012x}", static_cast<uint64_t>(tag));
    agree(
        [&] {
            if (strategy.checkpoint_file() >= 0)
                probe_writable_folder(folder, fmt::format(".probe-{}-rank{}", run_tag_, env_.rank), "save_folder");
        },
        nullptr, "a rank that writes checkpoint shards cannot write it");
    // What `latest` names: the newest checkpoint that verifies, resolved again now (the run that held the lock may
    // have saved since). Rank 0 checks them and moves the ones that do not verify aside, so a restart after a
    // corrupt save (or a kill in one) resumes from the newest good one instead of failing on the same one again.
    if (resume_latest_) {
        double step = 0.0;  // rank 0's: the step resumed from + 1, or 0 (the same on every rank after the sum)
        agree(
            [&] {
                if (env_.rank != 0) return;
                const std::optional<std::string> sound = newest_sound_checkpoint(folder, run_tag_);
                step = sound ? static_cast<double>(checkpoint_step(*sound)) + 1.0 : 0.0;
            },
            &step, "rank 0 found no checkpoint of it that verifies");
        if (step >= 1.0) {
            resume_path_ =
                (std::filesystem::path(folder) / fmt::format("step{}", static_cast<long>(step) - 1)).string();
        }
    }
}

void RunSaves::attach(const ParamLayout& layout, Backend* backend, Strategy& strategy, ProgressBar* bar) {
    layout_ = &layout, backend_ = backend, strategy_ = &strategy, bar_ = bar;
    if (config_.async_saves()) saver_ = std::make_unique<AsyncSaver>(config_, layout, backend, strategy, run_tag_);
}

double RunSaves::save(long step, bool last, bool now) {
    const auto t0 = Clock::now();
    const trace::Span span("checkpoint", "save checkpoint");
    if (saver_ && !now && !last) {
        saver_->start(step);
        poll();  // the one before it, published while start() waited for it
        // Every rank counts it saved: a stop waits for it to be published (finish) before it asks.
        saved_step_ = step;
        saved_path_ = saver_->last_path();
    } else {
        finish();
        saved_path_ = save_checkpoint(config_, *layout_, backend_, *strategy_, step, run_tag_);
        saved_step_ = step;
        bar_->clear();
        std::printf("saved checkpoint %s\n", saved_path_.c_str());
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!now) ++saves_, stall_s_ += seconds;
    return seconds;
}

void RunSaves::finish() {
    if (!saver_) return;
    saver_->wait();
    poll();
}

void RunSaves::poll() {
    if (!saver_) return;
    const std::optional<std::string> path = saver_->take_published();
    if (!path) return;
    bar_->clear();
    std::printf("saved checkpoint %s (written in the background)\n", path->c_str());
    published_ = checkpoint_step(*path);
}

std::optional<long> RunSaves::take_published() {
    poll();
    const std::optional<long> step = published_;
    published_.reset();
    return step;
}

}  // namespace trainer
