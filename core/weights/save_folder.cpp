// One run at a time in a save folder (see save_folder.h).
#include "core/weights/save_folder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "base/common.h"
#include "base/config.h"
#include "parallel/launch/rank_env.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
constexpr double kHeartbeatSeconds = 5.0;
constexpr int kMaxAttempts = 50;

// The start time of a process in clock ticks since boot (/proc/<pid>/stat field 22), or 0: with the pid it
// names one process, not a later one that reuses the pid.
unsigned long long process_start(long pid) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(f, line)) return 0;
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos) return 0;
    std::istringstream rest(line.substr(paren + 2));
    std::string field;
    for (int i = 3; i <= 22 && rest >> field; ++i) {
        if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
    }
    return 0;
}

// The first line of a small system file, or "" (the kernel's boot id, for one).
std::string first_line(const std::string& path) {
    std::ifstream f(path);
    std::string line;
    std::getline(f, line);
    return line;
}

// Where a pid names one process: this kernel (its boot id) and this PID namespace. A lock written in the same scope
// is judged by its pid; any other (another host, or a container on this host with its own PID namespace) by its
// heartbeat.
std::string process_scope() {
    std::error_code ec;
    const std::string ns = fs::read_symlink("/proc/self/ns/pid", ec).string();
    const std::string boot = first_line("/proc/sys/kernel/random/boot_id");
    return boot.empty() || ns.empty() ? std::string() : boot + " " + ns;
}

// A lock file as it is now: its identity (inode, size and modification time, the heartbeat) read through an open
// descriptor, so that a shared filesystem's client refetches the attributes (close-to-open). nullopt when there is
// none; a UserError when `.lock` is something else than a file (a symbolic link, a folder).
struct LockState {
    ino_t ino = 0;
    off_t size = 0;
    timespec mtime{};
    bool same_file(const LockState& o) const {
        return ino == o.ino && size == o.size && mtime.tv_sec == o.mtime.tv_sec && mtime.tv_nsec == o.mtime.tv_nsec;
    }
};
[[noreturn]] void not_a_lock(const std::string& path, const std::string& folder, mode_t mode) {
    user_error("save_folder {}: {} is not a lock file but a {}; remove it if no run uses the folder", folder, path,
               S_ISLNK(mode)   ? "symbolic link"
               : S_ISDIR(mode) ? "folder"
                               : "special file");
}
std::optional<LockState> lock_state(const std::string& path, const std::string& folder) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT) return std::nullopt;
        const int e = errno;
        struct stat st {};
        if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) not_a_lock(path, folder, st.st_mode);
        user_error("save_folder {}: cannot read its lock {} ({})", folder, path, std::strerror(e));
    }
    struct stat st {};
    const int r = ::fstat(fd, &st);
    const int e = errno;
    ::close(fd);
    if (r != 0) user_error("save_folder {}: cannot read its lock {} ({})", folder, path, std::strerror(e));
    if (!S_ISREG(st.st_mode)) not_a_lock(path, folder, st.st_mode);
    return LockState{st.st_ino, st.st_size, st.st_mtim};
}

// Now on the file system's clock: the modification time it gives `probe` (a file of this run's) when touched. A
// lock's age is judged on that one clock, never against this host's.
timespec filesystem_now(const std::string& probe) {
    timespec now{};
    ::clock_gettime(CLOCK_REALTIME, &now);
    struct stat st {};
    if (::utimensat(AT_FDCWD, probe.c_str(), nullptr, 0) == 0 && ::stat(probe.c_str(), &st) == 0) return st.st_mtim;
    return now;
}

double seconds_between(const timespec& from, const timespec& to) {
    return static_cast<double>(to.tv_sec - from.tv_sec) + 1e-9 * static_cast<double>(to.tv_nsec - from.tv_nsec);
}

// How long a heartbeat is watched at least before a lock is judged stale: two heartbeats and a margin (a shorter
// TRAINER_SAVE_LOCK_STALE_SECONDS shortens it, at the risk its doc states).
constexpr double kMinWatchSeconds = 12.0;

double stale_seconds() {
    const char* s = std::getenv("TRAINER_SAVE_LOCK_STALE_SECONDS");
    if (s == nullptr || *s == '\0') return 120.0;
    char* end = nullptr;
    const double x = std::strtod(s, &end);
    if (end == s || *end != '\0' || !(x >= 0) || x > 86400)
        user_error("TRAINER_SAVE_LOCK_STALE_SECONDS=\"{}\": expected seconds in [0, 86400]", s);
    return x;
}

std::string describe_owner(const Json& owner) {
    auto field = [&](const char* k) {
        return owner.contains(k) ? (owner[k].is_string() ? owner[k].get<std::string>() : json_text(owner[k]))
                                 : std::string("?");
    };
    return fmt::format("run {} (pid {} on host {}, started {})", field("run_id"), field("pid"), field("host"),
                       field("started"));
}

