// Tracing: spans of what each thread of a rank did, written as a Chrome trace (JSON; opens in Perfetto and
// chrome://tracing) with the rank as the process and each thread as a track. Off unless start() was called;
// a span then costs one clock read at each end and one locked append. Times are host wall-clock
// microseconds, so the ranks of one machine line up when their files are merged (scripts/merge_traces.py).
// On a GPU a span measures when the host issued the work, not when the device ran it.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace trainer::trace {

namespace detail {
extern std::atomic<bool> g_enabled;
}

// Starts recording for this process, `rank` being its process id in the trace.
void start(int rank);
// Stops recording and drops what was recorded (a test's trace, in a process that goes on).
void stop();
inline bool enabled() { return detail::g_enabled.load(std::memory_order_relaxed); }

// A dry run's view of the spans (core/plan/dry_run.h): while an observer is set on a thread, that thread's spans are
// reported to it at their begin and end instead of being recorded, so a predicted step carries the same
// spans as a measured one.
struct SpanObserver {
    virtual ~SpanObserver() = default;
    virtual void begin(const char* category, std::string_view name) = 0;
    virtual void end() = 0;
};
// Sets (or with null, clears) the calling thread's observer.
void observe_spans(SpanObserver* observer);
namespace detail {
extern thread_local SpanObserver* t_observer;
}
// Ranges for an external profiler (NVTX ranges for Nsight Systems, registered by the CUDA backend): every
// span of every thread is also pushed there at its begin and popped at its end, named as a trace names it,
// whether or not a trace is being recorded. {nullptr, nullptr} stops it. Set before other threads run spans
// (the CUDA backend sets it when it is made); a span pops through the hooks it pushed through.
struct RangeHooks {
    void (*push)(const char* name) = nullptr;
    void (*pop)() = nullptr;
};
void set_range_hooks(RangeHooks hooks);
namespace detail {
extern std::atomic<bool> g_ranges;
}
// Whether spans on this thread go anywhere (recorded, observed, or profiler ranges): callers build span
// names only then.
inline bool active() {
    return enabled() || detail::t_observer != nullptr || detail::g_ranges.load(std::memory_order_relaxed);
}
// Device tracks (registered by the CUDA backend): while a trace is recorded, every span also calls `begin`
// at its start, which may return a token (a CUDA event recorded on the device's stream), and `end` with
// that token at its close; the device later reports what its stream ran as add_span() on a track of its
// own. {nullptr, ...} stops it; a backend clears only the hooks it set (`ctx`).
struct DeviceHooks {
    void* ctx = nullptr;
    void* (*begin)(void* ctx) = nullptr;
    void (*end)(void* ctx, void* token, const char* category, const std::string& name, int64_t bytes) = nullptr;
};
void set_device_hooks(DeviceHooks hooks);
// Clears the device hooks if `ctx` set them.
void clear_device_hooks(void* ctx);
// The trace's clock: wall-clock microseconds, as the spans' times (0 before start()).
double now_us();
// Records a span that happened on the track named `track` (created at its first use; not a thread's: a
// device stream), from `begin_us` for `dur_us` on the trace's clock.
void add_span(const std::string& track, const char* category, std::string name, int64_t bytes, double begin_us,
              double dur_us);
// Names the calling thread's track ("compute", "gloo world"); a track without a name is "thread <n>".
void name_thread(const std::string& name);
// Writes everything recorded so far as one Chrome trace JSON object to `path` (UserError when it cannot).
void write(const std::string& path);

// A span on the calling thread's track, from construction to destruction. `category` groups spans
// ("step", "forward", "backward", "recompute", "comm", "wait", "optimizer", "data", "checkpoint", "eval");
// `bytes` >= 0 is recorded as an argument (a collective's payload).
class Span {
   public:
    Span(const char* category, std::string_view name, int64_t bytes = -1);
    ~Span();
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    SpanObserver* observer_;
    bool on_;
    void (*pop_)();                 // the range hook to pop at the end, when a range was pushed
    void* device_token_ = nullptr;  // the device hooks' token, when they gave one
    const char* category_;
    std::string name_;
    int64_t bytes_;
    double begin_us_ = 0.0;
};

}  // namespace trainer::trace
