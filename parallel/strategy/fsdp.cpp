// FSDP FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD over the Communicator.
//
// FSDP units. The wrap policy (wrap_policy.h) groups the layout's units (embedding, block.i, head) into
// FSDP units; each FSDP unit's members are packed, in layout order, into one flat buffer, padded to a
// multiple of the shard group's size and split evenly: rank r owns elements [r*S, (r+1)*S) of the
// parameters, their gradients and the AdamW moments (S = padded / group size). Padding follows the last
// member; it is zero, belongs to no ShardView, so it is never updated and adds nothing to the gradient
// norm. The optimizer sees one ShardView per layout unit that this rank's shard intersects.
//
// Lifetime of a gathered FSDP unit (refcounted over the hooks of its members):
//   before_forward / before_backward of a member gathers it (or waits for its prefetch).
//   It is freed when no hook holds it and the next unit in the pass is not a member, except that
//   SHARD_GRAD_OP keeps every gathered unit until the optimizer step. The root unit (what the policy
//   leaves unwrapped) is needed from the first forward hook to the last backward hook of every
//   micro-batch (PyTorch does not reshard the root after forward); it stays gathered until the optimizer
//   step, which costs no peak memory and saves one all-gather of it per micro-batch after the first.
//   A tied LM head holds the embedding's unit from the head's forward to the embedding's backward.
//   Prefetch: when a unit's hooks run in pass order, the next FSDP unit's all-gather is queued at once
//   (forward_prefetch, backward_prefetch) and runs on the communicator's thread during this unit's compute.
//   limit_all_gathers skips a prefetch while two FSDP units other than the root are gathered.
// Gradients: an FSDP unit's full gradient buffer lives from its first backward hook to its reduction, a
// reduce-scatter into this rank's shard queued when the unit's backward is done (the after_backward of
// its first member), once per step (grad_sync_mode batch: unsharded gradients accumulate across the
// micro-batches, the mode OLMo's FSDP lacks) or after every micro-batch (micro_batch). Reductions run
// asynchronously (at most two in flight; their buffers count as communication memory from the moment
// they are handed over) and are settled before the optimizer. HYBRID_SHARD then
// all-reduces every shard over its replica group once per step.
// Precision: mixed rounds the fp32 master shard to bf16 and gathers bf16 (compute reads the bf16 values
// widened to fp32); pure also reduce-scatters the gradients in bf16. Where the GEMMs read bf16 words
// (Backend::gemms_read_aliases: CUDA in amp_bf16 and amp_fp8) a gathered unit's Linear weights are not widened: their
// gathered words are placed in the head of their fp32 regions and named there (packed_unit.h), so the GEMMs read them
// as gathered, as PyTorch's FSDP computes on its gathered bf16 parameters, without a cast each; the names are dropped
// with the gathered unit.
// As in DDP, each rank's loss gradient carries world / global tokens and reductions are means.
// Alone (a world of one rank, in_place_when_alone): nothing is gathered or reduced; the model computes on
// the shard and accumulates into its gradients, as the single strategy does (mixed precision widens the
// bf16 shard into the unit's compute copy instead of gathering it, once a step: the copies stay for the
// step in every sharding mode unless the parameters are offloaded; pure still reduces to round in bf16).
// LoRA: the wrap policy gives every block's adapters an FSDP unit of their own, so an FSDP unit is all frozen (the
// base: gathered as any unit, but with no gradient, no reduction and no part for the optimizer) or all trained.
// The small adapter units are gathered when used, never prefetched, and not counted by limit_all_gathers.
// A frozen FSDP unit in a narrower form (packed_unit.h: QLoRA's NF4, or its Linear weights bf16 under amp_bf16 with
// fp32 parameters) has its members' packed forms back to back as its flat buffer, sharded and all-gathered as they
// are (NF4 codes and absmaxes, or bf16 words, on the wire), then unpacked into the fp32 unit compute reads (bf16
// Linear weights placed as words, above, where the GEMMs read them). Under
// bf16 parameters (mixed, pure) a frozen unit is its bf16 shards, as any unit. CPU offload (shard_storage.h): the
// shards' gradients stay on the device, where the optimizer streams them down as it updates. With
// cpu_offload.parameters every gather first uploads the shard (bf16 in mixed and pure precision) into a communication
// buffer that lives until the gather has landed.
#include <deque>
#include <memory>
#include <utility>

