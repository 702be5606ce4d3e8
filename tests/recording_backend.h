// A Backend that records, as the CUDA backend does for kernels.cuda_graphs, on the CPU: the ops queued between
// begin_capture and end_capture are kept as closures over their arguments and run again, in order, by
// launch_graph, on the CPU backend it wraps; outside a recording every call goes straight through. What the
// CUDA backend refuses while recording (kernels/cuda/cuda_backend.cu: memory, host copies and values, the
// optimizer), this refuses too, and freeing memory while recordings exist drops them and raises graph_epoch().
// So the CPU suite checks what a recorded micro-batch relies on (kernels/graph.h): that its device work is the
// same every time, with its inputs on the device and no host code of its own that matters.
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/forwarding_backend.h"

namespace test_util {

class RecordingBackend final : public trainer::ForwardingBackend {
   public:
    using Backend = trainer::Backend;

    explicit RecordingBackend(std::unique_ptr<Backend> inner) : ForwardingBackend(*inner), owned_(std::move(inner)) {}

    long launches() const { return launches_; }
    long recorded_ops() const { return recorded_ops_; }

    // Every device op: recorded while capturing (nothing runs), else run now.
    void dispatch(const trainer::OpCall& call, const std::function<void(Backend&)>& run) override {
        (void)call;
        if (!capturing_) return run(inner());
        tape_.push_back([this, run] { run(inner()); });
        ++recorded_ops_;
    }

    void* alloc(size_t bytes) override {
        no_capture("allocating device memory");
        return inner().alloc(bytes);
    }
    void free(void* ptr) override {
        if (ptr == nullptr) return;
        if (capturing_) {
            fault_ = "freeing device memory";
            return;
        }
        if (!graphs_.empty()) graphs_.clear(), ++epoch_;
        inner().free(ptr);
    }
    void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
        no_capture("a copy from host memory");
        inner().copy_host_to_device(dst, src, bytes);
    }
    void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
        no_capture("a copy to host memory");
        inner().copy_device_to_host(dst, src, bytes);
    }
    void copy_any(void* dst, const void* src, size_t bytes) override {
        no_capture("a copy that may touch host memory");
        inner().copy_any(dst, src, bytes);
    }
    void synchronize() override {
        no_capture("a synchronisation");
        inner().synchronize();
    }
    void* alloc_host(size_t bytes) override {
        no_capture("allocating host memory");
        return inner().alloc_host(bytes);
    }
    uint64_t copy_async(void* dst, const void* src, size_t bytes) override {
        no_capture("an offload copy");
        return inner().copy_async(dst, src, bytes);
    }
    // The CPU backend's copies are done when queued (device_wait is forwarded): nothing to wait for, recording or
    // not (the CUDA backend refuses a wait for a copy still running).

    bool can_capture() const override { return true; }
    void begin_capture() override {
        if (capturing_) throw std::logic_error("a graph is already being recorded");
        capturing_ = true;
        fault_.clear();
        tape_.clear();
    }
    int end_capture() override {
        capturing_ = false;
        if (!fault_.empty()) throw std::runtime_error(fault_ + " while recording");
        graphs_.push_back(std::move(tape_));
        tape_.clear();
        return static_cast<int>(graphs_.size()) - 1;
    }
    void abort_capture() override {
        capturing_ = false;
        tape_.clear();
    }
    void launch_graph(int id) override {
        no_capture("launching a graph");
        if (id < 0 || static_cast<size_t>(id) >= graphs_.size()) throw std::logic_error("no such graph");
        for (const auto& op : graphs_[static_cast<size_t>(id)]) op();
        ++launches_;
    }
    uint64_t graph_epoch() const override { return epoch_; }

    // What the CUDA backend refuses while recording: the optimizer, and values returned to the host.
    void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16) override {
        no_capture("the optimizer step");
        ForwardingBackend::adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                                        param_bf16);
    }
    void adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1, float beta2, float eps,
                            long step, float grad_scale) override {
        no_capture("the optimizer step");
        ForwardingBackend::adamw_update_multi(ranges, lr, beta1, beta2, eps, step, grad_scale);
    }
    double squared_norm(const float* x, size_t n) override {
        no_capture("a squared norm returned to the host");
        return ForwardingBackend::squared_norm(x, n);
    }
    double squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) override {
        no_capture("a squared norm returned to the host");
        return ForwardingBackend::squared_norm_multi(ranges);
    }
    double sum(const float* x, size_t n) override {
        no_capture("a sum returned to the host");
        return ForwardingBackend::sum(x, n);
    }

   private:
    void no_capture(const char* what) const {
        if (capturing_) throw std::runtime_error(std::string(what) + " while recording");
    }

    std::unique_ptr<Backend> owned_;
    bool capturing_ = false;
    std::string fault_;
    std::vector<std::function<void()>> tape_;
    std::vector<std::vector<std::function<void()>>> graphs_;
    uint64_t epoch_ = 0;
    long launches_ = 0, recorded_ops_ = 0;
};

}  // namespace test_util
