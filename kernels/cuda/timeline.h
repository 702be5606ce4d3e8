// What a GPU's streams ran during an activity window (Backend::begin_activity .. end_activity, one training
// step), from pairs of CUDA events recorded around the work, so a step record says how much of the step the
// compute stream ran kernels, waited for collectives, or had nothing to run (the device waited for the
// host: launch overhead, data loading, a host synchronisation), and a trace shows what the device ran.
//
// An interval's first event is recorded before its work is queued and its second after it: the stream reaches
// the first once everything queued before is done (or, when it had nothing left, as the host records it), and
// the second once the work is done, so the time between them is the work's device time and no idle time
// before it. An op's interval holds all its kernels and whatever gaps the host leaves between them (or before
// the first, on an empty stream), so busy time bounds the kernels' time from above; the gaps between ops,
// where the stream had nothing queued, are the host's share. The intervals of ops give the busy time, those
// around the compute stream's waits on other streams the wait time. The events are recycled: pending
// intervals are folded into the sums as their events complete, looked at every kHarvestEvery intervals, and
// the host waits for the oldest only when kMaxPending are outstanding, so a step of a thousand micro-batches
// needs no more events than that.
//
// With a trace recorded (base/trace.h), each of the host's spans on the window's thread is mirrored on the
// device track "cuda compute stream" (its ops inside it, by name), and each communicator's collectives on a
// track of its own. Device times are placed on the trace's clock from the window's first event, recorded when
// the window opens on an idle stream (a traced window synchronises first; a step ends with a synchronisation
// anyway), so the device reaches that event as it is recorded.
//
// All calls come from the thread that opened the window; on any other thread, or with no window open, they
// record nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <vector>

namespace trainer::cuda {

class Timeline {
   public:
    enum class Kind {
        kOp,    // a Backend op on the compute stream: busy time, and a trace span when tracing
        kWait,  // the compute stream waiting for another stream: wait time
        kSpan,  // a host span's extent on the compute stream: trace only
        kComm,  // a collective on the communicator's stream: trace only
    };
    static constexpr size_t kHarvestEvery = 256, kMaxPending = 8192;

    explicit Timeline(cudaStream_t compute) : compute_(compute) {}
    ~Timeline();
    Timeline(const Timeline&) = delete;
    Timeline& operator=(const Timeline&) = delete;

    // Whether a window is open and the caller is its thread; tracing(): and a trace is being recorded.
    // Suspended (a graph being recorded: its events would be recorded into the graph, not timed), it records
    // nothing either.
    bool on() const { return open_ && !suspended_ && std::this_thread::get_id() == owner_; }
    void suspend(bool s) { suspended_ = s; }
    bool tracing() const { return trace_ && on(); }

    void begin_window();
    // Waits for the window's work; the compute stream's busy and wait seconds.
    struct Totals {
        double busy_s = 0.0, wait_s = 0.0;
    };
    Totals end_window();

    // An interval's first event, recorded on `stream` now; null when nothing is recorded (no window, another
    // thread, or a trace-only kind without a trace).
    cudaEvent_t begin(cudaStream_t stream, Kind kind);
    // Its second event, recorded on `stream` now; the interval is folded once its events complete. A null
    // `first` does nothing; `category`, `name` and `bytes` name its trace span.
    // A kComm interval is traced on `track` (one per communicator: their streams overlap).
    void end(cudaEvent_t first, cudaStream_t stream, Kind kind, const char* category = "", std::string name = {},
             int64_t bytes = -1, const std::string& track = {});

    cudaStream_t compute_stream() const { return compute_; }
    int& op_depth() { return op_depth_; }

   private:
    struct Pending {
        cudaEvent_t first, second;
        Kind kind;
        const char* category;
        std::string name;
        int64_t bytes;
        std::string track;
    };
    cudaEvent_t take_event();
    void fold(Pending& p);
    void harvest(bool wait_for_all);

    cudaStream_t compute_;
    bool open_ = false, trace_ = false, suspended_ = false;
    std::thread::id owner_;
    cudaEvent_t start_ = nullptr;  // the window's first event
    double start_us_ = 0.0;        // the trace's clock when start_ was recorded
    double busy_ms_ = 0.0, wait_ms_ = 0.0;
    int op_depth_ = 0;  // ops running inside ops are part of the outer one's interval
    std::deque<Pending> pending_;
    std::vector<cudaEvent_t> spare_;
    size_t since_harvest_ = 0;
};

// One Backend op's interval on the compute stream (outermost ops only).
class OpMark {
   public:
    OpMark(Timeline& timeline, const char* op) : timeline_(timeline), op_(op), counted_(timeline.on()) {
        if (counted_ && timeline_.op_depth()++ == 0)
            first_ = timeline_.begin(timeline_.compute_stream(), Timeline::Kind::kOp);
    }
    ~OpMark() {
        if (!counted_) return;
        --timeline_.op_depth();
        if (first_ == nullptr) return;
        // A destructor must not throw: a CUDA error here is sticky and the op's next call reports it.
        try {
            timeline_.end(first_, timeline_.compute_stream(), Timeline::Kind::kOp, "kernel", op_);
        } catch (...) {
        }
    }
    OpMark(const OpMark&) = delete;
    OpMark& operator=(const OpMark&) = delete;

   private:
    Timeline& timeline_;
    const char* op_;
    bool counted_;
    cudaEvent_t first_ = nullptr;
};

}  // namespace trainer::cuda