#include "base/common.h"
#include "parallel/comm/communicator.h"
#include "parallel/strategy/packed_unit.h"
#include "parallel/strategy/shard_storage.h"
#include "parallel/strategy/strategy.h"

namespace trainer {
namespace {

class FsdpStrategy final : public Strategy {
   public:
    FsdpStrategy(Backend* backend, const ParamLayout& layout, Communicator* world, Communicator* shard_group,
                 Communicator* replica_group, FsdpOptions options, std::string name)
        : Strategy(world),
          backend_(backend),
          group_(shard_group),
          replicas_(replica_group),
          opt_(std::move(options)),
          name_(std::move(name)),
          head_(layout.head_unit()),
          alone_(opt_.in_place_when_alone && world->size() == 1),
          params_in_place_(alone_ && !opt_.precision.bf16_params && !opt_.offload.parameters),
          grads_in_place_(alone_ && !opt_.precision.bf16_reduce),
          words_(backend->gemms_read_aliases() ? LinearWords::kPlace : LinearWords::kWiden) {
        // Alone with bf16 parameters, a unit's compute copy is widened from its bf16 shard rather than
        // gathered. Nothing is sharded in a world of one, so every sharding mode keeps the copies for the step
        // as SHARD_GRAD_OP does: one widening per unit and step instead of one per pass (measured on an H100,
        // OLMo-1B: FULL_SHARD at 0.966x `single` with a widening per pass, 0.983x keeping them). Not with
        // cpu_offload.parameters, whose point is that the device never holds every unit at once.
        if (alone_ && opt_.precision.bf16_params && !opt_.offload.parameters) opt_.keep_params_for_step = true;
        const size_t size = static_cast<size_t>(group_->size());
        group_of_.assign(layout.num_units(), -1);
        offset_in_group_.assign(layout.num_units(), 0);
        store_offset_.assign(layout.num_units(), 0);
        store_numel_.assign(layout.num_units(), 0);
        for (size_t g = 0; g < opt_.groups.size(); ++g) {
            Group G;
            G.units = opt_.groups[g];
            G.frozen = !G.units.empty() && layout.units().at(G.units.front()).frozen;
            G.adapters = !G.units.empty() && G.units.front() > head_;
            const FrozenForm form = G.units.empty()
                                        ? FrozenForm::kFp32
                                        : frozen_form(layout.units()[G.units.front()], opt_.precision.bf16_params);
            if (form == FrozenForm::kNf4 || form == FrozenForm::kBf16Linears) {
                for (int u : G.units) G.packed = G.packed || PackedUnit(layout.units()[u], form).narrower();
            }
            for (int u : G.units) {
                TRAINER_CHECK(group_of_.at(u) < 0, "layout unit {} is in two FSDP units", u);
                TRAINER_CHECK(layout.units()[u].frozen == G.frozen, "FSDP unit {} mixes frozen and trained units", g);
                group_of_[u] = static_cast<int>(g);
                offset_in_group_[u] = G.full_numel;
                G.full_numel += layout.units()[u].numel;
                store_offset_[u] = G.numel;
                if (G.packed) {
                    G.packs.emplace_back(layout.units()[u], form, layout.units()[u].double_quant);
                    store_numel_[u] = G.packs.back().floats();
                } else {
                    store_numel_[u] = layout.units()[u].numel;
                    // bf16 on the wire: its Linear weights are placed as words where the GEMMs read them.
                    if (opt_.precision.bf16_params && words_ == LinearWords::kPlace)
                        G.linears.add(layout.units()[u], offset_in_group_[u]);
                }
                G.numel += store_numel_[u];
            }
            G.first_unit = G.units.empty() ? -1 : G.units.front();
            G.shard = (G.numel + size - 1) / size;
            G.padded = G.shard * size;
            // Mixed / pure: the bf16 shard the gathers send, kept current by AdamW's copy-out (and refreshed
            // after loads) instead of a cast before every gather; 2 bytes per shard element, parameters.
            G.mine = ShardStorage(backend, G.shard, opt_.offload, opt_.precision.bf16_params && !G.packed, G.frozen);
            groups_.push_back(std::move(G));
        }
        for (int u = 0; u < layout.num_units(); ++u) {
            TRAINER_CHECK(group_of_[u] >= 0, "layout unit {} is in no FSDP unit", u);
        }
    }

