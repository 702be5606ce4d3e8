// The Communicator seam: collectives on contiguous buffers across the ranks of a group.
//
// Every operation is asynchronous: it is queued and returns a handle to wait on. Operations run in the
// order they were issued (one FIFO per communicator), so every rank, issuing the same sequence, runs the
// same collective at the same time. Each has the communicator's timeout; a timeout or a dead peer makes
// wait() throw a UserError naming the operation and `rank r/W`. Reductions are sums. Buffers are host
// memory for the Gloo communicator; device memory for NCCL (host buffers too, staged through the device
// synchronously) and for Gloo on a GPU (staged through pinned host memory, comm_stream.h; host buffers too,
// unstaged); they must stay valid until wait().
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>

#include "base/common.h"

namespace trainer {

class TcpStore;
class Backend;

enum class CommDType { kFloat32, kBFloat16, kFloat64 };
size_t comm_dtype_size(CommDType t);

// A queued collective. wait() returns once the result may be used by what the caller does next and
// rethrows the collective's error: on the host communicators (Gloo) it blocks until the collective is
// done; on NCCL it orders the compute stream after the collective (the host does not block); on staged Gloo
// it blocks until Gloo is done and orders the compute stream after the copy back.
class CommHandle {
   public:
    CommHandle() = default;
    explicit CommHandle(std::shared_future<void> f) : f_(std::move(f)) {}
    explicit CommHandle(std::function<void()> waiter) : waiter_(std::move(waiter)) {}
    void wait() const {
        if (f_.valid()) f_.get();
        if (waiter_) waiter_();
    }
    // wait(), adding the seconds spent blocked to *waited (a strategy's communication-wait metric).
    void wait(double* waited) const {
        const auto t0 = std::chrono::steady_clock::now();
        wait();
        *waited += seconds_since(t0);
    }

   private:
    std::shared_future<void> f_;
    std::function<void()> waiter_;
};

class Communicator {
   public:
    virtual ~Communicator() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;

    // buf[count] = sum over ranks of buf[count] (in place).
    virtual CommHandle all_reduce(void* buf, size_t count, CommDType dtype) = 0;
    // out[count] = sum over ranks of in[rank * count .. (rank + 1) * count); `in` holds size() * count.
    // `in` may be modified (used as scratch); `out` may be `in`'s own block, in + rank() * count (in place).
    virtual CommHandle reduce_scatter(void* in, void* out, size_t count, CommDType dtype) = 0;
    // out[size() * count] = the concatenation of every rank's in[count], in rank order.
    virtual CommHandle all_gather(const void* in, void* out, size_t count, CommDType dtype) = 0;
    // buf[count] = root's buf[count].
    virtual CommHandle broadcast(void* buf, size_t count, CommDType dtype, int root) = 0;
    virtual CommHandle barrier() = 0;
};

// The communicator of a group of one (a single process): every collective completes at once. Copies go
// through `backend` (device memory) when given, else memmove (host memory).
std::unique_ptr<Communicator> make_local_communicator(Backend* backend = nullptr);

// Bytes of the receive buffer the Gloo communicator's reduce-scatter ring needs for a shard of `count`
// elements over `size` ranks (it keeps one, grown to the largest call, counted as communication memory).
inline size_t gloo_reduce_scatter_scratch_bytes(size_t count, CommDType dtype, int size) {
    return size > 1 ? count * comm_dtype_size(dtype) : 0;
}

// One collective of a dry run, reported when it is issued and again when the caller waits for it: its kind
// ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"), the bytes each rank contributes
// (a reduce-scatter's or all-gather's shard, an all-reduce's buffer), the group's size, a number unique in
// the process, and the communicator (collectives of one communicator run in issue order).
struct CollectiveCall {
    const char* kind;
    size_t bytes;
    int group_size;
    uint64_t id;
    const void* channel;
    bool spans_nodes;  // the group has ranks on more than one node
    // Spanning nodes: the groups like this one that run at once on this node (its ranks over the group's ranks a
    // node), each sending across the node's links: 1 for a group of every rank, a node's ranks for HYBRID_SHARD's
    // replica groups of one rank a node.
    int node_flows;
    bool wait;  // false: issued; true: waited for
};
// A communicator that moves nothing (dry runs, core/plan/dry_run.h): rank `rank` of `size`, every collective
// complete at once and reported to `observer` (when set) at its issue and at each wait. With `gloo_scratch`
// it takes the Gloo communicator's reduce-scatter buffer as that does, so the memory accounting sees what a
// Gloo run counts.
std::unique_ptr<Communicator> make_dry_communicator(int rank, int size, bool gloo_scratch, bool spans_nodes,
                                                    int node_flows = 1,
                                                    std::function<void(const CollectiveCall&)> observer = {});

// A Gloo communicator over TCP for `size` ranks, connected through `store` with keys under `prefix`
// (distinct prefixes give independent groups, e.g. node-local and cross-node sub-communicators).
// `timeout` bounds the connection and every operation. `bind_host` is the address this rank's Gloo pairs
// listen on and advertise to the others: loopback on one node, a routable name or address across nodes.
std::unique_ptr<Communicator> make_gloo_communicator(TcpStore& store, const std::string& prefix, int rank, int size,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& bind_host = "127.0.0.1");

// An NCCL communicator for `size` ranks on the GPU of the CUDA `backend`: rank 0's unique id travels
// through `store` under `prefix`; collectives run on a communication stream ordered after the backend's
// compute stream by events. A watchdog aborts the communicator and ends the process (naming the
// operation and the rank) when an operation outlasts `timeout` or NCCL reports an asynchronous error, so
// a dead rank never hangs the others. Refuses in a build without CUDA.
std::unique_ptr<Communicator> make_nccl_communicator(TcpStore& store, const std::string& prefix, int rank, int size,
                                                     std::chrono::milliseconds timeout, Backend* backend);
// "NCCL: built with X; loaded Y", or that this build has none (trainer --version).
std::string nccl_library_version();

}  // namespace trainer
