// The Strategy seam: owns where parameters, gradients and optimizer state live, and moves them around
// the model's compute through per-unit hooks. The model and the optimizer never ask which strategy runs.
//
// Hook order for one optimizer step (torchtitan's):
//   zero_grads(); begin_step(k)
//   for each of the k micro-batches: begin_micro_batch(i); begin_forward(true)
//     forward:  before_forward(u) ... after_forward(u) for u = embedding, blocks, head
//     backward: before_backward(u) ... after_backward(u) for u = head, blocks reversed, embedding
//   finish_backward()   (every gradient reduction complete, on the device)
//   optimizer over owned_shards() (offloaded: each updated chunk starts back up, ShardView::upload);
//   after_optimizer_step()
// A tied LM head reads the embedding's parameters and accumulates into its gradients: the model then
// calls before_forward/after_forward(embedding) around the head's forward and before_backward(embedding)
// at the head's backward; the embedding's after_backward comes at the very end, as usual.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "kernels/backend.h"

namespace trainer {

// The part of one unit this rank updates: elements [begin, end) of the unit's flat buffer, with the
// matching gradient and AdamW moments (all pointers to element `begin`). The gradient is in device
// memory, where it was reduced; the rest too, or in host memory when on_host (CPU offload), where the
// optimizer streams the gradient down as it updates.
struct ShardView {
    int unit = 0;
    size_t begin = 0, end = 0;
    float* param = nullptr;
    float* grad = nullptr;
    float* exp_avg = nullptr;
    float* exp_avg_sq = nullptr;
    // Where set, the optimizer also writes the updated parameters rounded to bf16 here, in the same pass
    // (a mixed-precision strategy's gather copy); null otherwise.
    uint16_t* param_bf16 = nullptr;
    bool on_host = false;  // cpu_offload.optimizer_state: the optimizer runs on the host
    // On the host: after updating elements [a, b) of the view (offsets from `begin`), the optimizer calls
    // upload(a, b) to start them up to the device copies compute reads. Null on the device.
    std::function<void(size_t a, size_t b)> upload;
};

class Communicator;
class CommHandle;

class Strategy {
   public:
    // `world` joins every rank of the run (a group of one for a single process); it carries loss sums,
    // barriers and the global gradient norm, and must outlive the strategy.
    explicit Strategy(Communicator* world) : world_(world) {}
    virtual ~Strategy() = default;
    // Short name for logs ("single", "ddp", "fsdp FULL_SHARD").
    virtual std::string name() const = 0;
    int rank() const;        // this rank in the world
    int world_size() const;  // ranks in the world

    // Full parameters of unit u (device), valid between before_forward(u) and after_forward(u) and between
    // before_backward(u) and after_backward(u).
    virtual float* unit_params(int u) = 0;
    // Full gradient buffer of unit u (device), valid between before_backward(u) and after_backward(u);
    // backward kernels accumulate into it.
    virtual float* unit_grads(int u) = 0;

    // Hooks (see the order above). Default: nothing to do (a full replica on one process).
    virtual void begin_step(int num_micro_batches) { (void)num_micro_batches; }
    virtual void begin_micro_batch(int index) { (void)index; }
    // Start of a forward pass; `backward_follows` false for evaluation (forward only).
    virtual void begin_forward(bool backward_follows) { (void)backward_follows; }
    virtual void before_forward(int u) { (void)u; }
    virtual void after_forward(int u) { (void)u; }
    virtual void before_backward(int u) { (void)u; }
    virtual void after_backward(int u) { (void)u; }
    virtual void finish_backward() {}
    virtual void after_optimizer_step() {}