// Writes `text` to a new file `path` and syncs it; false with errno set when it cannot.
bool write_new_file(const std::string& path, const std::string& text) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return false;
    size_t done = 0;
    while (done < text.size()) {
        const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
        if (n < 0) {
            if (errno == EINTR) continue;
            const int e = errno;
            ::close(fd);
            ::unlink(path.c_str());
            errno = e;
            return false;
        }
        done += static_cast<size_t>(n);
    }
    if (::fsync(fd) != 0 || ::close(fd) != 0) {
        const int e = errno;
        ::unlink(path.c_str());
        errno = e;
        return false;
    }
    return true;
}

// Test hook (TRAINER_DEBUG_LOCK_TAKEOVER_PAUSE_MS=<ms>): a run that judged a lock stale waits this long before taking
// it over, so that tests can make two runs find the same stale lock at once.
void debug_pause_before_take_over() {
    if (const char* ms = std::getenv("TRAINER_DEBUG_LOCK_TAKEOVER_PAUSE_MS"))
        std::this_thread::sleep_for(std::chrono::milliseconds(std::atol(ms)));
}

}  // namespace

void probe_writable_folder(const std::string& folder, const std::string& name, const std::string& what) {
    std::error_code ec;
    fs::create_directories(folder, ec);
    if (ec) user_error("{} {}: cannot be created ({})", what, folder, ec.message());
    if (!fs::is_directory(folder, ec)) user_error("{} {}: is not a folder", what, folder);
    const std::string probe = (fs::path(folder) / name).string();
    if (!write_new_file(probe, "probe\n"))
        user_error("{} {}: cannot be written ({})", what, folder, std::strerror(errno));
    ::unlink(probe.c_str());
}

int remove_interrupted_saves(const std::string& folder) {
    int removed = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(folder, ec)) {
        const std::string name = e.path().filename().string();
        const bool tmp = name.rfind(".step", 0) == 0 &&
                         (name.find(".tmp") != std::string::npos || name.find(".old-") != std::string::npos);
        if (!tmp && name.rfind(".latest.tmp-", 0) != 0) continue;
        std::error_code rm;
        fs::remove_all(e.path(), rm);
        if (!rm) ++removed;
    }
    return removed;
}

SaveFolderLock::SaveFolderLock(std::string folder, std::string run_id)
    : folder_(std::move(folder)), run_id_(std::move(run_id)), path_((fs::path(folder_) / ".lock").string()) {}

