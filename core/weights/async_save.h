// Asynchronous checkpoints (save_async, the default for save_interval checkpoints): at the end of a save step
// every rank that writes a shard copies its owned state (parameters and AdamW moments) into a host snapshot
// (pinned memory on CUDA, counted as host_checkpoint_snapshot) and a background thread writes the snapshot's
// shard file while training goes on. The step stalls only for the copy.
//
// The ranks agree that every shard file is complete without a collective of their own: while a save waits for
// agreement, each rank adds two numbers (its file written, its write failed) to the step's loss all-reduce
// (vote / tally). When every rank's file is written, rank 0's background thread publishes the checkpoint (the
// metadata, the rename to step<N>/, `latest`: checkpoint.h's publish_save); when any failed, every rank stops
// with an error and rank 0 removes the temporary folder, so the previous checkpoints stay the newest complete
// ones. A run that ends on another error before the votes are in still publishes the save (see ~AsyncSaver): its
// state was good. At most one save is in flight: the next save, a stop and the run's end wait for it (wait, a
// collective at a point every rank reaches alike).
//
// Room: rank 0 removes the checkpoints beyond save_num_checkpoints_to_keep before a save's files are written (the
// other writers wait for the temporary folder it makes afterwards), and a background save publishes without
// rotating; the synchronous saves (the run's last, a stop's) make room first too. So a save folder never holds
// more than keep + 1 checkpoints, the one being written included.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "core/weights/checkpoint.h"
#include "kernels/backend.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

// The host snapshot of this rank's owned state that an asynchronous save writes: three arrays a shard, laid out
// as the shard file stores them. Allocated (host_checkpoint_snapshot) by a rank that writes a shard file, empty
// on the others; dry runs allocate it too, so the plan predicts it.
class CheckpointSnapshot {
   public:
    CheckpointSnapshot(Backend* backend, Strategy& strategy);
    // Copies the owned shards' state into the snapshot (device to host; returns once the copies are done).
    void take(Strategy& strategy);
    // The snapshot's shards: ShardViews whose arrays are host memory, back to back from data() (4 KiB aligned,
    // for direct I/O) as the shard file lays them out.
    const std::vector<ShardView>& shards() const { return shards_; }
    const void* data() const { return shards_.empty() ? nullptr : shards_.front().param; }

   private:
    Backend* backend_;
    DeviceBuffer buffer_;
    std::vector<ShardView> shards_;
};

class AsyncSaver {
   public:
    AsyncSaver(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Strategy& strategy,
               std::string run_tag);
    // A save still in flight (the run is ending on an error; never throws). Where the ranks' votes on it were not
    // all in, the state it holds was still good: each rank finishes its own file, and rank 0 publishes the
    // checkpoint once every writer's file is complete (their lists in the temporary folder), waiting at most
    // distributed_timeout_seconds for them (a launcher's grace for the other ranks bounds it too), and says so.
    // Where the verdict was to drop it (a write failed), the background thread stops at its next array and rank 0
    // removes the temporary folder.
    ~AsyncSaver();

    // Every rank, after step `step`'s optimizer step: waits for the save in flight (wait()), refuses an
    // existing step<N>/ unless save_overwrite, snapshots this rank's state and starts writing it.
    void start(long step);
    // Whether a save waits for the ranks' votes (the same on every rank at every step).
    bool voting() const { return job_ && !job_->verdict_given; }
    static constexpr int kVotes = 2;
    // This rank's votes, added into slots[0..kVotes) of the loss all-reduce: its file is written, it failed.
    void vote(double* slots) const;
    // The votes summed over the ranks: every file written commits the save (rank 0 publishes it in the
    // background); a failure anywhere stops every rank with an error naming the step (this rank's own error
    // where it failed) and removes the temporary folder.
    void tally(const double* sums);
    // Blocks until the save in flight is published (or throws its failure), every rank at the same point: it
    // all-reduces the votes when they are not in yet.
    void wait();
    // Rank 0: the checkpoint published since the last call, if any (throws a publish that failed); never blocks.
    std::optional<std::string> take_published();
    // The folder (step<N>/) the save in flight or last started publishes to (empty: none yet).
    const std::string& last_path() const { return last_path_; }

   private:
    struct Job {
        SavePaths save;
        std::thread thread;
        std::mutex m;
        std::condition_variable cv;
        bool written = false;        // this rank's shard file is complete (or failed: error set)
        std::string error;           // this rank's write failed (or rank 0's publish did)
        bool verdict_given = false;  // the votes are in (the same step on every rank)
        bool commit = false;         // rank 0: publish (else remove the temporary folder)
        bool finished = false;       // the thread is done
        std::string published;       // rank 0: step<N>/'s path
    };
    void run(Job& job);
    // The destructor's half for a save the votes never decided: waits for this rank's file; rank 0 then gives the
    // verdict itself from the files on disk. False where this rank's own write failed (the save is dropped).
    bool salvage();
    // A writer other than rank 0: waits until rank 0 made the temporary folder (after it made room), bounded by
    // distributed_timeout_seconds and stopped by cancel_.
    void wait_for_folder(const SavePaths& save) const;
    void give_verdict(bool commit);
    // Joins the finished job's thread and forgets it; rank 0 returns what it published (throws its failure).
    std::optional<std::string> retire();

    const TrainConfig& config_;
    const ParamLayout& layout_;
    Strategy& strategy_;
    std::string run_tag_;
    int rank_;        // strategy_.rank(): the destructor may run while the run unwinds
    int files_;       // shard files in a checkpoint
    int file_index_;  // the one this rank writes (-1: none)
    CheckpointSnapshot snapshot_;
    std::unique_ptr<Job> job_;
    std::atomic<bool> cancel_{false};
    std::optional<std::string> published_;
    std::string last_path_;
};

}  // namespace trainer