    // Zeroes the gradients this rank accumulates into.
    virtual void zero_grads() = 0;
    // The shards this rank's optimizer updates, one per unit.
    virtual std::vector<ShardView> owned_shards() = 0;
    // Sum of a host scalar over all ranks (loss sums), and of n host scalars in one collective.
    double all_reduce_sum(double x);
    void all_reduce_sum(double* x, int n);
    // Sum of squared gradients over the whole model from this rank's owned shards: summed over ranks when
    // shards partition the model, local when every rank owns a full replica (the default).
    virtual double global_grad_sq(double local_sq) { return local_sq; }
    // Checkpoints: the number of shard files that together hold the whole state, and which of them this
    // rank writes (-1: none, its state is a copy of another rank's). Default: a replica, rank 0 writes it.
    virtual int checkpoint_files() const { return 1; }
    virtual int checkpoint_file() const { return rank() == 0 ? 0 : -1; }
    // Waits until every rank reaches this point (checkpoint writing).
    void barrier();
    // Seconds this rank's compute thread spent blocked on collectives since the last call.
    double take_comm_wait_seconds();

    // Initialisation: copy a full unit's parameters from the host into this rank's storage (its shard).
    virtual void load_full_unit_params(int u, const float* host) = 0;
    // Called after parameters were written (load_full_unit_params for every unit, or a checkpoint load
    // through owned_shards()), so copies derived from them (FSDP's bf16 gather copy, CPU offload's device
    // copies) are refreshed. Default: nothing derived.
    virtual void params_loaded() {}

   protected:
    // Waits for a collective, counting the time blocked as communication wait.
    void wait(const CommHandle& handle);
    Communicator* world_;

   private:
    double comm_wait_s_ = 0.0;
};

// The single-process strategy: one replica owns full parameters, gradients and optimizer state
// (optimizer state offloaded to the host with offload.optimizer_state; offload.parameters is refused).
std::unique_ptr<Strategy> make_single_strategy(Backend* backend, const ParamLayout& layout,
                                               const CpuOffloadConfig& offload = {});

// How parameters and gradients travel (fsdp.precision): fp32; mixed (parameters rounded to bf16 and
// gathered as bf16, gradients reduced in fp32); pure (gradients reduced in bf16 too). Master parameters
// and AdamW moments stay fp32; compute stays fp32 on the CPU backend.
struct WirePrecision {
    bool bf16_params = false;
    bool bf16_reduce = false;
};

// DDP (also fsdp NO_SHARD, under `name`): full replicas, unit-bucketed async all-reduce of gradients,
// once per step or after every micro-batch.
std::unique_ptr<Strategy> make_ddp_strategy(Backend* backend, const ParamLayout& layout, Communicator* comm,
                                            bool sync_every_micro_batch, const std::string& name,
                                            WirePrecision precision = {}, const CpuOffloadConfig& offload = {});

struct FsdpOptions {
    std::vector<std::vector<int>> groups;   // FSDP units (fsdp_unit_groups): groups[0] is the root
    bool keep_params_for_step = false;      // SHARD_GRAD_OP: gathered units stay for the whole step
    bool reduce_every_micro_batch = false;  // grad_sync_mode micro_batch
    WirePrecision precision;
    bool forward_prefetch = true, backward_prefetch = true, limit_all_gathers = true;
    // In a world of one rank, compute on the shard in place (it is the whole unit): no gathered copy of
    // fp32 parameters (mixed/pure: one cast of the bf16 shard, no collective) and gradients accumulated
    // straight into the shard's (pure: still reduced, to keep its bf16 rounding), as the single strategy
    // does. Off only to exercise the gather machinery over a group of one (tests).
    bool in_place_when_alone = true;
    CpuOffloadConfig offload;  // cpu_offload: optimizer state, and the shards too, in host memory
};
// FSDP FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD: parameters, gradients and AdamW moments sharded evenly
// over `shard_group` (units padded), gathered around their compute, gradients reduce-scattered. `world`
// carries loss sums and barriers; `replica_group` (HYBRID_SHARD, else null) joins the ranks that hold the
// same shard, whose gradients are all-reduced once per step.
std::unique_ptr<Strategy> make_fsdp_strategy(Backend* backend, const ParamLayout& layout, Communicator* world,
                                             Communicator* shard_group, Communicator* replica_group,
                                             const FsdpOptions& options, const std::string& name);

}  // namespace trainer
