// Recorded device work (see graph.h).
#include "kernels/graph.h"

#include "base/common.h"

namespace trainer {

void GraphRunner::run(uint64_t key, const std::function<void()>& body) {
    if (!enabled_) {
        body();
        return;
    }
    Entry& e = entries_[key];
    if (e.epoch != backend_->graph_epoch()) e = Entry{false, -1, backend_->graph_epoch()};  // its recording dropped
    if (!e.warm) {
        body();
        e.warm = true;
        e.epoch = backend_->graph_epoch();  // the eager run may have grown (freed) scratch memory
        return;
    }
    if (e.graph < 0) {
        // Nothing runs while recording: a failed recording changed no device memory, and the run stops with
        // what failed.
        backend_->begin_capture();
        try {
            body();
            e.graph = backend_->end_capture();
        } catch (const std::exception& ex) {
            backend_->abort_capture();
            user_error(
                "kernels.cuda_graphs: recording a micro-batch's forward and backward as a CUDA graph failed: {}; run "
                "without kernels.cuda_graphs",
                ex.what());
        }
        e.epoch = backend_->graph_epoch();
        ++captures_;
    }
    backend_->launch_graph(e.graph);
    ++launches_;
}

}  // namespace trainer
