// Device work recorded once and replayed as one launch (kernels.cuda_graphs; torch.compile's
// "reduce-overhead", CUDA graphs): a training micro-batch's forward and backward queue some hundreds of ops, each
// a host call and a kernel launch, and where the kernels are short (GPT-2 124M) the device waits for the host
// between them. Replayed from a graph, the micro-batch costs the host one launch.
//
// A body given to GraphRunner::run must queue the same device work every time it runs with a key: the same ops,
// pointers and arguments, everything it depends on already on the device (a micro-batch's tokens are uploaded
// before it), nothing returned to the host, and no host state of its own that later work reads (a replay does
// not run the body's host code). The runner runs a key's body eagerly the first time (its scratch memory and
// the libraries' plans are made then), records it the second time and launches the recording from then on. A
// backend that drops its recordings (it freed memory one may have used, Backend::graph_epoch) has them
// recorded again, after one eager run.
#pragma once

#include <cstdint>
#include <functional>
#include <map>

#include "kernels/backend.h"

namespace trainer {

class GraphRunner {
   public:
    // `enabled` false, or a backend that cannot capture: run() runs every body eagerly.
    GraphRunner(Backend* backend, bool enabled) : backend_(backend), enabled_(enabled && backend->can_capture()) {}

    void run(uint64_t key, const std::function<void()>& body);

    bool enabled() const { return enabled_; }
    // How many bodies were recorded and how many recordings launched (tests, and the run's summary).
    long captures() const { return captures_; }
    long launches() const { return launches_; }

   private:
    struct Entry {
        bool warm = false;  // ran eagerly since the backend's last epoch
        int graph = -1;     // the recording, once made
        uint64_t epoch = 0;
    };
    Backend* backend_;
    bool enabled_;
    std::map<uint64_t, Entry> entries_;
    long captures_ = 0, launches_ = 0;
};

}  // namespace trainer