    std::string name() const override { return name_; }
    int checkpoint_files() const override { return group_->size(); }
    int checkpoint_file() const override { return replicas_ && replicas_->rank() != 0 ? -1 : group_->rank(); }

    float* unit_params(int u) override {
        Group& G = groups_.at(group_of_.at(u));
        TRAINER_CHECK(G.gathered && !G.gather_pending, "unit {} parameters used outside its hooks", u);
        if (G.padded == 0) return nullptr;
        return (in_place(G) ? G.mine.device_params() : G.full_params.f32()) + offset_in_group_[u];
    }
    float* unit_grads(int u) override {
        Group& G = groups_.at(group_of_.at(u));
        if (G.frozen) return nullptr;
        TRAINER_CHECK(G.has_grads, "unit {} gradients used outside its backward hooks", u);
        if (G.padded == 0) return nullptr;
        return (grads_in_place_ ? G.mine.grads() : G.full_grads.f32()) + offset_in_group_[u];
    }

    void begin_step(int num_micro_batches) override { num_micro_ = num_micro_batches; }
    void begin_micro_batch(int index) override { micro_ = index; }
    void begin_forward(bool backward_follows) override {
        training_ = backward_follows;
        fwd_cursor_ = 0;
        bwd_cursor_ = head_;
    }
    void before_forward(int u) override {
        acquire(u);
        if (u == fwd_cursor_) {  // in pass order (not the tied head's use of the embedding)
            fwd_cursor_ = u + 1;
            if (opt_.forward_prefetch) prefetch_after(u, +1);
        }
    }
    void after_forward(int u) override { release(u, false); }
    void before_backward(int u) override {
        acquire(u);
        Group& G = groups_[group_of_[u]];
        if (!G.has_grads && G.padded > 0 && !grads_in_place_ && !G.frozen) {
            G.full_grads = DeviceBuffer(backend_, G.padded * sizeof(float), MemCategory::kGradients);
            backend_->fill_zero(G.full_grads.data(), G.padded * sizeof(float));
        }
        G.has_grads = !G.frozen;
        if (u == bwd_cursor_) {
            bwd_cursor_ = u - 1;
            if (opt_.backward_prefetch) prefetch_after(u, -1);
        }
    }
    void after_backward(int u) override { release(u, true); }
    void finish_backward() override {
        while (!pending_.empty()) settle_oldest();
        if (hybrid_replicas()) {
            // HYBRID_SHARD: the replicas of a shard hold partial sums (already divided by the world size).
            for (Group& G : groups_) {
                if (G.shard == 0 || G.frozen) continue;
                if (opt_.precision.bf16_reduce) {
                    DeviceBuffer wire(backend_, G.shard * 2, MemCategory::kCommunication);
                    backend_->cast_float_to_bf16(wire.bf16(), G.mine.grads(), G.shard);
                    wait(replicas_->all_reduce(wire.data(), G.shard, CommDType::kBFloat16));
                    backend_->cast_bf16_to_float(G.mine.grads(), wire.bf16(), G.shard);
                } else {
                    wait(replicas_->all_reduce(G.mine.grads(), G.shard, CommDType::kFloat32));
                }
            }
        }
    }
    ~FsdpStrategy() override {
        for (Group& G : groups_) drop_params(G);  // units gathered at the end: their names dropped
    }

    void after_optimizer_step() override {
        // The shards changed (and, offloaded, the optimizer uploaded them): SHARD_GRAD_OP's kept units (and
        // the root, after an evaluation) are stale.
        for (Group& G : groups_) {
            TRAINER_CHECK(!G.gather_pending, "an FSDP unit's gather is still in flight after the step");
            G.refs = 0;
            G.gathered = false;
            drop_params(G);
        }
    }

    void zero_grads() override {
        for (Group& G : groups_) G.mine.zero_grads();
    }
    std::vector<ShardView> owned_shards() override {
        std::vector<ShardView> views;
        for (Group& G : groups_) {
            if (G.frozen) continue;
            const size_t lo = my_range(G).begin;
            for (int u : G.units) {
                const Range r = owned_part(G, u);
                if (r.empty()) continue;
                const size_t ub = offset_in_group_[u];
                views.push_back(G.mine.view(u, r.begin - ub, r.begin - lo, r.size()));
            }
        }
        return views;
    }
    // Shards partition the model within a shard group; HYBRID_SHARD's replicas hold the same shards.
    double global_grad_sq(double local_sq) override {
        wait(group_->all_reduce(&local_sq, 1, CommDType::kFloat64));
        return local_sq;
    }

