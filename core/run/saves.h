// A training run's checkpoints: which one it resumes from (and the save folder's rules about it), the folder's lock
// and the run's tag, the saves after each step (in the background for save_async), and what they cost the run.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "base/config.h"
#include "core/weights/async_save.h"
#include "core/weights/save_folder.h"
#include "parallel/launch/rank_env.h"

namespace trainer {

class Backend;
class ParamLayout;
class ProgressBar;
class Strategy;

class RunSaves {
   public:
    // Before anything is built: the checkpoint the run resumes from, if any (try_load_latest_save's "latest" in
    // save_folder over load_path), refused where save_folder already holds checkpoints this run would replace or
    // interleave with (unless save_overwrite).
    RunSaves(const TrainConfig& config, const RankEnv& env);
    const std::optional<std::string>& resume_path() const { return resume_path_; }

    // With the ranks connected, before step 1: rank 0 takes the save folder's lock (one run at a time,
    // core/weights/save_folder.h) and draws the run's tag; every rank that writes shard files probes the folder, so
    // a folder that cannot be written stops the run now, not after save_interval steps. The outcomes are summed
    // over the ranks, so every rank stops when one cannot go on. A resume from "latest" is resolved again: the run
    // that held the lock may have saved since.
    void take_folder(Strategy& strategy);
    // With the model's state in place: save_async runs write save_interval checkpoints in the background.
    void attach(const ParamLayout& layout, Backend* backend, Strategy& strategy, ProgressBar* bar);
    AsyncSaver* saver() const { return saver_.get(); }

    // The checkpoint of `step` (every rank takes part; the strategy says which ranks write shard files).
    // save_interval checkpoints of a save_async run are snapshot and written in the background (said once
    // published); the run's last checkpoint (`last`), and one that must be on disk before the run stops (`now`), is
    // written now, once the one in flight is. Returns the seconds it held the step up.
    double save(long step, bool last, bool now = false);
    // Waits for the checkpoint written in the background, if any (every rank at the same point).
    void finish();
    // Rank 0 says each checkpoint the background thread publishes when it finds it published (here, and in save()
    // and finish()); this returns the newest one's step since the last call, if any (for the step's record).
    std::optional<long> take_published();

    long saved_step() const { return saved_step_; }  // the newest checkpoint this run wrote (-1: none), its path
    const std::string& saved_path() const { return saved_path_; }
    long saves() const { return saves_; }  // scheduled saves (not `now`), and the seconds they held the steps up
    double stall_seconds() const { return stall_s_; }

   private:
    void poll();  // says a checkpoint published in the background, keeping its step

    const TrainConfig& config_;
    const RankEnv& env_;
    std::optional<std::string> resume_path_;
    bool resume_latest_ = false;            // resume_path_ is what "latest" named
    std::unique_ptr<SaveFolderLock> lock_;  // rank 0, while save_folder is set
    std::string run_tag_;                   // names this run's temporary checkpoint folders
    const ParamLayout* layout_ = nullptr;
    Backend* backend_ = nullptr;
    Strategy* strategy_ = nullptr;
    ProgressBar* bar_ = nullptr;
    std::unique_ptr<AsyncSaver> saver_;  // save_async: save_interval checkpoints written in the background
    std::optional<long> published_;      // published in the background since take_published() last returned
    long saved_step_ = -1;
    std::string saved_path_;
    long saves_ = 0;
    double stall_s_ = 0.0;
};

}  // namespace trainer
