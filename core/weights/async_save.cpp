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
      rank_(strategy.rank()),
      files_(strategy.checkpoint_files()),
      file_index_(strategy.checkpoint_file()),
      snapshot_(backend, strategy) {}

AsyncSaver::~AsyncSaver() {
    if (!job_) return;
    bool verdict;
    {
        const std::lock_guard<std::mutex> lock(job_->m);
        verdict = job_->verdict_given;
    }
    // The run ends on an error while the ranks' votes on the save in flight were not all in: the state it snapshot
    // was good (a step's result, refused if not finite), so it is finished rather than dropped.
    const bool salvaging = !verdict && salvage();
    if (!salvaging) {
        cancel_ = true;
        const std::lock_guard<std::mutex> lock(job_->m);
        job_->cv.notify_all();
    }
    if (job_->thread.joinable()) job_->thread.join();
    if (salvaging && rank_ == 0) {
        if (!job_->published.empty()) {
            std::printf(
                "saved checkpoint %s (written in the background; the error that ends the run came after "
                "its step)\n",
                job_->published.c_str());
        } else {
            std::fprintf(stderr, "checkpoint step %ld (written in the background) is not published: %s\n",
                         job_->save.step, job_->error.c_str());
        }
        std::fflush(stdout);
    }
}

bool AsyncSaver::salvage() {
    Job& job = *job_;
    std::unique_lock<std::mutex> lock(job.m);
    job.cv.wait(lock, [&] { return job.written; });  // this rank's own file: it runs on its own, unbounded
    if (!job.error.empty()) return false;
    if (rank_ != 0) return true;  // its thread has ended
    // Rank 0 publishes once every writer's file is complete (their lists, renamed into place after the file), as
    // long as the ranks' collective timeout allows; a rank that died in its write leaves the save unpublished.
    lock.unlock();
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<long>(config_.distributed_timeout_seconds * 1000));
    bool complete = shard_lists_complete(job.save, files_);
    while (!complete && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        complete = shard_lists_complete(job.save, files_);
    }
    lock.lock();
    if (!complete) {
        job.error = fmt::format("not every rank's shard file was complete within {} s (distributed_timeout_seconds)",
                                config_.distributed_timeout_seconds);
    }
    job.verdict_given = true;
    job.commit = complete;
    job.cv.notify_all();
    return true;
}

void AsyncSaver::run(Job& job) {
    const bool rank0 = rank_ == 0;
    std::string error;
    try {
        // Rank 0 removes the checkpoints beyond save_num_checkpoints_to_keep here, before its shard file, rather
        // than when it published the last one: the next save waits for that, and deleting files is slow on many
        // file systems (ext4 mounted with discard, Lustre). It then makes the temporary folder, which the other
        // writers wait for, so no rank writes before the room is made.
        if (rank0) {
            remove_excess_checkpoints(config_);
            std::error_code ec;
            fs::create_directories(job.save.tmp_dir, ec);
            if (ec) user_error("checkpoint: cannot create {} ({})", job.save.tmp_dir, ec.message());
        } else if (file_index_ >= 0) {
            wait_for_folder(job.save);
        }
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
            published = publish_save(config_, layout_, job.save, files_, /*rotate=*/false);
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

void AsyncSaver::wait_for_folder(const SavePaths& save) const {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<long>(config_.distributed_timeout_seconds * 1000));
    std::error_code ec;
    while (!fs::is_directory(save.tmp_dir, ec)) {
        if (cancel_.load()) user_error("checkpoint step {}: cancelled", save.step);
        if (std::chrono::steady_clock::now() > deadline) {
            user_error("checkpoint step {}: rank 0 did not make {} within {} s (distributed_timeout_seconds)",
                       save.step, save.tmp_dir, config_.distributed_timeout_seconds);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

void AsyncSaver::start(long step) {
    wait();
    const SavePaths save = prepare_save(config_, step, run_tag_);
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
    if (rank_ != 0) retire();  // its thread ended when its file was written
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
    if (rank_ != 0) return std::nullopt;
    if (!job->error.empty()) {
        user_error("checkpoint step {} (written in the background): publishing it failed: {}", job->save.step,
                   job->error);
    }
    return job->published;
}

}  // namespace trainer
