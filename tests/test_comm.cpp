// Multi-rank tests of the rendezvous store and the Gloo communicator: N ranks as threads of this process,
// each with its own store client and Gloo context over real TCP on loopback. Integer-valued data makes
// every collective exact in any reduction order (nccl-tests' "verifiable" data); odd sizes and world
// sizes 2, 3 and 4. Also: the rank environment of each launcher, and the errors for a rank that never
// joins, an unreachable store, and a peer that never issues a collective.
#include <atomic>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/element.h"
#include "parallel/comm/communicator.h"
#include "parallel/launch/rank_env.h"
#include "parallel/launch/tcp_store.h"
#include "rank_threads.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::run_ranks;

namespace {

// Small integers, different on each rank and element: sums stay exact in fp32 (and in bf16 below 256).
float value(int rank, size_t i, int modulus) {
    return static_cast<float>((rank * 7 + static_cast<int>(i) * 3) % modulus);
}

}  // namespace

TEST_CASE("comm: collectives are exact on integer data for odd sizes and 2 3 4 ranks") {
    for (int world : {2, 3, 4}) {
        run_ranks(world, [world](int rank, Communicator& comm) {
            RANK_EXPECT(comm.rank() == rank && comm.size() == world, "rank/size");
            for (size_t n : {size_t(1), size_t(7), size_t(1001), size_t(100003)}) {
                // all_reduce, fp32
                std::vector<float> x(n);
                for (size_t i = 0; i < n; ++i) x[i] = value(rank, i, 1000);
                comm.all_reduce(x.data(), n, CommDType::kFloat32).wait();
                for (size_t i = 0; i < n; ++i) {
                    float want = 0;
                    for (int r = 0; r < world; ++r) want += value(r, i, 1000);
                    RANK_EXPECT(!(x[i] != want), "all_reduce n=" << n << " [" << i << "] " << x[i] << " != " << want);
                }
                // reduce_scatter: every rank contributes world*n, keeps its n
                std::vector<float> in(n * world), out(n);
                for (size_t i = 0; i < in.size(); ++i) in[i] = value(rank, i, 500);
                comm.reduce_scatter(in.data(), out.data(), n, CommDType::kFloat32).wait();
                for (size_t i = 0; i < n; ++i) {
                    float want = 0;
                    for (int r = 0; r < world; ++r) want += value(r, rank * n + i, 500);
                    RANK_EXPECT(!(out[i] != want),
                                "reduce_scatter n=" << n << " [" << i << "] " << out[i] << " != " << want);
                }
                // all_gather
                std::vector<float> mine(n), all(n * world);
                for (size_t i = 0; i < n; ++i) mine[i] = value(rank, i, 999);
                comm.all_gather(mine.data(), all.data(), n, CommDType::kFloat32).wait();
                for (int r = 0; r < world; ++r) {
                    for (size_t i = 0; i < n; ++i) {
                        RANK_EXPECT(all[r * n + i] == value(r, i, 999),
                                    "all_gather n=" << n << " rank " << r << " [" << i << "]");
                    }
                }
                // broadcast from the last rank
                std::vector<float> b(n);
                for (size_t i = 0; i < n; ++i) b[i] = value(rank, i, 77);
                comm.broadcast(b.data(), n, CommDType::kFloat32, world - 1).wait();
                for (size_t i = 0; i < n; ++i) {
                    RANK_EXPECT(!(b[i] != value(world - 1, i, 77)), "broadcast n=" << n << " [" << i << "]");
                }
            }
            comm.barrier().wait();
        });
    }
}

TEST_CASE("comm: bf16 collectives carry bf16 words and sum exactly below 256") {
    run_ranks(3, [](int rank, Communicator& comm) {
        const size_t n = 1003;
        std::vector<uint16_t> x(n), in(3 * n), out(n), all(3 * n);
        for (size_t i = 0; i < n; ++i) x[i] = float_to_bf16(value(rank, i, 80));
        comm.all_reduce(x.data(), n, CommDType::kBFloat16).wait();
        for (size_t i = 0; i < 3 * n; ++i) in[i] = float_to_bf16(value(rank, i, 60));
        comm.reduce_scatter(in.data(), out.data(), n, CommDType::kBFloat16).wait();
        comm.all_gather(x.data(), all.data(), n, CommDType::kBFloat16).wait();
        for (size_t i = 0; i < n; ++i) {
            float want = 0, want_rs = 0;
            for (int r = 0; r < 3; ++r) want += value(r, i, 80), want_rs += value(r, rank * n + i, 60);
            RANK_EXPECT(bf16_to_float(x[i]) == want, "bf16 all_reduce [" << i << "]");
            RANK_EXPECT(bf16_to_float(out[i]) == want_rs, "bf16 reduce_scatter [" << i << "]");
            RANK_EXPECT(all[2 * n + i] == x[i], "bf16 all_gather [" << i << "]");
        }
    });
}

TEST_CASE("comm: operations queued without waiting run in issue order") {
    run_ranks(2, [](int rank, Communicator& comm) {
        const size_t n = 513;
        std::vector<std::vector<float>> bufs(20, std::vector<float>(n));
        std::vector<CommHandle> handles;
        for (size_t k = 0; k < bufs.size(); ++k) {
            for (size_t i = 0; i < n; ++i) bufs[k][i] = static_cast<float>(k * 10 + rank);
            handles.push_back(comm.all_reduce(bufs[k].data(), n, CommDType::kFloat32));
        }
        for (auto& h : handles) h.wait();
        for (size_t k = 0; k < bufs.size(); ++k) {
            RANK_EXPECT(bufs[k][n - 1] == static_cast<float>(2 * k * 10 + 1), "queued all_reduce " << k);
        }
    });
}

