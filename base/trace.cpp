// Tracing (see trace.h).
#include "base/trace.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "base/common.h"

namespace trainer::trace {

namespace detail {
std::atomic<bool> g_enabled{false};
std::atomic<bool> g_ranges{false};
thread_local SpanObserver* t_observer = nullptr;
}  // namespace detail

void observe_spans(SpanObserver* observer) { detail::t_observer = observer; }

namespace {
RangeHooks g_hooks;  // written before g_ranges is set (release), read after it is seen set (acquire)
// The device hooks, under their own mutex: set and cleared while no span runs (the backend's construction
// and destruction), read at every traced span.
std::mutex g_device_mutex;
DeviceHooks g_device;
}  // namespace

void set_device_hooks(DeviceHooks hooks) {
    std::lock_guard<std::mutex> lock(g_device_mutex);
    g_device = hooks.begin != nullptr && hooks.end != nullptr ? hooks : DeviceHooks{};
}

void clear_device_hooks(void* ctx) {
    std::lock_guard<std::mutex> lock(g_device_mutex);
    if (g_device.ctx == ctx) g_device = DeviceHooks{};
}

void set_range_hooks(RangeHooks hooks) {
    detail::g_ranges.store(false, std::memory_order_release);
    g_hooks = hooks;
    if (hooks.push != nullptr && hooks.pop != nullptr) detail::g_ranges.store(true, std::memory_order_release);
}

namespace {

struct Event {
    const char* category;
    std::string name;
    int64_t bytes;
    double begin_us, dur_us;
    int tid;
};

struct State {
    std::mutex mutex;
    int rank = 0;
    std::chrono::steady_clock::time_point t0;
    double wall0_us = 0.0;  // wall-clock microseconds at t0
    std::map<std::thread::id, int> tids;
    std::map<int, std::string> names;
    std::vector<Event> events;
};

State& state() {
    static State s;
    return s;
}

double clock_us() {
    const State& s = state();
    return s.wall0_us + std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s.t0).count();
}

// Track numbers of the named tracks (device streams), beyond any thread's.
constexpr int kNamedTracks = 1000;

// The calling thread's track (the state's mutex held).
int tid_locked(State& s) {
    const auto [it, added] = s.tids.emplace(std::this_thread::get_id(), static_cast<int>(s.tids.size()));
    return it->second;
}

// JSON string escaping for names (quotes, backslashes, control characters).
std::string quoted(const std::string& text) {
    std::string out = "\"";
    for (const char c : text) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            out += fmt::format("\\u{:04x}", static_cast<int>(c));
        } else {
            out += c;
        }
    }
    return out + "\"";
}

// A track that is no thread's (State's mutex held): the next free track number, named `name`.
int named_track_locked(State& s, const std::string& name) {
    for (const auto& [tid, n] : s.names) {
        if (n == name && tid >= kNamedTracks) return tid;
    }
    const int tid = kNamedTracks + static_cast<int>(s.names.size());
    s.names[tid] = name;
    return tid;
}

}  // namespace

double now_us() { return enabled() ? clock_us() : 0.0; }

void add_span(const std::string& track, const char* category, std::string name, int64_t bytes, double begin_us,
              double dur_us) {
    if (!enabled()) return;
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.events.push_back({category, std::move(name), bytes, begin_us, dur_us, named_track_locked(s, track)});
}

void start(int rank) {
    State& s = state();
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.rank = rank;
        s.t0 = std::chrono::steady_clock::now();
        s.wall0_us =
            std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
    }
    detail::g_enabled.store(true);
}

void stop() {
    detail::g_enabled.store(false);
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.events.clear();
    s.tids.clear();
    s.names.clear();
}

void name_thread(const std::string& name) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.names[tid_locked(s)] = name;
}

Span::Span(const char* category, std::string_view name, int64_t bytes)
    : observer_(detail::t_observer),
      on_(observer_ == nullptr && enabled()),
      pop_(observer_ == nullptr && detail::g_ranges.load(std::memory_order_acquire) ? g_hooks.pop : nullptr),
      category_(category),
      name_(on_ || pop_ != nullptr ? std::string(name) : std::string()),
      bytes_(bytes) {
    if (observer_ != nullptr) observer_->begin(category, name);
    if (pop_ != nullptr) g_hooks.push(name_.empty() ? category : name_.c_str());
    if (on_) {
        {
            std::lock_guard<std::mutex> lock(g_device_mutex);
            if (g_device.begin != nullptr) device_token_ = g_device.begin(g_device.ctx);
        }
        begin_us_ = clock_us();
    }
}

Span::~Span() {
    if (observer_ != nullptr) observer_->end();
    if (pop_ != nullptr) pop_();
    if (!on_) return;
    const double end = clock_us();
    if (device_token_ != nullptr) {
        std::lock_guard<std::mutex> lock(g_device_mutex);
        if (g_device.end != nullptr) g_device.end(g_device.ctx, device_token_, category_, name_, bytes_);
    }
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.events.push_back({category_, std::move(name_), bytes_, begin_us_, end - begin_us_, tid_locked(s)});
}

void write(const std::string& path) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    // Beside the destination, renamed over it when whole: a failed write leaves what was there.
    const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr) user_error("trace_file {}: cannot be written ({})", path, std::strerror(errno));
    std::fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    std::fprintf(f, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": \"rank %d\"}}",
                 s.rank, s.rank);
    for (const auto& [tid, name] : s.names) {
        std::fprintf(
            f, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": %s}}",
            s.rank, tid, quoted(name).c_str());
    }
    for (const Event& e : s.events) {
        std::fprintf(f,
                     ",\n{\"name\": %s, \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": %d, "
                     "\"tid\": %d",
                     quoted(e.name).c_str(), e.category, e.begin_us, e.dur_us, s.rank, e.tid);
        if (e.bytes >= 0) std::fprintf(f, ", \"args\": {\"bytes\": %lld}", static_cast<long long>(e.bytes));
        std::fprintf(f, "}");
    }
    std::fprintf(f, "\n]}\n");
    const bool failed = std::ferror(f) != 0 || std::fflush(f) != 0;
    const int e = errno;
    if (std::fclose(f) != 0 || failed || std::rename(tmp.c_str(), path.c_str()) != 0) {
        const int why = failed ? e : errno;
        std::remove(tmp.c_str());
        user_error("trace_file {}: writing failed ({})", path, std::strerror(why));
    }
}

}  // namespace trainer::trace