    void load_full_unit_params(int u, const float* host) override {
        Group& G = groups_.at(group_of_.at(u));
        const Range r = owned_part(G, u);
        if (r.empty()) return;
        const size_t lo = my_range(G).begin, ub = store_offset_[u];
        std::vector<float> packed;
        if (G.packed) {  // this rank's part of the unit's packed form
            const PackedUnit& pack = G.packs.at(member_index(G, u));
            packed.resize(pack.floats());
            pack.pack(host, reinterpret_cast<uint8_t*>(packed.data()));
            host = packed.data();
        }
        G.mine.write_params(r.begin - lo, host + (r.begin - ub), r.size());
    }
    void params_loaded() override {
        for (Group& G : groups_) G.mine.params_loaded();
    }

   private:
    struct Group {
        std::vector<int> units;
        bool packed = false;  // frozen and narrower: the members' packed forms (packs, in units' order) are the storage
        std::vector<PackedUnit> packs;
        size_t full_numel = 0;  // the members' fp32 elements (compute's layout; numel: the storage's)
        int first_unit = -1;    // the member whose after_backward ends the FSDP unit's backward
        bool frozen = false;    // LoRA's base: no gradients
        bool adapters = false;  // LoRA's adapters (after the head in layout order)
        size_t numel = 0, shard = 0, padded = 0;
        ShardStorage mine;                     // this rank's shard (and, mixed / pure, its bf16 rounding)
        DeviceBuffer full_params, full_grads;  // while gathered / accumulating
        DeviceBuffer wire;                     // bf16 gathered unit while the gather is in flight
        LinearRuns linears;   // bf16 on the wire: the Linear weights, placed as words (words_) in full_params
        bool named = false;   // full_params' Linear weights named to the backend as words
        DeviceBuffer upload;  // cpu_offload.parameters: the uploaded shard until gathered
        CommHandle gather;
        bool gathered = false;   // full parameters resident or in flight
        bool has_grads = false;  // full gradients accumulating
        bool gather_pending = false;
        int refs = 0;
    };
    // This rank's shard of FSDP unit G, in the unit's flat buffer.
    Range my_range(const Group& G) const {
        const size_t lo = static_cast<size_t>(group_->rank()) * G.shard;
        return {lo, lo + G.shard};
    }
    // The part of layout unit u (a member of G) that this rank owns, in G's flat buffer.
    Range owned_part(const Group& G, int u) const {
        const size_t ub = store_offset_[u];
        return intersect(my_range(G), {ub, ub + store_numel_[u]});
    }
    // Compute reads the shard in place: alone in fp32, not packed.
    bool in_place(const Group& G) const { return params_in_place_ && !G.packed; }
    static size_t member_index(const Group& G, int u) {
        for (size_t i = 0; i < G.units.size(); ++i) {
            if (G.units[i] == u) return i;
        }
        TRAINER_CHECK(false, "unit {} is no member", u);
        return 0;
    }
    // Packed: the gathered packed forms at `packed` into the fp32 unit compute reads.
    void unpack(Group& G, const float* packed) {
        for (size_t i = 0; i < G.units.size(); ++i) {
            const int u = G.units[i];
            G.packs[i].unpack(*backend_, G.full_params.f32() + offset_in_group_[u],
                              reinterpret_cast<const uint8_t*>(packed + store_offset_[u]), words_);
        }
        G.named = words_ == LinearWords::kPlace;
    }
    // bf16 parameters: the gathered words at `words` into the fp32 unit compute reads.
    void widen(Group& G, const uint16_t* words) {
        G.linears.widen(*backend_, G.full_params.f32(), words, G.padded, words_);
        G.linears.alias(*backend_, G.full_params.f32());
        G.named = words_ == LinearWords::kPlace;
    }
    // The gathered unit freed, its words' names dropped first.
    void drop_params(Group& G) {
        if (G.named) {
            for (size_t i = 0; i < G.packs.size(); ++i)
                G.packs[i].unalias(*backend_, G.full_params.f32() + offset_in_group_[G.units[i]], words_);
            G.linears.unalias(*backend_, G.full_params.f32());
            G.named = false;
        }
        G.full_params.reset();
    }
    struct PendingReduce {
        int group = 0;
        DeviceBuffer in;  // full gradients: scratch for the reduction, this rank's reduced shard in its block
        CommHandle handle;
    };