TEST_CASE("comm: a rank that never joins gives a clear rendezvous timeout") {
    TcpStoreServer server(0, test_util::kStoreSecret);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {  // rank 2 of 3 never comes
        threads.emplace_back([&, r] {
            try {
                TcpStore store("127.0.0.1", server.port(), std::chrono::milliseconds(800), test_util::kStoreSecret);
                make_gloo_communicator(store, "lonely", r, 3, std::chrono::milliseconds(800));
            } catch (const UserError& e) {
                errors[r] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (const auto& e : errors) CHECK_THAT(e, Contains("rank(s) 2 of 3 never arrived") && Contains("127.0.0.1:"));
}

TEST_CASE("comm: an unreachable store and a missing collective peer end in clear errors") {
    int unused_port = 0;
    {
        TcpStoreServer probe(0, test_util::kStoreSecret);
        unused_port = probe.port();
    }
    REQUIRE_THROWS_WITH(TcpStore("127.0.0.1", unused_port, std::chrono::milliseconds(300), test_util::kStoreSecret),
                        Contains("could not reach 127.0.0.1:" + std::to_string(unused_port)));
    // Rank 0 never issues the all_reduce that rank 1 waits for.
    std::string error;
    run_ranks(
        2,
        [&](int rank, Communicator& comm) {
            if (rank == 0) {
                std::this_thread::sleep_for(std::chrono::milliseconds(2500));
                return;
            }
            std::vector<float> x(100, 1.0f);
            try {
                comm.all_reduce(x.data(), x.size(), CommDType::kFloat32).wait();
            } catch (const UserError& e) {
                error = e.what();
            }
        },
        std::chrono::milliseconds(1000));
    CHECK_THAT(error, Contains("all_reduce #1 of group test failed on rank 1/2"));
}

TEST_CASE("comm: rank environment of each launcher") {
    auto env = [](std::map<std::string, std::string> vars) {
        return [vars](const char* name) -> const char* {
            auto it = vars.find(name);
            return it == vars.end() ? nullptr : it->second.c_str();
        };
    };
    RankEnv e = detect_rank_env(env({}));
    CHECK(e.world_size == 1);
    CHECK(e.launcher == "none");
    e = detect_rank_env(env({{"RANK", "3"},
                             {"WORLD_SIZE", "4"},
                             {"LOCAL_RANK", "1"},
                             {"LOCAL_WORLD_SIZE", "2"},
                             {"MASTER_ADDR", "10.1.2.3"},
                             {"MASTER_PORT", "29600"}}));
    CHECK(e.rank == 3);
    CHECK(e.node_rank() == 1);
    CHECK(e.num_nodes() == 2);
    CHECK(e.master_addr == "10.1.2.3");
    CHECK(e.master_port == 29600);
    e = detect_rank_env(env({{"OMPI_COMM_WORLD_RANK", "1"},
                             {"OMPI_COMM_WORLD_SIZE", "2"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
    CHECK(e.launcher == "mpirun");
    CHECK(e.master_addr == "127.0.0.1");
    e = detect_rank_env(env({{"SLURM_PROCID", "5"},
                             {"SLURM_NTASKS", "8"},
                             {"SLURM_LOCALID", "1"},
                             {"SLURM_TASKS_PER_NODE", "4(x2)"},
                             {"SLURM_JOB_NODELIST", "gpu[07-08]"}}));
    CHECK(e.launcher == "slurm");
    CHECK(e.local_world_size == 4);
    CHECK(e.master_addr == "gpu07");
    REQUIRE_THROWS_WITH(detect_rank_env(env({{"RANK", "4"}, {"WORLD_SIZE", "4"}})), Contains("rank 4 is not below"));
    REQUIRE_THROWS_WITH(detect_rank_env(env({{"RANK", "x"}, {"WORLD_SIZE", "4"}})), Contains("RANK=\"x\""));
    REQUIRE_THROWS_WITH(detect_rank_env(env({{"OMPI_COMM_WORLD_RANK", "0"},
                                             {"OMPI_COMM_WORLD_SIZE", "4"},
                                             {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})),
                        Contains("MASTER_ADDR is not set"));
}

TEST_CASE("comm: a group of one copies through the backend and a handle's waiter runs on wait") {
    // The local communicator moves device memory through the backend (the CPU backend here; the CUDA
    // backend's copies on a GPU), and host memory by memmove without one.
    auto backend = make_backend(Device::kCpu);
    for (Backend* b : {backend.get(), static_cast<Backend*>(nullptr)}) {
        auto comm = make_local_communicator(b);
        REQUIRE(comm->size() == 1);
        std::vector<float> in = {1.5f, -2.0f, 3.25f}, out(3, 0.0f);
        comm->reduce_scatter(in.data(), out.data(), 3, CommDType::kFloat32).wait();
        CHECK(out == in);
        std::vector<double> gathered(2, 0.0), mine = {7.0, 8.0};
        comm->all_gather(mine.data(), gathered.data(), 2, CommDType::kFloat64).wait();
        CHECK(gathered == mine);
    }
    // An NCCL-style handle: wait() runs the waiter (each time) and lets its error through.
    int calls = 0;
    CommHandle h(std::function<void()>([&] { ++calls; }));
    h.wait();
    h.wait();
    CHECK(calls == 2);
    CommHandle bad(std::function<void()>([] { user_error("collective failed on rank 1/2"); }));
    CHECK_THROWS_WITH(bad.wait(), Contains("collective failed on rank 1/2"));
}
