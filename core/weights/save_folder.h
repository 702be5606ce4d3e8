// One run at a time in a save folder. A run that saves takes save_folder/.lock before step 1: a small JSON
// file naming the run (its id, host, pid and start), created whole by link(2), so two runs cannot both hold
// it. While the run lives, a thread refreshes the lock's modification time every few seconds (the
// heartbeat). A second run on the folder is refused with the owner's name, unless the owner is gone:
//   - in this run's scope (the kernel's boot id and PID namespace), its pid no longer runs (or runs another
//     process): taken over at once;
//   - elsewhere (another host on a shared filesystem, a container with its own PID namespace), its heartbeat
//     stops moving: the lock's age on the file system's clock, then watched on this run's steady clock up to
//     TRAINER_SAVE_LOCK_STALE_SECONDS (default 120) in all, and at least two heartbeats; a heartbeat seen moving
//     means a live owner, refused. No two hosts' clocks are compared.
// Of several runs that judge one lock stale at once, the one whose link(2) creates the breaker named for that lock
// (its inode and time) takes it over, moving it aside only while it is still that file.
// A take-over says so. Holding the lock, the run clears what interrupted saves of dead runs left behind
// (.step<N>.tmp-*, .step<N>.old-*, .latest.tmp-*), so a full disk is not kept full by failed retries.
// The lock is removed when the run ends, if it is still this run's.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

namespace trainer {

class SaveFolderLock {
   public:
    // Creates `folder` if needed and takes its lock for run `run_id`; UserError naming the folder and
    // what stops it (the live owner, or why the folder cannot be created or written).
    static std::unique_ptr<SaveFolderLock> acquire(const std::string& folder, const std::string& run_id);
    ~SaveFolderLock();
    SaveFolderLock(const SaveFolderLock&) = delete;
    SaveFolderLock& operator=(const SaveFolderLock&) = delete;

   private:
    SaveFolderLock(std::string folder, std::string run_id);
    void heartbeat();

    std::string folder_, run_id_, path_;
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

// A file named `name` created in `folder` and removed again: UserError naming the folder and the reason
// when it cannot be (a file in its place, a read-only mount, a name too long, a full disk). Every rank
// that writes checkpoint shards probes before step 1.
void probe_writable_folder(const std::string& folder, const std::string& name, const std::string& what);

// Removes the temporary files and folders of interrupted saves in `folder` (their names start with
// ".step" or ".latest.tmp-"); returns how many. Only a run holding the folder's lock may call it.
int remove_interrupted_saves(const std::string& folder);

}  // namespace trainer
