// The staged communicator (parallel/comm_stream.h: Gloo on a GPU's buffers through pinned host memory) on
// an emulated device whose streams are host threads (emulated_stream.h), over real Gloo between rank threads:
// the same code a GPU run uses, with only the device calls emulated. Integer-valued data keeps every sum exact.
// Also which ranks share a GPU (parallel/setup.h's ranks_on_gpu).
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "base/common.h"
#include "emulated_stream.h"
#include "kernels/element.h"
#include "parallel/comm/comm_stream.h"
#include "parallel/comm/communicator.h"
#include "parallel/launch/rank_env.h"
#include "parallel/launch/tcp_store.h"
#include "parallel/setup.h"
#include "rank_threads.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::EmulatedCommStream;
using test_util::EmulatedDevice;

namespace {

float value(int rank, size_t i) { return static_cast<float>((rank * 5 + static_cast<int>(i) * 3) % 101); }

// Runs fn(rank, device, comm) on `world` rank threads, each with its own emulated device and a staged
// communicator over Gloo on loopback; rethrows the first failure. The device outlives the communicator.
void run_staged_ranks(int world, std::chrono::milliseconds timeout,
                      const std::function<void(int, EmulatedDevice&, Communicator&)>& fn) {
    test_util::run_rank_threads(world, timeout, [&](int r, TcpStore& store) {
        EmulatedDevice device;
        {
            auto comm = make_staged_communicator(make_gloo_communicator(store, "staged", r, world, timeout),
                                                 std::make_unique<EmulatedCommStream>(device), "Gloo", timeout);
            fn(r, device, *comm);
        }
        RANK_EXPECT(device.pinned_live == 0, "the staging buffer outlived its communicator");
    });
}

}  // namespace

