// DDP: a full replica on every rank; gradients all-reduced unit by unit (a unit is a bucket) as soon as
// the unit's backward is done, so the reduction of block l overlaps with the backward of block l-1 on the
// communicator's thread. grad_sync_mode "batch" reduces once per optimizer step, on the last micro-batch;
// "micro_batch" reduces after every micro-batch.
//
// The reduction is a mean: the model scales each rank's loss gradient by world / (global tokens), and the
// all-reduced sum is divided by world. A mean keeps micro_batch mode right: what was reduced after earlier
// micro-batches is identical on every rank, and averaging leaves it unchanged while the new contributions
// sum. Used for fsdp NO_SHARD too, which must cost what DDP costs, and for the single-process strategy
// (a group of one, where every collective is a no-op).
//
// LoRA: a frozen unit (the base) holds parameters only; it has no gradient to reduce and no part for the optimizer.
// It is kept in its packed form where that is narrower (packed_unit.h: NF4 under QLoRA, bf16 under bf16 parameters
// (NO_SHARD mixed / pure), its Linear weights bf16 under amp_bf16) and unpacked into an fp32 copy for as long as a
// hook holds it (gathered_units), its bf16 Linear weights named as that copy's words (Backend::alias_bf16) so the
// GEMMs read them as stored; where they read nothing else (Backend::gemms_read_aliases, CUDA) those weights are not
// widened at all, and NF4 weights are dequantized straight into bf16 words placed in the copy (packed_unit.h) rather
// than into fp32 values each GEMM casts again. The copies' buffers are kept for the next unit rather than freed (a
// recorded micro-batch, kernels.cuda_graphs, allocates nothing and replays the same buffers): after the first
// micro-batch there is one, the size of the largest packed unit, or two where a tied head holds the embedding with the
// head.
//
// Mixed / pure (NO_SHARD): a trained unit's compute copy is its parameters rounded to bf16, made once a step. Where
// the GEMMs read bf16 words (Backend::gemms_read_aliases) its Linear weights are rounded straight to their words,
// placed in the head of their own fp32 regions and named there for the whole run (packed_unit.h, LinearRuns), so no
// GEMM casts them again.
//
// CPU offload (cpu_offload.optimizer_state; shard_storage.h): the gradients stay on the device, where the
// optimizer streams them down as it updates. The replica's parameters stay on the device (offloading them
// is FSDP's).
#include <memory>
#include <vector>

#include "base/common.h"
#include "parallel/comm/communicator.h"
#include "parallel/strategy/packed_unit.h"
#include "parallel/strategy/shard_storage.h"
#include "parallel/strategy/strategy.h"

namespace trainer {
namespace {

class DdpStrategy final : public Strategy {
   public:
    DdpStrategy(Backend* backend, const ParamLayout& layout, Communicator* comm, bool sync_every_micro_batch,
                std::string name, WirePrecision precision, const CpuOffloadConfig& offload,
                std::unique_ptr<Communicator> owned_comm = nullptr)
        : Strategy(comm ? comm : owned_comm.get()),
          backend_(backend),
          owned_comm_(std::move(owned_comm)),
          every_micro_(sync_every_micro_batch),
          precision_(precision),
          name_(std::move(name)) {
        if (offload.parameters) {
            user_error("cpu_offload.parameters: {} keeps full replicas on the device; use fsdp FULL_SHARD", name_);
        }
        for (const auto& u : layout.units()) {
            Unit s;
            s.pack = PackedUnit(u, frozen_form(u, precision_.bf16_params), u.double_quant);
            s.packed = s.pack.narrower();
            s.state = ShardStorage(backend, s.packed ? s.pack.floats() : u.numel, offload, false, u.frozen);
            if (precision_.bf16_params && u.numel > 0 && !u.frozen) {
                s.compute = DeviceBuffer(backend, u.numel * sizeof(float), MemCategory::kGatheredUnits);
                if (backend->gemms_read_aliases()) s.linears.add(u, 0);
            }
            units_.push_back(std::move(s));
        }
    }

