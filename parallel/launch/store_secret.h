// The rendezvous store's shared secret: every process of a job proves it knows it before the store reads or writes
// a key for it, and the store proves it back, so a stranger that reaches the port can neither read, write nor pose
// as the store (a port scanner, a misdirected health check, another job's ranks). PyTorch's TCPStore has none.
//
// The secret comes from the environment, never from a config, a checkpoint or a log: TRAINER_STORE_SECRET, or the
// first line of the file TRAINER_STORE_SECRET_FILE names. `trainer launch` on one node makes one for its ranks when
// neither is set; several nodes, mpirun and Slurm must be given the same one on every process
// (scripts/launch_mpirun.sh and scripts/launch_slurm.sbatch show how). It travels only as HMAC-SHA256 answers to
// random challenges, never in the clear.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace trainer {

constexpr const char* kStoreSecretEnv = "TRAINER_STORE_SECRET";
constexpr const char* kStoreSecretFileEnv = "TRAINER_STORE_SECRET_FILE";

// The job's secret from the environment (TRAINER_STORE_SECRET over TRAINER_STORE_SECRET_FILE), or nullopt where
// neither is set. An empty secret, or a file that cannot be read or is empty, is a UserError naming the variable
// (never the secret).
std::optional<std::string> store_secret_from_env(const std::function<const char*(const char*)>& getenv);
// A new secret: 32 random bytes (the kernel's) as 64 hex digits.
std::string new_store_secret();

using Digest = std::array<uint8_t, 32>;
// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104).
Digest sha256(const void* data, size_t n);
Digest hmac_sha256(const std::string& key, const void* data, size_t n);
// Equal digests, compared in time that does not depend on where they differ.
bool same_digest(const Digest& a, const Digest& b);

}  // namespace trainer
