// A checkpoint on disk, as the loader and the writer both need it (checkpoint_verify.cpp): the files' checksum, the
// folder's complete checkpoints, and a checkpoint verified (its metadata against its files, its config validated).
// Private to core/weights.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/config.h"

namespace trainer {

// 64-bit checksum over 8-byte words (4 independent multiply-xor lanes, so it runs at memory speed),
// plus the tail bytes and the length.
struct Checksum {
    uint64_t lanes[4] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full, 0x165667b19e3779f9ull, 0x27d4eb2f165667c5ull};
    uint64_t length = 0;
    unsigned char tail[32];
    size_t tail_len = 0;

    static uint64_t mix(uint64_t h, uint64_t w) {
        h ^= w * 0x87c37b91114253d5ull;
        h = (h << 31) | (h >> 33);
        return h * 0x4cf5ad432745937full;
    }
    void block(const unsigned char* p) {
        for (int i = 0; i < 4; ++i) {
            uint64_t w;
            std::memcpy(&w, p + 8 * i, 8);
            lanes[i] = mix(lanes[i], w);
        }
    }
    void update(const void* data, size_t n) {
        const unsigned char* p = static_cast<const unsigned char*>(data);
        length += n;
        while (n > 0 && tail_len > 0) {
            tail[tail_len++] = *p++;
            --n;
            if (tail_len == 32) {
                block(tail);
                tail_len = 0;
            }
        }
        while (n >= 32) {
            block(p);
            p += 32;
            n -= 32;
        }
        std::memcpy(tail + tail_len, p, n);
        tail_len += n;
    }
    std::string hex() const {
        uint64_t h = length * 0x9e3779b97f4a7c15ull;
        for (uint64_t l : lanes) h = mix(h, l);
        for (size_t i = 0; i < tail_len; ++i) h = mix(h, tail[i]);
        h ^= h >> 33;
        return fmt::format("{:016x}", h);
    }
};

// The complete checkpoints of `folder` (step<N>/ with a metadata.json), oldest first.
std::vector<std::pair<long, std::string>> complete_checkpoints(const std::string& folder);

// A checkpoint's metadata, verified against its files, and the config it holds, validated once.
struct VerifiedCheckpoint {
    Json meta;
    TrainConfig config;
};

// Reads a checkpoint's metadata (its structure checked, its config validated) and verifies every file's size and
// checksum; UserError naming the checkpoint and what is wrong.
VerifiedCheckpoint verified_metadata(const std::string& path);
// verified_metadata(path), whose refusal of a corrupt checkpoint also names the newest older one beside it that
// verifies (what a resume from `latest` reaches instead).
VerifiedCheckpoint verified_or_named_alternative(const std::string& path);

}  // namespace trainer