    ~DdpStrategy() override {
        for (auto& s : units_) {
            if (s.widened.data() != nullptr) s.pack.unalias(*backend_, s.widened.f32(), linear_words());  // held
            if (s.compute_named) s.linears.unalias(*backend_, s.compute.f32());
        }
    }

    std::string name() const override { return name_; }
    float* unit_params(int u) override {
        Unit& s = units_.at(u);
        if (s.packed) {
            TRAINER_CHECK(s.refs > 0, "unit {} parameters used outside its hooks", u);
            if (s.widened.data() == nullptr) {
                s.widened = spare_buffer(s.pack.numel() * sizeof(float));
                const auto* packed = reinterpret_cast<const uint8_t*>(s.state.device_params());
                s.pack.unpack(*backend_, s.widened.f32(), packed, linear_words());
                s.pack.alias(*backend_, s.widened.f32(), packed);
            }
            return s.widened.f32();
        }
        if (!precision_.bf16_params || s.state.frozen()) return s.state.device_params();
        const size_t n = s.state.numel();
        if (s.compute_stale && n > 0) {
            // The bf16-rounded compute copy of the fp32 parameters (its Linear weights as words where GEMMs read them).
            s.linears.round(*backend_, s.compute.f32(), s.state.device_params(), n,
                            s.linears.empty() ? LinearWords::kWiden : LinearWords::kPlace);
            if (!s.compute_named && !s.linears.empty()) s.linears.alias(*backend_, s.compute.f32());
            s.compute_named = !s.linears.empty();
            s.compute_stale = false;
        }
        return s.compute.f32();
    }
    float* unit_grads(int u) override { return units_.at(u).state.grads(); }

    void begin_step(int num_micro_batches) override { num_micro_ = num_micro_batches; }
    void begin_micro_batch(int index) override { micro_ = index; }
    void before_forward(int u) override { hold(u); }
    void after_forward(int u) override { release(u); }
    void before_backward(int u) override {
        hold(u);
        // micro_batch mode: the previous micro-batch's reduction of this unit must land (and be averaged)
        // before this backward accumulates into the same buffer.
        settle(u);
    }
    void after_backward(int u) override {
        release(u);
        const bool last_micro = micro_ == num_micro_ - 1;
        Unit& s = units_[u];
        const size_t n = s.state.numel();
        if (world_->size() == 1 || (!every_micro_ && !last_micro) || n == 0 || s.state.frozen()) return;
        if (precision_.bf16_reduce) {
            s.wire = DeviceBuffer(backend_, n * 2, MemCategory::kCommunication);
            backend_->cast_float_to_bf16(s.wire.bf16(), s.state.grads(), n);
            s.pending = world_->all_reduce(s.wire.data(), n, CommDType::kBFloat16);
        } else {
            s.pending = world_->all_reduce(s.state.grads(), n, CommDType::kFloat32);
        }
        s.has_pending = true;
    }
    void finish_backward() override {
        for (size_t u = 0; u < units_.size(); ++u) settle(static_cast<int>(u));
    }

    void zero_grads() override {
        for (auto& s : units_) s.state.zero_grads();
    }
    std::vector<ShardView> owned_shards() override {
        std::vector<ShardView> views;
        for (size_t u = 0; u < units_.size(); ++u) {
            if (!units_[u].state.frozen()) views.push_back(units_[u].state.view(static_cast<int>(u), 0));
        }
        return views;
    }
    void after_optimizer_step() override {
        for (auto& s : units_) s.compute_stale = true;  // the optimizer uploaded what it updated
    }

    void load_full_unit_params(int u, const float* host) override {
        Unit& s = units_.at(u);
        if (s.packed) {
            std::vector<float> packed(s.pack.floats());
            s.pack.pack(host, reinterpret_cast<uint8_t*>(packed.data()));
            s.state.write_params(0, packed.data(), packed.size());
            return;
        }
        s.state.write_params(0, host, s.state.numel());
        s.compute_stale = true;
    }
    void params_loaded() override {
        for (auto& s : units_) {
            s.state.params_loaded();
            s.compute_stale = true;
        }
    }

