// The step's named exchange between ranks (core/run/exchange.h): slots laid out by name in reservation order, this
// rank's values summed with every rank's in one all-reduce over real Gloo ranks, and ranks whose layouts differ
// stopped with the layout named.
#include <string>
#include <vector>

#include "base/common.h"
#include "core/run/exchange.h"
#include "rank_threads.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;

namespace {

// One all-reduce over Gloo, as the strategy's all_reduce_sum does it (float64, in place).
void sum_over(Communicator& comm, RankExchange& ex, int world) {
    ex.sum([&](double* v, int n) { comm.all_reduce(v, n, CommDType::kFloat64).wait(); }, world);
}

}  // namespace

TEST_CASE("exchange: slots are laid out by name in reservation order and refused when reserved twice or not at all") {
    RankExchange ex;
    const RankExchange::Slot loss = ex.reserve("loss", 3), votes = ex.reserve("stop_votes", 3);
    const RankExchange::Slot compute = ex.reserve("compute_per_rank", 4);
    CHECK(loss.offset == 0);
    CHECK(votes.offset == 3);
    CHECK(compute.offset == 6);
    CHECK(ex.size() == 10);
    CHECK(ex.layout() == "loss[3] stop_votes[3] compute_per_rank[4]");
    ex.at(votes)[2] = 5.0;
    CHECK(ex.at(votes)[2] == 5.0);
    CHECK(ex.at(loss)[0] == 0.0);  // reserved slots start at zero
    REQUIRE_THROWS_WITH(ex.reserve("loss", 1), Contains("exchange slot loss reserved twice"));
    REQUIRE_THROWS_WITH(ex.at(RankExchange::Slot{}), Contains("not reserved"));
    ex.clear();
    CHECK(ex.size() == 0);
    REQUIRE_THROWS_WITH(ex.value(loss), Contains("not reserved"));  // a slot of the exchange before
}

TEST_CASE("exchange: every rank reads the sums of every slot after one all-reduce over 3 ranks") {
    const int world = 3;
    test_util::run_ranks(world, [&](int rank, Communicator& comm) {
        RankExchange ex;
        const auto loss = ex.reserve("loss", 2);
        const auto votes = ex.reserve("stop_votes", 3);
        const auto per_rank = ex.reserve("compute_per_rank", world);
        ex.at(loss)[0] = 1.5 * (rank + 1);
        ex.at(loss)[1] = 10.0;
        ex.at(votes)[rank] = 1.0;
        ex.at(per_rank)[rank] = 100.0 + rank;  // each rank fills its own slot: the sum is every rank's value
        sum_over(comm, ex, world);
        RANK_EXPECT(ex.at(loss)[0] == 9.0 && ex.at(loss)[1] == 30.0, "loss " << ex.at(loss)[0]);
        for (int k = 0; k < world; ++k) {
            RANK_EXPECT(ex.at(votes)[k] == 1.0, "vote " << k << " " << ex.at(votes)[k]);
            RANK_EXPECT(ex.at(per_rank)[k] == 100.0 + k, "rank " << k << " " << ex.at(per_rank)[k]);
        }
        RANK_EXPECT(ex.size() == 2 + 3 + world, "the fingerprint stays out of the slots: " << ex.size());
    });
}

TEST_CASE("exchange: ranks that reserved their slots in another order are stopped with the layout named") {
    const int world = 2;
    std::vector<std::string> errors(world);
    test_util::run_ranks(world, [&](int rank, Communicator& comm) {
        RankExchange ex;
        if (rank == 0) {
            ex.reserve("loss", 1), ex.reserve("stop_votes", 3);
        } else {
            ex.reserve("stop_votes", 3), ex.reserve("loss", 1);
        }
        try {
            sum_over(comm, ex, world);
        } catch (const InternalError& e) {
            errors[rank] = e.what();
        }
    });
    CHECK_THAT(errors[0], Contains("the ranks' step exchanges differ: this rank's is loss[1] stop_votes[3]"));
    CHECK_THAT(errors[1], Contains("this rank's is stop_votes[3] loss[1]"));
}