TEST_CASE("staged comm: collectives on device buffers follow the compute before them and each other on 2 and 3 ranks") {
    for (int world : {2, 3}) {
        CAPTURE(world);
        run_staged_ranks(world, std::chrono::seconds(20), [world](int rank, EmulatedDevice& dev, Communicator& comm) {
            RANK_EXPECT(comm.rank() == rank && comm.size() == world, "rank/size");
            // Slow copies: every collective below is issued while the ones before it are still in flight.
            dev.copy_delay = std::chrono::milliseconds(2);
            const size_t n = 1001;
            std::vector<float> x(n, -1.0f), rs_in(n * world), rs_out(n), mine(n), all(n * world), b(n), result(n);
            for (auto* v : {&x, &rs_in, &rs_out, &mine, &all, &b, &result})
                dev.register_memory(v->data(), v->size() * sizeof(float));
            // A slow kernel writes x: the first collective must copy x only after it.
            dev.launch([&] {
                std::this_thread::sleep_for(std::chrono::milliseconds(20));
                for (size_t i = 0; i < n; ++i) x[i] = value(rank, i);
            });
            for (size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = value(rank + 1, i);
            for (size_t i = 0; i < n; ++i) mine[i] = value(rank + 2, i), b[i] = value(rank, i + 7);
            // Issued back to back, nothing waited for: the second all-reduce of x reduces the first's result
            // (stream order, as NCCL's collectives on one communicator); a host-buffer collective between them
            // keeps its place in the order.
            CommHandle h1 = comm.all_reduce(x.data(), n, CommDType::kFloat32);
            std::vector<double> host_scalar = {static_cast<double>(rank + 1)};
            CommHandle hh = comm.all_reduce(host_scalar.data(), 1, CommDType::kFloat64);
            CommHandle h2 = comm.all_reduce(x.data(), n, CommDType::kFloat32);
            CommHandle h3 = comm.reduce_scatter(rs_in.data(), rs_out.data(), n, CommDType::kFloat32);
            CommHandle h4 = comm.all_gather(mine.data(), all.data(), n, CommDType::kFloat32);
            CommHandle h5 = comm.broadcast(b.data(), n, CommDType::kFloat32, world - 1);
            hh.wait();  // a host buffer: complete when wait returns
            RANK_EXPECT(host_scalar[0] == world * (world + 1) / 2.0, "host all_reduce " << host_scalar[0]);
            for (const CommHandle* h : {&h1, &h2, &h3, &h4, &h5}) h->wait();
            // After the waits, the compute stream's next kernel sees every result.
            dev.launch([&] { result = x; });
            dev.compute.synchronize();
            for (size_t i = 0; i < n; ++i) {
                float once = 0;
                for (int r = 0; r < world; ++r) once += value(r, i);
                RANK_EXPECT(result[i] == world * once, "all_reduce twice [" << i << "] " << result[i]);
                float rs = 0;
                for (int r = 0; r < world; ++r) rs += value(r + 1, rank * n + i);
                RANK_EXPECT(rs_out[i] == rs, "reduce_scatter [" << i << "] " << rs_out[i] << " != " << rs);
                RANK_EXPECT(b[i] == value(world - 1, i + 7), "broadcast [" << i << "]");
                for (int r = 0; r < world; ++r)
                    RANK_EXPECT(all[r * n + i] == value(r + 2, i), "all_gather rank " << r << " [" << i << "]");
            }
            // Each staged collective copied down and up once; the compute stream waited on each; the host one
            // was not staged. The staging buffer grew to the largest operation (the all-gather's input and
            // output), no further.
            RANK_EXPECT(dev.copies_down == 5 && dev.copies_up == 5,
                        "copies " << dev.copies_down << " " << dev.copies_up);
            RANK_EXPECT(dev.compute_waits == 5, "compute waits " << dev.compute_waits);
            RANK_EXPECT(dev.pinned_live == static_cast<long>(n * (world + 1) * sizeof(float)),
                        "staging bytes " << dev.pinned_live);
            comm.barrier().wait();
        });
    }
}

TEST_CASE("staged comm: bf16 sums and an in-place reduce-scatter on 4 ranks") {
    run_staged_ranks(4, std::chrono::seconds(20), [](int rank, EmulatedDevice& dev, Communicator& comm) {
        const size_t n = 257;
        std::vector<uint16_t> g(n * 4);
        dev.register_memory(g.data(), g.size() * 2);
        for (size_t i = 0; i < g.size(); ++i) g[i] = float_to_bf16(std::fmod(value(rank, i), 16.0f));
        // In place: the output is this rank's own block of the input, as FSDP reduces a gradient.
        uint16_t* own = g.data() + static_cast<size_t>(rank) * n;
        comm.reduce_scatter(g.data(), own, n, CommDType::kBFloat16).wait();
        dev.compute.synchronize();
        for (size_t i = 0; i < n; ++i) {
            float want = 0;
            for (int r = 0; r < 4; ++r) want += std::fmod(value(r, rank * n + i), 16.0f);  // integers below 64: exact
            RANK_EXPECT(bf16_to_float(own[i]) == want, "bf16 reduce_scatter [" << i << "] " << bf16_to_float(own[i]));
        }
    });
}

TEST_CASE("staged comm: a device error ends the collective naming it and the ones after it") {
    EmulatedDevice dev;
    std::vector<float> x(16, 1.0f);
    dev.register_memory(x.data(), x.size() * sizeof(float));
    auto comm = make_staged_communicator(make_local_communicator(), std::make_unique<EmulatedCommStream>(dev), "Gloo",
                                         std::chrono::seconds(5));
    comm->all_reduce(x.data(), x.size(), CommDType::kFloat32).wait();  // fine
    dev.error = "an illegal memory access was encountered";
    CommHandle failed = comm->all_gather(x.data(), x.data(), 4, CommDType::kFloat32);
    CommHandle after = comm->all_reduce(x.data(), x.size(), CommDType::kFloat32);
    CHECK_THROWS_WITH(failed.wait(), Contains("Gloo all_gather on rank 0/1 failed: the device reported an illegal"));
    CHECK_THROWS_WITH(after.wait(), Contains("Gloo all_reduce on rank 0/1: not run, the communicator stopped"));
    dev.error.clear();
}

TEST_CASE("staged comm: a peer that never issues the collective ends the wait naming it and the rank") {
    TcpStoreServer server(0, test_util::kStoreSecret);
    const auto timeout = std::chrono::milliseconds(1500);
    std::atomic<bool> done{false};
    std::string error;
    std::thread silent([&] {
        TcpStore store("127.0.0.1", server.port(), timeout, test_util::kStoreSecret);
        auto comm = make_gloo_communicator(store, "staged", 1, 2, timeout);
        while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    });
    {
        EmulatedDevice dev;
        std::vector<float> x(8, 1.0f);
        dev.register_memory(x.data(), x.size() * sizeof(float));
        TcpStore store("127.0.0.1", server.port(), timeout, test_util::kStoreSecret);
        auto comm = make_staged_communicator(make_gloo_communicator(store, "staged", 0, 2, timeout),
                                             std::make_unique<EmulatedCommStream>(dev), "Gloo", timeout);
        try {
            comm->all_reduce(x.data(), x.size(), CommDType::kFloat32).wait();
        } catch (const UserError& e) {
            error = e.what();
        }
        done = true;
    }
    silent.join();
    CHECK_THAT(error, Contains("all_reduce #1 of group staged failed on rank 0/2"));
}

TEST_CASE("ranks_on_gpu: a node's ranks by LOCAL_RANK modulo the GPUs but one where CUDA_VISIBLE_DEVICES binds them") {
    ::unsetenv("CUDA_VISIBLE_DEVICES");
    RankEnv env;
    env.world_size = env.local_world_size = 4;
    CHECK(ranks_on_gpu(env, 1, 0) == 4);
    CHECK(ranks_on_gpu(env, 2, 0) == 2);
    CHECK(ranks_on_gpu(env, 2, 1) == 2);
    CHECK(ranks_on_gpu(env, 3, 0) == 2);
    CHECK(ranks_on_gpu(env, 3, 2) == 1);
    CHECK(ranks_on_gpu(env, 8, 0) == 1);
    ::setenv("CUDA_VISIBLE_DEVICES", "3", 1);  // a scheduler's binding: each rank its own view
    CHECK(ranks_on_gpu(env, 1, 0) == 1);
    ::unsetenv("CUDA_VISIBLE_DEVICES");
}