std::unique_ptr<SaveFolderLock> SaveFolderLock::acquire(const std::string& folder, const std::string& run_id) {
    std::error_code ec;
    fs::create_directories(folder, ec);
    if (ec) user_error("save_folder {}: cannot be created ({})", folder, ec.message());
    if (!fs::is_directory(folder, ec)) user_error("save_folder {}: is not a folder", folder);
    std::unique_ptr<SaveFolderLock> lock(new SaveFolderLock(folder, run_id));
    const std::string& path = lock->path_;
    char started[32] = {};
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    ::gmtime_r(&now, &utc);
    std::strftime(started, sizeof started, "%Y-%m-%dT%H:%M:%SZ", &utc);
    const std::string scope = process_scope();
    const Json mine = {{"run_id", run_id},
                       {"host", host_name()},
                       {"pid", static_cast<long>(::getpid())},
                       {"pid_start", process_start(::getpid())},
                       {"scope", scope},
                       {"started", started}};
    const std::string tmp = path + "." + run_id;
    if (!write_new_file(tmp, mine.dump() + "\n"))
        user_error("save_folder {}: cannot be written ({})", folder, std::strerror(errno));
    const double stale_after = stale_seconds();
    std::string breaker;  // the take-over this run won, removed once it holds the lock
    for (int attempt = 0;; ++attempt) {
        if (::link(tmp.c_str(), path.c_str()) == 0) break;
        if (errno != EEXIST) {
            const int e = errno;
            ::unlink(tmp.c_str());
            user_error("save_folder {}: cannot create its lock ({})", folder, std::strerror(e));
        }
        // Held: by whom, and is it still there?
        const std::optional<LockState> judged = lock_state(path, folder);
        if (!judged) continue;  // released meanwhile: try again
        Json owner = Json::object();
        try {
            owner = read_json_file(path, "lock");
            if (!owner.is_object()) owner = Json::object();
        } catch (const UserError&) {
            owner = Json::object();  // not a lock this trainer wrote: judged by its heartbeat alone
        }
        const bool same_scope = !scope.empty() && owner.value("scope", Json()) == scope;
        bool gone = false;
        std::string why;
        if (same_scope && owner.contains("pid") && owner["pid"].is_number_integer()) {
            const long pid = owner["pid"].get<long>();
            const bool runs = pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
            const bool same = owner.contains("pid_start") && owner["pid_start"].is_number_unsigned() &&
                              owner["pid_start"].get<unsigned long long>() == process_start(pid);
            gone = !runs || !same;
            why = "which no longer runs";
        } else {
            // Another host or PID namespace (or an unreadable lock): alive while its heartbeat moves. Its age on the
            // file system's clock says how long it has not moved already; it is watched for the rest of
            // stale_after on this run's steady clock, and at least two heartbeats, so no two hosts' clocks are
            // compared and a lock dated in the future waits stale_after at most.
            const double age = seconds_between(judged->mtime, filesystem_now(tmp));
            const double watch =
                std::max(std::min(stale_after, kMinWatchSeconds), stale_after - std::clamp(age, 0.0, stale_after));
            if (watch >= 1.0) {
                std::fprintf(stderr,
                             "save_folder %s: locked by %s; its heartbeat is %.0f s old: watching it %.0f s for a "
                             "live run (TRAINER_SAVE_LOCK_STALE_SECONDS)\n",
                             folder.c_str(), describe_owner(owner).c_str(), std::max(age, 0.0), watch);
            }
            const auto start = std::chrono::steady_clock::now();
            bool moved = false, released = false;
            while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < watch) {
                std::this_thread::sleep_for(std::chrono::milliseconds(200));
                const std::optional<LockState> now = lock_state(path, folder);
                released = !now;
                moved = now && !now->same_file(*judged);
                if (released || moved) break;
            }
            if (released) continue;
            gone = !moved;
            why = fmt::format("whose heartbeat did not move for {:.0f} s", std::max(age, 0.0) + watch);
        }
        if (!gone || attempt >= kMaxAttempts) {
            ::unlink(tmp.c_str());
            user_error(
                "save_folder {} is in use by {}: two runs in one folder would replace each other's checkpoints; "
                "wait for it to end, stop it, or choose another folder (its lock: {})",
                folder, describe_owner(owner), path);
        }
        debug_pause_before_take_over();
        // Take it over, one run for this lock: link(2) creates the breaker named for the stale lock's identity for
        // one run only. That run moves the lock aside only while it is still the file judged stale, so a lock
        // another run has taken meanwhile is never moved. A breaker outlives its run only when that run died
        // between these lines; after stale_after (the file system's clock) it no longer blocks.
        const std::string name = fmt::format("{}.breaker-{}-{}-{}", path, static_cast<unsigned long long>(judged->ino),
                                             static_cast<long long>(judged->mtime.tv_sec), judged->mtime.tv_nsec);
        if (::link(tmp.c_str(), name.c_str()) != 0) {
            struct stat st {};
            if (errno == EEXIST && ::stat(name.c_str(), &st) == 0 &&
                seconds_between(st.st_mtim, filesystem_now(tmp)) > std::max(stale_after, kMinWatchSeconds)) {
                ::unlink(name.c_str());  // left by a run that died taking over
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));  // another run is taking it over
            continue;
        }
        if (!breaker.empty()) ::unlink(breaker.c_str());
        breaker = name;
        const std::optional<LockState> still = lock_state(path, folder);
        const std::string stale = path + ".stale-" + run_id;
        if (still && still->same_file(*judged) && ::rename(path.c_str(), stale.c_str()) == 0) {
            ::unlink(stale.c_str());
            std::fprintf(stderr, "save_folder %s: took over the lock of %s, %s\n", folder.c_str(),
                         describe_owner(owner).c_str(), why.c_str());
        }
    }
    if (!breaker.empty()) ::unlink(breaker.c_str());
    ::unlink(tmp.c_str());
    const int removed = remove_interrupted_saves(folder);
    if (removed > 0)
        std::fprintf(stderr, "save_folder %s: removed %d temporary folder%s of interrupted saves\n", folder.c_str(),
                     removed, removed == 1 ? "" : "s");
    lock->thread_ = std::thread([l = lock.get()] { l->heartbeat(); });
    return lock;
}

void SaveFolderLock::heartbeat() {
    const auto period = std::chrono::duration<double>(kHeartbeatSeconds);
    auto next = std::chrono::steady_clock::now() + period;
    while (!stop_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (std::chrono::steady_clock::now() < next) continue;
        next += std::chrono::duration_cast<std::chrono::steady_clock::duration>(period);
        ::utimensat(AT_FDCWD, path_.c_str(), nullptr, 0);  // now
    }
}

SaveFolderLock::~SaveFolderLock() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    // Removed only while it is still this run's (a take-over by another run after a long stall leaves it).
    try {
        const Json owner = read_json_file(path_, "lock");
        if (owner.is_object() && owner.value("run_id", std::string()) == run_id_) ::unlink(path_.c_str());
    } catch (const std::exception&) {  // unreadable or not ours: left as it is
    }
}

}  // namespace trainer
