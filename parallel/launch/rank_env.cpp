// Rank discovery from the launcher's environment (see rank_env.h).
#include "parallel/launch/rank_env.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/common.h"
#include "parallel/launch/store_secret.h"

namespace trainer {
namespace {

using Getenv = std::function<const char*(const char*)>;

int env_int(const Getenv& getenv, const char* name, int min_value) {
    const char* v = getenv(name);
    if (!v) user_error("rank environment: {} is not set", name);
    errno = 0;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || errno != 0 || x < min_value || x > 1 << 24) {
        user_error("rank environment: {}=\"{}\"; expected an integer >= {}", name, v, min_value);
    }
    return static_cast<int>(x);
}

// Slurm's compressed task counts: "4", "2(x3)", "2(x3),1" -> tasks on the first node.
int slurm_tasks_on_first_node(const std::string& s) {
    const long n = std::strtol(s.c_str(), nullptr, 10);
    return n > 0 ? static_cast<int>(n) : 0;
}

// First host of a Slurm node list: "node[03-05,07],gpu1" -> "node03".
std::string slurm_first_node(const std::string& list) {
    const size_t comma = list.find(',');
    const size_t bracket = list.find('[');
    if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket)) {
        return list.substr(0, comma);
    }
    const std::string prefix = list.substr(0, bracket);
    size_t end = bracket + 1;
    while (end < list.size() && list[end] != '-' && list[end] != ',' && list[end] != ']') ++end;
    return prefix + list.substr(bracket + 1, end - bracket - 1);
}

}  // namespace

RankEnv detect_rank_env(const Getenv& getenv) {
    RankEnv e;
    e.store_secret = store_secret_from_env(getenv).value_or("");
    if (getenv("RANK") && getenv("WORLD_SIZE")) {
        e.launcher = "trainer launch";
        e.rank = env_int(getenv, "RANK", 0);
        e.world_size = env_int(getenv, "WORLD_SIZE", 1);
        e.local_rank = getenv("LOCAL_RANK") ? env_int(getenv, "LOCAL_RANK", 0) : e.rank;
        e.local_world_size = getenv("LOCAL_WORLD_SIZE") ? env_int(getenv, "LOCAL_WORLD_SIZE", 1) : e.world_size;
        if (const char* agent = getenv("TRAINER_AGENT_STORE")) {
            if (std::string(agent) != "0" && std::string(agent) != "1")
                user_error("rank environment: TRAINER_AGENT_STORE=\"{}\"; expected 0 or 1", agent);
            e.agent_store = std::string(agent) == "1";
        }
        if (const char* prefix = getenv("TRAINER_STORE_PREFIX")) e.store_prefix = prefix;
        if (getenv("TRAINER_RESTART_COUNT")) e.restart_count = env_int(getenv, "TRAINER_RESTART_COUNT", 0);
    } else if (getenv("OMPI_COMM_WORLD_RANK")) {
        e.launcher = "mpirun";
        e.rank = env_int(getenv, "OMPI_COMM_WORLD_RANK", 0);
        e.world_size = env_int(getenv, "OMPI_COMM_WORLD_SIZE", 1);
        e.local_rank = env_int(getenv, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
        e.local_world_size = env_int(getenv, "OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    } else if (getenv("SLURM_PROCID") && getenv("SLURM_NTASKS")) {
        e.launcher = "slurm";
        e.rank = env_int(getenv, "SLURM_PROCID", 0);
        e.world_size = env_int(getenv, "SLURM_NTASKS", 1);
        e.local_rank = getenv("SLURM_LOCALID") ? env_int(getenv, "SLURM_LOCALID", 0) : 0;
        const char* per_node = getenv("SLURM_NTASKS_PER_NODE");
        if (!per_node) per_node = getenv("SLURM_TASKS_PER_NODE");
        e.local_world_size = per_node ? slurm_tasks_on_first_node(per_node) : e.world_size;
        if (e.local_world_size <= 0) {
            user_error("rank environment: SLURM_TASKS_PER_NODE=\"{}\"; expected a task count like 4 or 4(x2)",
                       per_node);
        }
        if (!getenv("MASTER_ADDR") && getenv("SLURM_JOB_NODELIST")) {
            e.master_addr = slurm_first_node(getenv("SLURM_JOB_NODELIST"));
        }
    } else {
        return e;  // a single process
    }
    if (e.rank >= e.world_size) {
        user_error("rank environment ({}): rank {} is not below the world size {}", e.launcher, e.rank, e.world_size);
    }
    if (e.local_rank >= e.local_world_size || e.world_size % e.local_world_size != 0) {
        user_error("rank environment ({}): local rank {} of {} per node does not fit a world of {} ranks", e.launcher,
                   e.local_rank, e.local_world_size, e.world_size);
    }
    if (const char* addr = getenv("MASTER_ADDR"))
        e.master_addr = addr;
    else if (e.num_nodes() > 1 && e.launcher != "slurm") {
        user_error(
            "rank environment ({}): {} nodes but MASTER_ADDR is not set; export it (the address of rank 0's "
            "node) to every rank",
            e.launcher, e.num_nodes());
    }
    if (getenv("MASTER_PORT")) {
        e.master_port = env_int(getenv, "MASTER_PORT", 1);
        if (e.master_port > 65535) user_error("rank environment: MASTER_PORT={}; expected 1..65535", e.master_port);
    }
    return e;
}

RankEnv detect_rank_env() {
    return detect_rank_env([](const char* name) { return static_cast<const char*>(std::getenv(name)); });
}

void silence_stdout_unless_rank0(const RankEnv& env) {
    if (env.rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) {
        user_error("rank {}: cannot silence stdout", env.rank);
    }
}

std::string host_name() {
    char name[256] = {};
    return ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string();
}

}  // namespace trainer
