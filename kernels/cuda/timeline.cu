// The device's activity window (see timeline.h).
#include <algorithm>
#include <utility>

#include "base/common.h"
#include "base/trace.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/timeline.h"

namespace trainer::cuda {

Timeline::~Timeline() {
    for (const Pending& p : pending_) cudaEventDestroy(p.first), cudaEventDestroy(p.second);
    for (cudaEvent_t e : spare_) cudaEventDestroy(e);
    if (start_ != nullptr) cudaEventDestroy(start_);
}

cudaEvent_t Timeline::take_event() {
    if (!spare_.empty()) {
        cudaEvent_t e = spare_.back();
        spare_.pop_back();
        return e;
    }
    cudaEvent_t e = nullptr;
    TRAINER_CUDA_CHECK(cudaEventCreate(&e));  // timed events
    return e;
}

void Timeline::begin_window() {
    TRAINER_CHECK(!open_, "an activity window is already open");
    if (start_ == nullptr) TRAINER_CUDA_CHECK(cudaEventCreate(&start_));
    owner_ = std::this_thread::get_id();
    trace_ = trace::enabled();
    busy_ms_ = wait_ms_ = 0.0;
    op_depth_ = 0;
    since_harvest_ = 0;
    // A trace places device times from start_'s: the stream must reach it as it is recorded. A step ends
    // with a synchronisation, so this one costs nothing then; before the first step it waits for the setup.
    if (trace_) TRAINER_CUDA_CHECK(cudaStreamSynchronize(compute_));
    TRAINER_CUDA_CHECK(cudaEventRecord(start_, compute_));
    start_us_ = trace::now_us();
    open_ = true;
}

cudaEvent_t Timeline::begin(cudaStream_t stream, Kind kind) {
    if (!on() || ((kind == Kind::kSpan || kind == Kind::kComm) && !trace_)) return nullptr;
    cudaEvent_t e = take_event();
    TRAINER_CUDA_CHECK(cudaEventRecord(e, stream));
    return e;
}

void Timeline::end(cudaEvent_t first, cudaStream_t stream, Kind kind, const char* category, std::string name,
                   int64_t bytes, const std::string& track) {
    if (first == nullptr) return;
    if (!on()) {  // the window closed while the interval was open (a span around the step's end)
        spare_.push_back(first);
        return;
    }
    cudaEvent_t second = take_event();
    TRAINER_CUDA_CHECK(cudaEventRecord(second, stream));
    pending_.push_back({first, second, kind, category, std::move(name), bytes, kind == Kind::kComm ? track : ""});
    if (++since_harvest_ >= kHarvestEvery || pending_.size() >= kMaxPending) {
        since_harvest_ = 0;
        harvest(false);
    }
}

// Adds a completed interval to the sums (and the trace) and recycles its events.
void Timeline::fold(Pending& p) {
    // The duration from its own pair (a float of milliseconds since the window's start would lose
    // microseconds late in a long step), the start from the window's first event (the trace only).
    float dur = 0.0f, begin_ms = 0.0f;
    TRAINER_CUDA_CHECK(cudaEventElapsedTime(&dur, p.first, p.second));
    const double dur_ms = std::max(0.0f, dur);
    if (trace_) TRAINER_CUDA_CHECK(cudaEventElapsedTime(&begin_ms, start_, p.first));
    if (p.kind == Kind::kOp) busy_ms_ += dur_ms;
    if (p.kind == Kind::kWait) wait_ms_ += dur_ms;
    // Waits are traced by the host's "wait" spans mirrored around them.
    if (trace_ && p.kind != Kind::kWait) {
        trace::add_span(p.kind == Kind::kComm ? p.track : "cuda compute stream", p.category, std::move(p.name), p.bytes,
                        start_us_ + 1e3 * begin_ms, 1e3 * dur_ms);
    }
    spare_.push_back(p.first);
    spare_.push_back(p.second);
}

// Folds the completed intervals from the front; with `wait_for_all`, every pending one. Beyond kMaxPending
// the host waits for the oldest.
void Timeline::harvest(bool wait_for_all) {
    while (!pending_.empty()) {
        Pending& p = pending_.front();
        if (wait_for_all || pending_.size() >= kMaxPending) {
            TRAINER_CUDA_CHECK(cudaEventSynchronize(p.second));
        } else {
            const cudaError_t q = cudaEventQuery(p.second);
            if (q == cudaErrorNotReady) break;
            TRAINER_CUDA_CHECK(q);
        }
        fold(p);
        pending_.pop_front();
    }
}

Timeline::Totals Timeline::end_window() {
    TRAINER_CHECK(open_ && std::this_thread::get_id() == owner_, "no activity window is open on this thread");
    harvest(true);
    open_ = false;
    return {busy_ms_ / 1e3, wait_ms_ / 1e3};
}

}  // namespace trainer::cuda
