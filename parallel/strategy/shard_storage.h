// The state a strategy keeps for the part of a unit this rank updates (a replica's part is the whole
// unit): parameters, gradients and the two AdamW moments, each `numel` floats, zeroed; and, with CPU
// offload, where each lives and how it moves between the host and the device. Shared by every strategy.
//
// Without offload everything lives on the device and the optimizer updates it there. With
// cpu_offload.optimizer_state the fp32 master parameters and the moments live in host memory
// (Backend::alloc_host: pinned on a GPU) and the optimizer runs on the host; the gradients stay on the
// device, where they were reduced and where the optimizer takes their norm, and it streams them down in
// chunks as it updates (core/optimizer.cpp), so host memory holds no copy of them. After each chunk's
// update the optimizer starts that chunk's parameters up to the device (ShardView::upload), so the uploads
// overlap the host's next chunk as the downloads do; device_params() and device_bf16() make the device
// work that reads them wait for the last upload, so it overlaps whatever the device does first too. The
// device keeps only what compute reads: the fp32 parameters, or only the bf16
// copy that mixed-precision FSDP gathers (AdamW writes it on the host in the same pass, and it goes up at
// half the bytes), or, with cpu_offload.parameters, nothing: upload_params() brings the shard up for each
// gather.
#pragma once

#include <cstdint>

#include "base/config.h"
#include "kernels/backend.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

class ShardStorage {
   public:
    ShardStorage() = default;
    // `bf16_copy`: keep the parameters rounded to bf16 too (what mixed-precision FSDP gathers). `frozen` (LoRA's
    // base): parameters only, in the type compute reads (the bf16 rounding alone with bf16_copy: no fp32 master;
    // frozen_parameters, or host memory with cpu_offload.parameters), no gradient, no moments, no optimizer view.
    ShardStorage(Backend* backend, size_t numel, const CpuOffloadConfig& offload, bool bf16_copy, bool frozen = false);

    size_t numel() const { return numel_; }
    bool frozen() const { return frozen_; }
    // The optimizer's view of `n` elements of this storage from element `offset` (the rest of it where `n` is
    // npos), which are elements [begin, begin + n) of unit `unit`: device memory, or host memory (on_host)
    // under CPU offload but for the gradients, which no upload still reads when this returns (the optimizer
    // and a checkpoint load may write it); under offload, `upload` starts a range up to the device.
    ShardView view(int unit, size_t begin, size_t offset = 0, size_t n = static_cast<size_t>(-1));
    // The device gradients the strategy accumulates and reduces into (null when frozen).
    float* grads() const { return grads_.f32(); }
    // The fp32 parameters on the device (null where only the bf16 copy or nothing is kept there), once the
    // last upload has landed (for the work queued from now on).
    float* device_params();
    // The bf16 copy on the device (null without one, or with the parameters offloaded), likewise.
    uint16_t* device_bf16();
    // cpu_offload.parameters: a new device buffer under `category` holding the shard as compute reads it
    // (bf16 with a bf16 copy, else fp32), uploaded for the work queued from now on.
    DeviceBuffer upload_params(MemCategory category);

    // Writes elements [offset, offset + n) of the master parameters from host memory (initialisation);
    // params_loaded() must follow before the parameters are used.
    void write_params(size_t offset, const float* host, size_t n);
    // The master parameters changed (write_params, a checkpoint load through view()): refreshes the copies.
    void params_loaded();
    void zero_grads();

   private:
    // Offload: starts the upload of elements [a, b) of the device copies from the host's (a no-op where the
    // device keeps none), after the host changed them.
    void upload(size_t a, size_t b);
    Backend* backend_ = nullptr;
    size_t numel_ = 0;
    bool offload_ = false;
    bool frozen_ = false;
    // Device: the fp32 parameters (the master without offload, else a copy), the bf16 copy, the gradients
    // and (without offload) the moments.
    DeviceBuffer params_, bf16_, grads_, exp_avg_, exp_avg_sq_;
    // Host (offload): the master parameters, their bf16 rounding for the upload, the moments.
    DeviceBuffer host_params_, host_bf16_, host_exp_avg_, host_exp_avg_sq_;
    uint64_t upload_ticket_ = 0;  // the last upload in flight (Backend::copy_async)
};

}  // namespace trainer
