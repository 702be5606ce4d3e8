// The dry backend (see backend.h): the shapes of a step's work without the work. Each op's cost is the one the
// forwarding backend gives its calls (forwarding_backend.h, OpCall::costs), so that a new op is priced where it is
// named; this backend notes those costs, runs no op, and hands out addresses no one dereferences.
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/forwarding_backend.h"

namespace trainer {
namespace {

class DryBackend final : public ForwardingBackend {
   public:
    DryBackend(std::function<void(const OpCost&)> observer, bool gemm_operands_bf16, bool gemms_read_aliases)
        : observer_(std::move(observer)),
          gemm_operands_bf16_(gemm_operands_bf16),
          gemms_read_aliases_(gemms_read_aliases) {}

    // Every device op: its costs noted, nothing run. A fused op has none of its own: its parts (Backend's default
    // body, on this backend) are noted one by one.
    void dispatch(const OpCall& call, const std::function<void(Backend&)>& run) override {
        (void)run;
        for (const OpCost& c : call.costs) note(c.op, c.flops, c.bytes);
    }
    void fused_parts(const std::function<void()>& parts) override { parts(); }

    std::string name() const override { return "dry"; }
    bool gemm_operands_bf16() const override { return gemm_operands_bf16_; }
    bool gemms_read_aliases() const override { return gemms_read_aliases_; }

    // Addresses no one dereferences: distinct, 64-byte aligned, far from anything mapped.
    void* alloc(size_t bytes) override {
        const uintptr_t p = next_;
        next_ += (bytes + 63) / 64 * 64 + 64;
        return reinterpret_cast<void*>(p);
    }
    void free(void*) override {}
    void* alloc_host(size_t bytes) override { return alloc(bytes); }
    void free_host(void*) override {}
    void copy_host_to_device(void*, const void*, size_t bytes) override { note("copy_host_to_device", 0, bytes); }
    void copy_device_to_host(void*, const void*, size_t bytes) override { note("copy_device_to_host", 0, bytes); }
    void copy_any(void*, const void*, size_t bytes) override { note("copy", 0, bytes); }
    void synchronize() override {}
    uint64_t copy_async(void*, const void*, size_t bytes) override {
        note("copy_async", 0, bytes, ++tickets_);
        return tickets_;
    }
    void host_wait(uint64_t ticket) override {
        if (ticket != 0) note("host_wait", 0, 0, ticket);
    }
    void device_wait(uint64_t ticket) override {
        if (ticket != 0) note("device_wait", 0, 0, ticket);
    }

    // The device's figures are Backend's defaults: a dry run has no device.
    double peak_flops(bool bf16, std::string* how) const override { return Backend::peak_flops(bf16, how); }
    double peak_bandwidth(std::string* how) const override { return Backend::peak_bandwidth(how); }
    int64_t device_peak_bytes() const override { return Backend::device_peak_bytes(); }
    std::string library_description() const override { return Backend::library_description(); }
    void begin_activity() override {}
    Activity end_activity() override { return {}; }
    std::vector<std::pair<std::string, double>> device_counters() override { return {}; }
    bool has_linear_bf16_reference() const override { return false; }
    bool has_lora() const override { return true; }  // the plan prices LoRA for the device it stands for
    bool has_nf4() const override { return true; }
    bool linear_bf16_reference_forward(uint16_t*, const uint16_t*, const uint16_t*, int M, int K, int N) override {
        const double m = M, k = K, n = N;
        note("linear_bf16_reference_forward", 2 * m * k * n, 2 * (m * k + n * k + m * n));
        return true;
    }
    bool linear_bf16_reference_backward(uint16_t*, uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int M,
                                        int K, int N) override {
        const double m = M, k = K, n = N;
        note("linear_bf16_reference_backward", 4 * m * k * n, 4 * (m * n + m * k + n * k));
        return true;
    }

   private:
    void note(const char* op, double flops, double bytes, uint64_t ticket = 0) {
        if (observer_) observer_({op, flops, bytes, ticket});
    }
    std::function<void(const OpCost&)> observer_;
    bool gemm_operands_bf16_, gemms_read_aliases_;
    uintptr_t next_ = uintptr_t(1) << 44;
    uint64_t tickets_ = 0;  // copy_async's, from 1
};

}  // namespace

std::unique_ptr<Backend> make_dry_backend(std::function<void(const OpCost&)> observer, bool gemm_operands_bf16,
                                          bool gemms_read_aliases) {
    return std::make_unique<DryBackend>(std::move(observer), gemm_operands_bf16, gemms_read_aliases);
}

}  // namespace trainer
