// The checkpoint metadata's structure (see checkpoint_meta.h).
#include "core/weights/checkpoint_meta.h"

#include "base/common.h"

namespace trainer {
namespace {

[[noreturn]] void bad(const std::string& path, const std::string& entry, const std::string& expected) {
    user_error("checkpoint {}: metadata.json {}: expected {}; the metadata is damaged", path, entry, expected);
}

const Json& member(const Json& obj, const char* key, const std::string& path, const std::string& where) {
    if (!obj.is_object() || !obj.contains(key)) bad(path, where + key, "an entry (it is missing)");
    return obj[key];
}

uint64_t non_negative(const Json& v, const std::string& path, const std::string& entry) {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
        bad(path, entry, "a non-negative integer, not " + v.dump());
    }
    return v.get<uint64_t>();
}

}  // namespace

TrainConfig check_checkpoint_metadata(const Json& meta, const std::string& path) {
    if (!meta.is_object() || !meta.contains("format") || meta["format"] != "trainer-checkpoint" ||
        !meta.contains("version") || meta["version"] != kCheckpointFormatVersion) {
        user_error("checkpoint {}: metadata.json is not a trainer checkpoint of format version {}", path,
                   kCheckpointFormatVersion);
    }
    non_negative(member(meta, "step", path, ""), path, "step");
    const uint64_t world = non_negative(member(meta, "world_size", path, ""), path, "world_size");
    if (world == 0 || world > 1000000) bad(path, "world_size", "1 or more shard files");

    const Json& units = member(meta, "units", path, "");
    if (!units.is_array() || units.empty()) bad(path, "units", "a non-empty list");
    for (size_t u = 0; u < units.size(); ++u) {
        const std::string at = fmt::format("units[{}].", u);
        if (!member(units[u], "name", path, at).is_string()) bad(path, at + "name", "a string");
        const uint64_t numel = non_negative(member(units[u], "numel", path, at), path, at + "numel");
        const Json& pieces = member(units[u], "pieces", path, at);
        if (!pieces.is_array()) bad(path, at + "pieces", "a list");
        for (size_t p = 0; p < pieces.size(); ++p) {
            const std::string pat = fmt::format("{}pieces[{}]", at, p);
            if (!pieces[p].is_array() || pieces[p].size() != 4) bad(path, pat, "[file, begin, end, byte offset]");
            uint64_t v[4];
            for (int k = 0; k < 4; ++k) v[k] = non_negative(pieces[p][k], path, fmt::format("{}[{}]", pat, k));
            if (v[0] >= world) bad(path, pat + "[0]", fmt::format("a shard file below world_size {}", world));
            if (v[1] > v[2] || v[2] > numel) bad(path, pat, fmt::format("begin <= end <= numel {}", numel));
            if (v[3] > (uint64_t{1} << 60)) bad(path, pat + "[3]", "a byte offset inside a file");
        }
    }
    const Json& data = member(meta, "data", path, "");
    non_negative(member(data, "global_train_batch_size", path, "data."), path, "data.global_train_batch_size");
    non_negative(member(data, "seed", path, "data."), path, "data.seed");
    if (!member(data, "shuffle", path, "data.").is_boolean()) bad(path, "data.shuffle", "true or false");

    const Json& files = member(meta, "files", path, "");
    if (!files.is_object()) bad(path, "files", "an object of rank<N>.bin entries");
    for (auto it = files.begin(); it != files.end(); ++it) {
        const std::string at = "files." + it.key() + ".";
        const std::string& name = it.key();
        if (name.size() < 9 || name.compare(0, 4, "rank") != 0 || name.compare(name.size() - 4, 4, ".bin") != 0 ||
            name.find_first_not_of("0123456789", 4) != name.size() - 4) {
            bad(path, "files." + name, "a file named rank<N>.bin");
        }
        non_negative(member(it.value(), "bytes", path, at), path, at + "bytes");
        if (!member(it.value(), "checksum", path, at).is_string()) bad(path, at + "checksum", "a string");
    }
    try {
        return validate_config(member(meta, "config", path, ""));
    } catch (const UserError& e) {
        user_error("checkpoint {}: metadata.json config: {}", path, e.what());
    }
}

}  // namespace trainer
