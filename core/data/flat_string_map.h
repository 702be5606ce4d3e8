// The vocabularies' read-only string -> id map (bpe.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trainer {

// A read-only string -> int32 map for the vocabularies, open-addressed in one flat array: a lookup costs
// one cache miss for the slot (whose key of up to 8 bytes is kept in it) and one more for a longer key,
// where std::unordered_map's bucket, node and string cost three (it was most of cl100k's time).
class FlatStringMap {
   public:
    static constexpr int32_t kMissing = -1;

    void build(const std::vector<std::pair<std::string_view, int32_t>>& items) {
        size_t cap = 16;
        while (cap < 2 * items.size()) cap *= 2;
        slots_.assign(cap, Slot{});
        mask_ = cap - 1;
        pool_.clear();
        for (const auto& [key, value] : items) {
            const uint64_t h = hash(key);
            size_t i = h & mask_;
            for (; slots_[i].value != kMissing; i = (i + 1) & mask_) {
                if (slots_[i].hash == h && this->key(slots_[i]) == key) break;  // a repeated key: the last wins
            }
            Slot& s = slots_[i];
            s.hash = h;
            s.len = static_cast<uint32_t>(key.size());
            s.value = value;
            if (key.size() <= 8) {
                std::memcpy(s.inline_key, key.data(), key.size());
            } else {
                s.offset = pool_.size();
                pool_.append(key);
            }
        }
    }
    int32_t find(std::string_view key) const {
        const uint64_t h = hash(key);
        for (size_t i = h & mask_;; i = (i + 1) & mask_) {
            const Slot& s = slots_[i];
            if (s.value == kMissing) return kMissing;
            if (s.hash == h && s.len == key.size() && this->key(s) == key) return s.value;
        }
    }
    bool empty() const { return slots_.empty(); }

   private:
    struct Slot {
        uint64_t hash = 0;
        union {
            char inline_key[8];
            uint64_t offset;
        };
        uint32_t len = 0;
        int32_t value = kMissing;
        Slot() : offset(0) {}
    };
    std::string_view key(const Slot& s) const {
        return s.len <= 8 ? std::string_view(s.inline_key, s.len) : std::string_view(pool_.data() + s.offset, s.len);
    }
    // 64-bit multiply-xorshift over 8-byte words (any good spread will do: the table is not exposed).
    static uint64_t hash(std::string_view key) {
        uint64_t h = 0x9E3779B97F4A7C15ULL ^ key.size();
        size_t i = 0;
        for (; i + 8 <= key.size(); i += 8) {
            uint64_t w;
            std::memcpy(&w, key.data() + i, 8);
            h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
            h ^= h >> 32;
        }
        uint64_t w = 0;
        std::memcpy(&w, key.data() + i, key.size() - i);
        h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
        return h ^ (h >> 29);
    }
    std::vector<Slot> slots_;
    size_t mask_ = 0;
    std::string pool_;
};

}  // namespace trainer
