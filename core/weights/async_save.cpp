// Asynchronous checkpoints (see async_save.h).
#include "core/weights/async_save.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/common.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

// Test hook (TRAINER_DEBUG_SAVE_DELAY=<step>:<ms>): the background write of that step's save starts `ms` late,
// so a test can act while it is in flight. Sleeps in short slices and returns early once *cancel is set.
void debug_delay_save(long step, const std::atomic<bool>& cancel) {
    const char* spec = std::getenv("TRAINER_DEBUG_SAVE_DELAY");
    long at = 0, ms = 0;
    if (spec == nullptr || std::sscanf(spec, "%ld:%ld", &at, &ms) != 2 || at != step) return;
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (!cancel.load() && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
}

}  // namespace

CheckpointSnapshot::CheckpointSnapshot(Backend* backend, Strategy& strategy) : backend_(backend) {
    if (strategy.checkpoint_file() < 0) return;  // this rank writes no shard file
    const std::vector<ShardView> owned = strategy.owned_shards();
    size_t floats = 0;
    for (const ShardView& s : owned) floats += 3 * (s.end - s.begin);
    constexpr size_t kAlign = 4096;  // direct I/O's alignment (checkpoint.cpp)
    buffer_ = DeviceBuffer(backend, floats * sizeof(float) + kAlign, MemCategory::kHostCheckpoint);
    const uintptr_t base = reinterpret_cast<uintptr_t>(buffer_.data());
    float* p = reinterpret_cast<float*>((base + kAlign - 1) / kAlign * kAlign);
    for (const ShardView& s : owned) {
        const size_t n = s.end - s.begin;
        ShardView v;
        v.unit = s.unit, v.begin = s.begin, v.end = s.end;
        v.param = p, v.exp_avg = p + n, v.exp_avg_sq = p + 2 * n;
        v.on_host = true;
        shards_.push_back(v);
        p += 3 * n;
    }
}

void CheckpointSnapshot::take(Strategy& strategy) {
    if (shards_.empty()) return;
    const std::vector<ShardView> owned = strategy.owned_shards();
    TRAINER_CHECK(owned.size() == shards_.size(), "the owned shards changed since the checkpoint snapshot was sized");
    // Device state: every array queued on the copy engine into the (pinned) snapshot, one wait at the end;
    // offloaded state is host memory already and is copied at once.
    uint64_t last = 0;
    bool queued = false;
    for (size_t i = 0; i < owned.size(); ++i) {
        const ShardView& s = owned[i];
        const ShardView& d = shards_[i];
        TRAINER_CHECK(s.unit == d.unit && s.begin == d.begin && s.end == d.end,
                      "the owned shards changed since the checkpoint snapshot was sized");
        const size_t bytes = (s.end - s.begin) * sizeof(float);
        if (bytes == 0) continue;
        const std::pair<float*, const float*> arrays[] = {
            {d.param, s.param}, {d.exp_avg, s.exp_avg}, {d.exp_avg_sq, s.exp_avg_sq}};
        for (const auto& [dst, src] : arrays) {
            if (s.on_host) {
                std::memcpy(dst, src, bytes);
            } else {
                last = backend_->copy_async(dst, src, bytes);
                queued = true;
            }
        }
    }
    if (queued) backend_->host_wait(last);
}

AsyncSaver::AsyncSaver(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Strategy& strategy,
                       std::string run_tag)
    : config_(config),
      layout_(layout),
      strategy_(strategy),
      run_tag_(std::move(run_tag)),
      file_index_(strategy.checkpoint_file()),
      snapshot_(backend, strategy) {}

AsyncSaver::~AsyncSaver() {
    if (!job_) return;
    cancel_ = true;
    {
        const std::lock_guard<std::mutex> lock(job_->m);
        job_->cv.notify_all();
    }
    if (job_->thread.joinable()) job_->thread.join();
}

