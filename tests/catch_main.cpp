// The one Catch2 main of the unit tests (compiled once; the test files only include catch.hpp).
//
// Every process a test starts (trainer launch on several nodes, mpirun, Slurm environments, ranks by hand) belongs
// to a job whose rendezvous secret is TRAINER_STORE_SECRET (parallel/store_secret.h), set here for the whole
// process unless the caller set one; the cases on a missing, empty or wrong secret unset or change it for their
// own commands.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdlib>

int main(int argc, char* argv[]) {
    ::setenv("TRAINER_STORE_SECRET", "unit-tests-job-secret", 0);
    return Catch::Session().run(argc, argv);
}
