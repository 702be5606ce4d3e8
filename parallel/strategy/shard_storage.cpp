// A strategy's per-unit state and its CPU offload (see shard_storage.h).
#include "parallel/strategy/shard_storage.h"

#include <algorithm>
#include <vector>

#include "base/common.h"
#include "kernels/cpu/ops.h"

namespace trainer {

ShardStorage::ShardStorage(Backend* backend, size_t numel, const CpuOffloadConfig& offload, bool bf16_copy, bool frozen)
    : backend_(backend), numel_(numel), offload_(offload.optimizer_state), frozen_(frozen) {
    TRAINER_CHECK(!offload.parameters || offload.optimizer_state, "parameter offload without optimizer offload");
    if (numel == 0) return;  // an empty unit (a parameter-free final norm): null pointers, nothing counted
    const size_t bytes = numel * sizeof(float), half = numel * sizeof(uint16_t);
    auto zeroed = [&](size_t n, MemCategory c) {
        DeviceBuffer b(backend, n, c);
        if (!mem_category_is_host(c)) backend->fill_zero(b.data(), n);  // host memory comes zeroed
        return b;
    };
    if (frozen) {
        // Parameters only, never updated, in the type compute reads (bf16 alone where that is what is gathered: no
        // fp32 master beside it): on the device (frozen_parameters), or with cpu_offload.parameters in host memory,
        // uploaded for each gather.
        if (offload.parameters) {
            if (bf16_copy) {
                host_bf16_ = zeroed(half, MemCategory::kHostParameters);
            } else {
                host_params_ = zeroed(bytes, MemCategory::kHostParameters);
            }
            return;
        }
        offload_ = false;
        if (bf16_copy) {
            bf16_ = zeroed(half, MemCategory::kFrozenParameters);
        } else {
            params_ = zeroed(bytes, MemCategory::kFrozenParameters);
        }
        return;
    }
    // The device's fp32 parameters: the master without offload; with optimizer offload, the copy compute
    // reads, unless the bf16 copy serves instead or the parameters are offloaded too.
    if (!offload_ || (!offload.parameters && !bf16_copy)) params_ = zeroed(bytes, MemCategory::kParameters);
    if (bf16_copy && !offload.parameters) bf16_ = zeroed(half, MemCategory::kParameters);
    grads_ = zeroed(bytes, MemCategory::kGradients);
    if (!offload_) {
        exp_avg_ = zeroed(bytes, MemCategory::kOptimizerState);
        exp_avg_sq_ = zeroed(bytes, MemCategory::kOptimizerState);
        return;
    }
    host_params_ = zeroed(bytes, MemCategory::kHostParameters);
    if (bf16_copy) host_bf16_ = zeroed(half, MemCategory::kHostParameters);
    host_exp_avg_ = zeroed(bytes, MemCategory::kHostOptimizerState);
    host_exp_avg_sq_ = zeroed(bytes, MemCategory::kHostOptimizerState);
}

ShardView ShardStorage::view(int unit, size_t begin, size_t offset, size_t n) {
    TRAINER_CHECK(!frozen_, "view: unit {} is frozen; the optimizer never sees it", unit);
    TRAINER_CHECK(offset <= numel_, "view: offset {} outside the shard's {} elements", offset, numel_);
    n = std::min(n, numel_ - offset);
    if (offload_) backend_->host_wait(upload_ticket_);
    // Elements [offset, offset + n) of a buffer (null stays null).
    const auto at = [offset](auto* p) { return p != nullptr ? p + offset : nullptr; };
    ShardView v;
    v.unit = unit;
    v.begin = begin;
    v.end = begin + n;
    v.on_host = offload_;
    v.grad = at(grads_.f32());
    if (offload_) {
        v.param = at(host_params_.f32());
        v.exp_avg = at(host_exp_avg_.f32()), v.exp_avg_sq = at(host_exp_avg_sq_.f32());
        v.param_bf16 = at(host_bf16_.bf16());
        v.upload = [this, offset](size_t a, size_t b) { upload(offset + a, offset + b); };
    } else {
        v.param = at(params_.f32());
        v.exp_avg = at(exp_avg_.f32()), v.exp_avg_sq = at(exp_avg_sq_.f32());
        v.param_bf16 = at(bf16_.bf16());
    }
    return v;
}

float* ShardStorage::device_params() {
    backend_->device_wait(upload_ticket_);
    return params_.f32();
}

uint16_t* ShardStorage::device_bf16() {
    backend_->device_wait(upload_ticket_);
    return bf16_.bf16();
}

DeviceBuffer ShardStorage::upload_params(MemCategory category) {
    const DeviceBuffer& src = host_bf16_.data() != nullptr ? host_bf16_ : host_params_;
    TRAINER_CHECK(offload_ && params_.data() == nullptr && bf16_.data() == nullptr,
                  "upload_params: the parameters are not offloaded");
    DeviceBuffer out(backend_, src.bytes(), category);
    upload_ticket_ = backend_->copy_async(out.data(), src.data(), src.bytes());
    backend_->device_wait(upload_ticket_);
    return out;
}

void ShardStorage::write_params(size_t offset, const float* host, size_t n) {
    TRAINER_CHECK(offset + n <= numel_, "write_params: [{}, {}) outside the shard's {} elements", offset, offset + n,
                  numel_);
    if (n == 0) return;
    if (frozen_ && params_.data() == nullptr && host_params_.data() == nullptr) {
        // A frozen bf16-only shard: rounded once here.
        std::vector<uint16_t> half(n);
        cpu::cast_float_to_bf16(half.data(), host, n);
        if (offload_) {
            std::copy_n(half.data(), n, host_bf16_.bf16() + offset);
        } else {
            backend_->copy_host_to_device(bf16_.bf16() + offset, half.data(), n * sizeof(uint16_t));
        }
        return;
    }
    if (offload_) {
        std::copy_n(host, n, host_params_.f32() + offset);
    } else {
        backend_->copy_host_to_device(params_.f32() + offset, host, n * sizeof(float));
    }
}

void ShardStorage::params_loaded() {
    if (numel_ == 0) return;
    if (frozen_ && params_.data() == nullptr && host_params_.data() == nullptr) return;  // written as bf16
    if (!offload_) {
        if (bf16_.data() != nullptr) backend_->cast_float_to_bf16(bf16_.bf16(), params_.f32(), numel_);
        return;
    }
    backend_->host_wait(upload_ticket_);  // the host copies are about to change
    if (host_bf16_.data() != nullptr) cpu::cast_float_to_bf16(host_bf16_.bf16(), host_params_.f32(), numel_);
    upload(0, numel_);
}

void ShardStorage::zero_grads() {
    if (numel_ > 0 && !frozen_) backend_->fill_zero(grads_.data(), numel_ * sizeof(float));
}

void ShardStorage::upload(size_t a, size_t b) {
    TRAINER_CHECK(offload_ && a <= b && b <= numel_, "upload: [{}, {}) of a shard of {} elements (offload {})", a, b,
                  numel_, offload_);
    if (a == b) return;
    // Copies finish in the order queued: the last one's ticket covers the earlier uploads.
    if (params_.data() != nullptr)
        upload_ticket_ = backend_->copy_async(params_.f32() + a, host_params_.f32() + a, (b - a) * sizeof(float));
    if (bf16_.data() != nullptr)
        upload_ticket_ = backend_->copy_async(bf16_.bf16() + a, host_bf16_.bf16() + a, (b - a) * sizeof(uint16_t));
}

}  // namespace trainer