void AsyncSaver::run(Job& job) {
    const bool rank0 = strategy_.rank() == 0;
    std::string error;
    try {
        // Rank 0 removes the checkpoints beyond save_num_checkpoints_to_keep here, before its shard file, rather
        // than when it published the last one: the next save waits for that, and deleting files is slow on many
        // file systems (ext4 mounted with discard, Lustre).
        if (rank0) remove_excess_checkpoints(config_);
        debug_delay_save(job.save.step, cancel_);
        if (file_index_ >= 0) {
            write_shard_file(config_, layout_, snapshot_.shards(), nullptr, job.save, file_index_, &cancel_,
                             snapshot_.data());
        }
        debug_kill_in_save(job.save.step);
    } catch (const std::exception& e) {
        error = e.what();
    }
    std::unique_lock<std::mutex> lock(job.m);
    job.written = true;
    job.error = error;
    job.cv.notify_all();
    if (!rank0) {
        job.finished = true;
        return;
    }
    // Rank 0 publishes once every rank's file is written (the verdict), or removes the temporary folder.
    job.cv.wait(lock, [&] { return job.verdict_given || cancel_.load(); });
    const bool commit = job.verdict_given && job.commit;
    lock.unlock();
    std::string published, publish_error;
    if (commit) {
        try {
            published = publish_save(config_, layout_, job.save, strategy_.checkpoint_files(), /*rotate=*/false);
        } catch (const std::exception& e) {
            publish_error = e.what();
        }
    } else {
        abandon_save(job.save);
    }
    lock.lock();
    job.published = published;
    if (!publish_error.empty()) job.error = publish_error;
    job.finished = true;
    job.cv.notify_all();
}

void AsyncSaver::start(long step) {
    wait();
    const SavePaths save = prepare_save(config_, step, run_tag_);
    if (file_index_ >= 0) {
        std::error_code ec;
        fs::create_directories(save.tmp_dir, ec);
        if (ec) user_error("checkpoint: cannot create {} ({})", save.tmp_dir, ec.message());
    }
    snapshot_.take(strategy_);
    last_path_ = save.final_dir;
    job_ = std::make_unique<Job>();
    job_->save = save;
    Job* job = job_.get();
    job_->thread = std::thread([this, job] { run(*job); });
}

void AsyncSaver::vote(double* slots) const {
    const std::lock_guard<std::mutex> lock(job_->m);
    if (!job_->written) return;
    slots[job_->error.empty() ? 0 : 1] += 1.0;
}

void AsyncSaver::give_verdict(bool commit) {
    const std::lock_guard<std::mutex> lock(job_->m);
    job_->verdict_given = true;
    job_->commit = commit;
    job_->cv.notify_all();
}

void AsyncSaver::tally(const double* sums) {
    TRAINER_CHECK(voting(), "checkpoint votes tallied with no save waiting for them");
    const long step = job_->save.step;
    const int failed = static_cast<int>(sums[1] + 0.5);
    if (failed > 0) {
        give_verdict(false);  // rank 0's thread removes the temporary folder once its own write is over
        std::string own;
        {
            const std::lock_guard<std::mutex> lock(job_->m);
            own = job_->written ? job_->error : std::string();
        }
        const std::optional<long> newest = latest_checkpoint_step(*config_.save_folder);
        const std::string kept =
            newest ? fmt::format("the newest complete checkpoint, {}/step{}, is kept", *config_.save_folder, *newest)
                   : fmt::format("no checkpoint was written to {}", *config_.save_folder);
        if (!own.empty()) user_error("checkpoint step {} (written in the background): {}; {}", step, own, kept);
        user_error(
            "checkpoint step {} (written in the background): the write failed on {} of {} ranks (each says "
            "why); {}",
            step, failed, strategy_.world_size(), kept);
    }
    if (static_cast<int>(sums[0] + 0.5) < strategy_.world_size()) return;  // not every file is written yet
    give_verdict(true);
    if (strategy_.rank() != 0) retire();  // its thread ended when its file was written
}

void AsyncSaver::wait() {
    if (!job_) return;
    if (voting()) {
        {
            std::unique_lock<std::mutex> lock(job_->m);
            job_->cv.wait(lock, [&] { return job_->written; });
        }
        double votes[kVotes] = {0.0, 0.0};
        vote(votes);
        if (strategy_.world_size() > 1) strategy_.all_reduce_sum(votes, kVotes);
        tally(votes);
        if (!job_) return;
    }
    {
        std::unique_lock<std::mutex> lock(job_->m);
        job_->cv.wait(lock, [&] { return job_->finished; });
    }
    published_ = retire();
}

std::optional<std::string> AsyncSaver::take_published() {
    if (job_ && job_->verdict_given) {
        bool finished;
        {
            const std::lock_guard<std::mutex> lock(job_->m);
            finished = job_->finished;
        }
        if (finished) published_ = retire();
    }
    std::optional<std::string> out;
    out.swap(published_);
    return out;
}

std::optional<std::string> AsyncSaver::retire() {
    job_->thread.join();
    const std::unique_ptr<Job> job = std::move(job_);
    if (strategy_.rank() != 0) return std::nullopt;
    if (!job->error.empty()) {
        user_error("checkpoint step {} (written in the background): publishing it failed: {}", job->save.step,
                   job->error);
    }
    return job->published;
}

}  // namespace trainer