    // Queues the all-gather of FSDP unit g unless it is gathered or in flight.
    void start_gather(int g) {
        Group& G = groups_[g];
        if (G.gathered) return;
        G.gathered = true;
        if (G.padded == 0 || in_place(G)) return;  // nothing to gather: no parameters, or the shard is it
        G.full_params =
            DeviceBuffer(backend_, (G.packed ? G.full_numel : G.padded) * sizeof(float), MemCategory::kGatheredUnits);
        const bool bf16 = opt_.precision.bf16_params && !G.packed;
        // What the gather sends: the device's shard (bf16 in mixed / pure), or its upload from the host.
        if (opt_.offload.parameters) G.upload = G.mine.upload_params(MemCategory::kCommunication);
        void* shard = opt_.offload.parameters
                          ? G.upload.data()
                          : (bf16 ? static_cast<void*>(G.mine.device_bf16()) : G.mine.device_params());
        if (alone_) {  // alone: the compute copy is the shard (widened from bf16, or unpacked), no collective
            if (G.packed) {
                unpack(G, static_cast<const float*>(shard));
            } else if (bf16) {
                widen(G, static_cast<const uint16_t*>(shard));
            } else {
                backend_->copy_device_to_device(G.full_params.data(), shard, G.padded * sizeof(float));
            }
            G.upload.reset();
            return;
        }
        if (bf16) {
            G.wire = DeviceBuffer(backend_, G.padded * 2, MemCategory::kCommunication);
            G.gather = group_->all_gather(shard, G.wire.data(), G.shard, CommDType::kBFloat16);
        } else if (G.packed) {  // the packed forms as 4-byte words: moved, never added
            G.wire = DeviceBuffer(backend_, G.padded * sizeof(float), MemCategory::kCommunication);
            G.gather = group_->all_gather(shard, G.wire.data(), G.shard, CommDType::kFloat32);
        } else {
            G.gather = group_->all_gather(shard, G.full_params.data(), G.shard, CommDType::kFloat32);
        }
        G.gather_pending = true;
    }
    void finish_gather(int g) {
        Group& G = groups_[g];
        if (!G.gather_pending) return;
        wait(G.gather);
        G.gather_pending = false;
        G.upload.reset();
        if (G.packed) {
            unpack(G, G.wire.f32());
            G.wire.reset();
        } else if (opt_.precision.bf16_params) {
            widen(G, G.wire.bf16());
            G.wire.reset();
        }
    }
    void acquire(int u) {
        const int g = group_of_[u];
        start_gather(g);
        finish_gather(g);
        ++groups_[g].refs;
    }
    // Queues the gather of the first FSDP unit after u's in pass order (dir +1 forward, -1 backward).
    void prefetch_after(int u, int dir) {
        const int g = group_of_[u];
        int n = u + dir;
        while (n >= 0 && n <= head_ && group_of_[n] == g) n += dir;
        if (n < 0 || n > head_ || groups_[group_of_[n]].gathered) return;
        if (opt_.limit_all_gathers && !opt_.keep_params_for_step) {
            int gathered = 0;
            for (size_t k = 1; k < groups_.size(); ++k) gathered += groups_[k].gathered && !groups_[k].adapters ? 1 : 0;
            if (gathered >= 2) return;
        }
        start_gather(group_of_[n]);
    }
    void release(int u, bool backward_hook) {
        const int g = group_of_[u];
        Group& G = groups_[g];
        TRAINER_CHECK(G.refs > 0, "unit {} released more often than acquired", u);
        --G.refs;
        if (backward_hook && u == G.first_unit) {
            if (opt_.reduce_every_micro_batch || micro_ == num_micro_ - 1) reduce_grads(g);
        }
        // The embedding's backward ends the pass: as PyTorch's FSDP, every reduction lands before the next
        // micro-batch, so no reduction buffer (the root's is the largest) lives through its forward.
        if (backward_hook && u == 0) {
            while (!pending_.empty()) settle_oldest();
        }
        if (G.refs > 0 || opt_.keep_params_for_step) return;
        // The next unit in this pass: forward runs embedding..head, then (training) backward head..embedding.
        int next = -1;
        if (backward_hook) {
            next = u - 1;
        } else {
            next = u < head_ ? u + 1 : (training_ ? head_ - 1 : -1);
        }
        if (next >= 0 && group_of_[next] == g) return;
        if (g == 0 && training_) return;  // the root stays gathered until the optimizer step
        G.gathered = false;
        drop_params(G);
    }
    void reduce_grads(int g) {
        Group& G = groups_[g];
        if (!G.has_grads) return;
        G.has_grads = false;
        if (G.padded == 0 || grads_in_place_) return;  // in place: already in the shard's gradients
        while (pending_.size() >= 2) settle_oldest();  // bounds the unsharded gradients in flight
        PendingReduce p;
        p.group = g;
        // In place: this rank's reduced shard lands in its own block of the input (no output buffer).
        const size_t mine = my_range(G).begin;
        if (opt_.precision.bf16_reduce) {
            p.in = DeviceBuffer(backend_, G.padded * 2, MemCategory::kCommunication);
            backend_->cast_float_to_bf16(p.in.bf16(), G.full_grads.f32(), G.padded);
            G.full_grads.reset();
            p.handle = group_->reduce_scatter(p.in.data(), p.in.bf16() + mine, G.shard, CommDType::kBFloat16);
        } else {
            p.in = std::move(G.full_grads);
            p.in.recategorize(MemCategory::kCommunication);  // the reduction's input from now on
            p.handle = group_->reduce_scatter(p.in.data(), p.in.f32() + mine, G.shard, CommDType::kFloat32);
        }
        pending_.push_back(std::move(p));
    }
    void settle_oldest() {
        PendingReduce p = std::move(pending_.front());
        pending_.pop_front();
        wait(p.handle);
        Group& G = groups_[p.group];
        const size_t mine = my_range(G).begin;
        float* reduced = p.in.f32() + mine;
        DeviceBuffer widened;
        if (opt_.precision.bf16_reduce) {
            widened = DeviceBuffer(backend_, G.shard * sizeof(float), MemCategory::kCommunication);
            backend_->cast_bf16_to_float(widened.f32(), p.in.bf16() + mine, G.shard);
            reduced = widened.f32();
        }
        // Mean over all ranks, accumulated into the shard's gradient (micro_batch mode adds every micro-batch).
        backend_->scale_inplace(reduced, G.shard, 1.0f / static_cast<float>(world_->size()));
        backend_->residual_forward(G.mine.grads(), G.mine.grads(), reduced, G.shard);
    }
    // HYBRID_SHARD with more than one replica: the shards' gradients are all-reduced once more.
    bool hybrid_replicas() const { return replicas_ != nullptr && replicas_->size() > 1; }

