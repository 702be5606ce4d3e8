// One run at a time in a save folder (see save_folder.h).
#include "core/weights/save_folder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

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

std::optional<struct timespec> modified(const std::string& path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return std::nullopt;
    return st.st_mtim;
}

double seconds_since(const timespec& t) {
    timespec now{};
    ::clock_gettime(CLOCK_REALTIME, &now);
    return static_cast<double>(now.tv_sec - t.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec - t.tv_nsec);
}

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
    const Json mine = {{"run_id", run_id},
                       {"host", host_name()},
                       {"pid", static_cast<long>(::getpid())},
                       {"pid_start", process_start(::getpid())},
                       {"started", started}};
    const std::string tmp = path + "." + run_id;
    if (!write_new_file(tmp, mine.dump() + "\n"))
        user_error("save_folder {}: cannot be written ({})", folder, std::strerror(errno));
    const double stale_after = stale_seconds();
    for (int attempt = 0;; ++attempt) {
        if (::link(tmp.c_str(), path.c_str()) == 0) break;
        if (errno != EEXIST) {
            const int e = errno;
            ::unlink(tmp.c_str());
            user_error("save_folder {}: cannot create its lock ({})", folder, std::strerror(e));
        }
        // Held: by whom, and is it still there?
        Json owner = Json::object();
        try {
            owner = read_json_file(path, "lock");
            if (!owner.is_object()) owner = Json::object();
        } catch (const UserError&) {
            owner = Json::object();  // not a lock this trainer wrote: judged by its heartbeat alone
        }
        const bool same_host = owner.contains("host") && owner["host"] == host_name();
        bool gone = false;
        std::string why;
        if (same_host && owner.contains("pid") && owner["pid"].is_number_integer()) {
            const long pid = owner["pid"].get<long>();
            const bool runs = pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
            const bool same = owner.contains("pid_start") && owner["pid_start"].is_number_unsigned() &&
                              owner["pid_start"].get<unsigned long long>() == process_start(pid);
            gone = !runs || !same;
            why = "which no longer runs";
        } else {
            // Another host (or an unreadable lock): alive while its heartbeat moves.
            const auto first = modified(path);
            if (!first) continue;  // released meanwhile: try again
            double age = seconds_since(*first);
            bool moved = false, released = false;
            if (age < stale_after) {
                std::fprintf(stderr,
                             "save_folder %s: locked by %s; its heartbeat is %.0f s old: waiting up to %.0f s for "
                             "it to move (a live run) or go stale (TRAINER_SAVE_LOCK_STALE_SECONDS)\n",
                             folder.c_str(), describe_owner(owner).c_str(), age, stale_after - age);
                while (age < stale_after && !moved) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(200));
                    const auto m = modified(path);
                    released = !m;
                    if (released) break;
                    moved = m->tv_sec != first->tv_sec || m->tv_nsec != first->tv_nsec;
                    age = seconds_since(*m);
                }
                if (released) continue;
            }
            gone = !moved;
            why = fmt::format("whose heartbeat stopped {:.0f} s ago", age);
        }
        if (!gone || attempt >= 5) {
            ::unlink(tmp.c_str());
            user_error(
                "save_folder {} is in use by {}: two runs in one folder would replace each other's checkpoints; "
                "wait for it to end, stop it, or choose another folder (its lock: {})",
                folder, describe_owner(owner), path);
        }
        // Take it over: the rename succeeds for one of several runs that found it stale at once.
        const std::string stale = path + ".stale-" + run_id;
        if (::rename(path.c_str(), stale.c_str()) == 0) {
            ::unlink(stale.c_str());
            std::fprintf(stderr, "save_folder %s: took over the lock of %s, %s\n", folder.c_str(),
                         describe_owner(owner).c_str(), why.c_str());
        }
    }
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
