// What every strategy does over the world communicator (see strategy.h).
#include "parallel/strategy/strategy.h"

#include <utility>

#include "base/trace.h"
#include "parallel/comm/communicator.h"

namespace trainer {

int Strategy::rank() const { return world_->rank(); }
int Strategy::world_size() const { return world_->size(); }

double Strategy::all_reduce_sum(double x) {
    all_reduce_sum(&x, 1);
    return x;
}

void Strategy::all_reduce_sum(double* x, int n) { wait(world_->all_reduce(x, n, CommDType::kFloat64)); }

void Strategy::barrier() { wait(world_->barrier()); }

double Strategy::take_comm_wait_seconds() { return std::exchange(comm_wait_s_, 0.0); }

void Strategy::wait(const CommHandle& handle) {
    trace::Span span("wait", "wait");
    handle.wait(&comm_wait_s_);
}

}  // namespace trainer
