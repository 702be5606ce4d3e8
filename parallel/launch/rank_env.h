// The rank environment: which process this is among how many, on which node, and where rank 0 hosts the
// rendezvous store. Read from whichever launcher started the process, so rank discovery never depends on
// one launcher (OLMo #641):
//   trainer launch / torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   mpirun (OpenMPI):          OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} (+ MASTER_ADDR/PORT)
//   Slurm (srun):              SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE / the
//                              node list (+ MASTER_ADDR/PORT, defaulting to the first node of the job)
//   none of these:             one process, rank 0 of 1
#pragma once

#include <functional>
#include <string>

namespace trainer {

struct RankEnv {
    int rank = 0;
    int world_size = 1;
    int local_rank = 0;
    int local_world_size = 1;
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
    std::string launcher = "none";  // "trainer launch", "mpirun", "slurm" or "none"
    // Set by `trainer launch --max-restarts`: its node 0 hosts the store at MASTER_ADDR:MASTER_PORT
    // (TRAINER_AGENT_STORE=1, so rank 0 is a client like the others), the ranks of each restart round meet there
    // under their own key prefix (TRAINER_STORE_PREFIX), and TRAINER_RESTART_COUNT counts the restarts so far.
    bool agent_store = false;
    std::string store_prefix;
    int restart_count = 0;
    // The job's rendezvous secret (TRAINER_STORE_SECRET or the file TRAINER_STORE_SECRET_FILE names; see
    // parallel/store_secret.h), "" where neither is set. Never printed.
    std::string store_secret;

    int node_rank() const { return rank / local_world_size; }
    int num_nodes() const { return world_size / local_world_size; }
};

// Reads the rank environment through `getenv` (injectable for tests). Inconsistent or malformed values
// are a UserError naming the variable, its value and what is expected.
RankEnv detect_rank_env(const std::function<const char*(const char*)>& getenv);
RankEnv detect_rank_env();
// This machine's host name (gethostname), or "" when it cannot be read.
std::string host_name();

// Rank 0 alone writes to stdout (what a run or a benchmark reports); the other ranks' stdout goes to /dev/null.
// Errors still reach stderr from every rank.
void silence_stdout_unless_rank0(const RankEnv& env);

}  // namespace trainer
