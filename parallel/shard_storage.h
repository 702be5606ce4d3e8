// The state a strategy keeps for the part of a unit this rank updates (a replica's part is the whole
// unit): parameters, gradients and the two AdamW moments, each `numel` floats, zeroed; and, with CPU
// offload, where each lives and how it moves between the host and the device. Shared by every strategy.
//
// Without offload everything lives on the device and the optimizer updates it there. With
// cpu_offload.optimizer_state the fp32 master parameters, a host copy of the gradients and the moments
// live in host memory (Backend::alloc_host: pinned on a GPU) and the optimizer runs on the host. The
// strategy calls grads_final() as soon as the device gradients are final for the step (their copy down
// then runs beside the rest of the backward), grads_on_host() before the optimizer, and after_update()
// after it (the updated parameters start up to the device; device_params() and device_bf16() make the
// device work that reads them wait for the upload, so it overlaps whatever the device does first). The
// device keeps only what compute reads: the fp32 parameters, or only the bf16 copy that mixed-precision
// FSDP gathers (AdamW writes it on the host in the same pass, and it goes up at half the bytes), or, with
// cpu_offload.parameters, nothing: upload_params() brings the shard up for each gather.
#pragma once

#include <cstdint>

#include "base/config.h"
#include "kernels/backend.h"
#include "parallel/strategy.h"

namespace trainer {

class ShardStorage {
   public:
    ShardStorage() = default;
    // `bf16_copy`: keep the parameters rounded to bf16 too (what mixed-precision FSDP gathers).
    ShardStorage(Backend* backend, size_t numel, const CpuOffloadConfig& offload, bool bf16_copy);

    size_t numel() const { return numel_; }
    // The optimizer's view of elements [begin, begin + numel) of unit `unit`: device memory, or host memory
    // (on_host) under CPU offload, which no upload still reads when this returns (the optimizer and a
    // checkpoint load may write it).
    ShardView view(int unit, size_t begin);
    // The device gradients the strategy accumulates and reduces into.
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
    // Offload: the device gradients are final for this step; starts their copy to the host (once a step).
    void grads_final();
    // Offload: before the optimizer, the host gradients are complete (starting their copy if
    // grads_final() was not called). No-op without offload.
    void grads_on_host();
    // Offload: after the optimizer updated the host state, starts the upload of the device copies.
    void after_update();

   private:
    Backend* backend_ = nullptr;
    size_t numel_ = 0;
    bool offload_ = false;
    // Device: the fp32 parameters (the master without offload, else a copy), the bf16 copy, the gradients
    // and (without offload) the moments.
    DeviceBuffer params_, bf16_, grads_, exp_avg_, exp_avg_sq_;
    // Host (offload): the master parameters, their bf16 rounding for the upload, the gradients, the moments.
    DeviceBuffer host_params_, host_bf16_, host_grads_, host_exp_avg_, host_exp_avg_sq_;
    uint64_t grads_ticket_ = 0, upload_ticket_ = 0;  // the copies in flight (Backend::copy_async)
    bool grads_sent_ = false;
};

}  // namespace trainer
