// Multi-rank tests in one process: N ranks as threads, each with its own store client and Gloo communicator
// over real TCP on loopback.
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "parallel/comm/communicator.h"
#include "parallel/launch/tcp_store.h"
#include "test_util.h"

namespace test_util {

// Runs fn(rank, store) on `world` threads, each with its own client of one store; rethrows the first failure.
inline void run_rank_threads(int world, std::chrono::milliseconds timeout,
                             const std::function<void(int, trainer::TcpStore&)>& fn) {
    trainer::TcpStoreServer server(0, kStoreSecret);
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(world);
    std::atomic<int> completed{0};
    for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
            try {
                trainer::TcpStore store("127.0.0.1", server.port(), timeout, kStoreSecret);
                fn(r, store);
                ++completed;
            } catch (...) {
                errors[r] = std::current_exception();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
        if (e) std::rethrow_exception(e);
    }
    REQUIRE(completed == world);  // every rank ran its checks to the end
}

// Runs fn(rank, comm) on `world` threads joined through one store, each with a Gloo communicator.
inline void run_ranks(int world, const std::function<void(int, trainer::Communicator&)>& fn,
                      std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    run_rank_threads(world, timeout, [&](int r, trainer::TcpStore& store) {
        auto comm = trainer::make_gloo_communicator(store, "test", r, world, timeout);
        fn(r, *comm);
    });
}

// Catch2's assertions are not thread-safe: rank threads report mismatches by throwing, and run_ranks
// rethrows the first one on the test's thread.
#define RANK_EXPECT(cond, msg)                   \
    do {                                         \
        if (!(cond)) {                           \
            std::ostringstream os_;              \
            os_ << msg;                          \
            throw std::runtime_error(os_.str()); \
        }                                        \
    } while (0)

}  // namespace test_util