    Backend* backend_;
    Communicator *group_, *replicas_;
    FsdpOptions opt_;
    std::string name_;
    int head_;
    // A world of one (in_place_when_alone): the shard is the whole unit; parameters (fp32) and gradients
    // (unless reduced in bf16) are used in place.
    bool alone_, params_in_place_, grads_in_place_;
    // What a gathered unit's bf16 Linear weights become: placed as words where the GEMMs read them, else widened.
    LinearWords words_;
    int num_micro_ = 1, micro_ = 0;
    bool training_ = false;
    int fwd_cursor_ = 0, bwd_cursor_ = 0;
    std::vector<Group> groups_;
    std::vector<int> group_of_;
    // Each layout unit's offset in its FSDP unit's compute layout (fp32), and its offset and size in the FSDP unit's
    // storage (the same but for packed units).
    std::vector<size_t> offset_in_group_, store_offset_, store_numel_;
    std::deque<PendingReduce> pending_;
};

}  // namespace

std::unique_ptr<Strategy> make_fsdp_strategy(Backend* backend, const ParamLayout& layout, Communicator* world,
                                             Communicator* shard_group, Communicator* replica_group,
                                             const FsdpOptions& options, const std::string& name) {
    return std::make_unique<FsdpStrategy>(backend, layout, world, shard_group, replica_group, options, name);
}

}  // namespace trainer