   private:
    // What unpacking a packed unit does with its Linear weights: left to the packed words where the GEMMs read them.
    LinearWords linear_words() const {
        return backend_->gemms_read_aliases() ? LinearWords::kSkip : LinearWords::kWiden;
    }
    // A packed unit's fp32 copy lives while a hook holds the unit; its buffer then waits in spares_ for the next.
    void hold(int u) { ++units_.at(u).refs; }
    void release(int u) {
        Unit& s = units_.at(u);
        TRAINER_CHECK(s.refs > 0, "unit {} released more often than held", u);
        if (--s.refs > 0 || s.widened.data() == nullptr) return;
        s.pack.unalias(*backend_, s.widened.f32(), linear_words());
        spares_.push_back(std::move(s.widened));
    }
    // The smallest spare buffer of at least `bytes`, or where none is that large a new one (the spares, all smaller,
    // are freed first): the same sequence of units gets the same buffers every micro-batch.
    DeviceBuffer spare_buffer(size_t bytes) {
        size_t best = spares_.size();
        for (size_t i = 0; i < spares_.size(); ++i) {
            if (spares_[i].bytes() >= bytes && (best == spares_.size() || spares_[i].bytes() < spares_[best].bytes()))
                best = i;
        }
        if (best == spares_.size()) {
            spares_.clear();
            return DeviceBuffer(backend_, bytes, MemCategory::kGatheredUnits);
        }
        DeviceBuffer b = std::move(spares_[best]);
        spares_.erase(spares_.begin() + static_cast<std::ptrdiff_t>(best));
        return b;
    }
    void settle(int u) {
        Unit& s = units_[u];
        if (!s.has_pending) return;
        wait(s.pending);
        s.has_pending = false;
        const size_t n = s.state.numel();
        if (precision_.bf16_reduce) {
            backend_->cast_bf16_to_float(s.state.grads(), s.wire.bf16(), n);
            s.wire.reset();
        }
        backend_->scale_inplace(s.state.grads(), n, 1.0f / static_cast<float>(world_->size()));
    }

    struct Unit {
        ShardStorage state;          // the whole unit: a replica
        DeviceBuffer compute;        // mixed / pure: the parameters rounded to bf16, as compute reads them
        LinearRuns linears;          // compute's Linear weights, where they are its words (gemms_read_aliases)
        bool compute_named = false;  // linears named to the backend (from the first rounding to the end)
        DeviceBuffer wire;           // pure: the bf16 gradients while their all-reduce is in flight
        CommHandle pending;          // its gradient all-reduce, when in flight
        bool has_pending = false, compute_stale = true;
        bool packed = false;  // a frozen unit in a narrower form: the state holds pack's packed form
        PackedUnit pack;
        DeviceBuffer widened;  // packed: the fp32 unit while a hook holds it
        int refs = 0;
    };
    Backend* backend_;
    std::unique_ptr<Communicator> owned_comm_;  // the group of one of the single-process strategy
    bool every_micro_;
    WirePrecision precision_;
    std::string name_;
    int num_micro_ = 1, micro_ = 0;
    std::vector<Unit> units_;
    std::vector<DeviceBuffer> spares_;  // packed units' fp32 copies, free for the next unit held
};

}  // namespace

std::unique_ptr<Strategy> make_single_strategy(Backend* backend, const ParamLayout& layout,
                                               const CpuOffloadConfig& offload) {
    // One process is DDP over a group of one: every collective is a no-op.
    return std::make_unique<DdpStrategy>(backend, layout, nullptr, false, "single", WirePrecision{}, offload,
                                         make_local_communicator(backend));
}

std::unique_ptr<Strategy> make_ddp_strategy(Backend* backend, const ParamLayout& layout, Communicator* comm,
                                            bool sync_every_micro_batch, const std::string& name,
                                            WirePrecision precision, const CpuOffloadConfig& offload) {
    return std::make_unique<DdpStrategy>(backend, layout, comm, sync_every_micro_batch, name, precision, offload);
}

}  // namespace trainer
