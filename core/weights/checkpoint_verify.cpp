// Finding and verifying checkpoints on disk (see checkpoint_verify.h and checkpoint.h).
#include "core/weights/checkpoint_verify.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "base/common.h"
#include "core/weights/checkpoint.h"
#include "core/weights/checkpoint_meta.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

std::string checksum_file(const std::string& path, uint64_t* bytes) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) user_error("checkpoint file {}: cannot be read ({})", path, std::strerror(errno));
    Checksum c;
    std::vector<unsigned char> buf(1 << 22);
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) c.update(buf.data(), n);
    std::fclose(f);
    *bytes = c.length;
    return c.hex();
}

}  // namespace

std::vector<std::pair<long, std::string>> complete_checkpoints(const std::string& folder) {
    std::vector<std::pair<long, std::string>> out;
    std::error_code ec;
    if (!fs::is_directory(folder, ec)) return out;
    for (const auto& entry : fs::directory_iterator(folder, ec)) {
        // Exactly "step<digits>": skips .step<N>.tmp-* folders of interrupted saves and anything else.
        const std::string name = entry.path().filename().string();
        if (name.size() <= 4 || name.compare(0, 4, "step") != 0 || name.size() > 22) continue;
        if (name.find_first_not_of("0123456789", 4) != std::string::npos) continue;
        if (!fs::exists(entry.path() / "metadata.json", ec)) continue;
        out.emplace_back(std::stol(name.substr(4)), entry.path().string());
    }
    std::sort(out.begin(), out.end());
    return out;
}

VerifiedCheckpoint verified_metadata(const std::string& path) {
    const std::string meta_path = (fs::path(path) / "metadata.json").string();
    std::error_code ec;
    if (!fs::is_directory(path, ec)) user_error("checkpoint {}: no such folder", path);
    if (!fs::exists(meta_path, ec)) {
        const auto inside = complete_checkpoints(path);
        if (!inside.empty()) {
            user_error(
                "checkpoint {}: a save folder, not a checkpoint (it holds {} of them, the newest {}); resume "
                "with --load-path latest --save-folder {}, or --load-path {}",
                path, inside.size(), inside.back().second, path, inside.back().second);
        }
        user_error("checkpoint {}: no metadata.json, so it is not a complete checkpoint (an interrupted save?)", path);
    }
    Json meta = read_json_file(meta_path, "checkpoint");
    TrainConfig config = check_checkpoint_metadata(meta, path);
    // A folder step<N> holds step N: loading another step would train from the wrong place (a requeue
    // reporting success having trained nothing, or writing over later steps).
    const std::string folder_name = fs::path(path).lexically_normal().filename().string();
    if (folder_name.size() > 4 && folder_name.compare(0, 4, "step") == 0 &&
        folder_name.find_first_not_of("0123456789", 4) == std::string::npos &&
        folder_name.substr(4) != std::to_string(meta["step"].get<long>())) {
        user_error("checkpoint {}: its metadata.json records step {}, not the {} its folder is named for", path,
                   meta["step"].get<long>(), folder_name);
    }
    for (auto& [name, info] : meta["files"].items()) {
        const std::string file = (fs::path(path) / name).string();
        uint64_t bytes = 0;
        const std::string sum = checksum_file(file, &bytes);
        if (bytes != info["bytes"].get<uint64_t>() || sum != info["checksum"].get<std::string>()) {
            user_error(
                "checkpoint {}: file {} fails its checksum ({} bytes, checksum {}; metadata says {} bytes, {}); "
                "the checkpoint is corrupt",
                path, name, bytes, sum, info["bytes"].get<uint64_t>(), info["checksum"].get<std::string>());
        }
    }
    return VerifiedCheckpoint{std::move(meta), std::move(config)};
}

std::vector<long> checkpoint_steps(const std::string& save_folder) {
    std::vector<long> steps;
    for (const auto& c : complete_checkpoints(save_folder)) steps.push_back(c.first);
    return steps;
}

long checkpoint_step(const std::string& path) {
    const Json meta = read_json_file((fs::path(path) / "metadata.json").string(), "checkpoint");
    if (!meta.is_object() || !meta.contains("step") || !meta["step"].is_number_integer())
        user_error("checkpoint {}: metadata.json has no integer \"step\"", path);
    return meta["step"].get<long>();
}

std::optional<long> latest_checkpoint_step(const std::string& save_folder) {
    auto all = complete_checkpoints(save_folder);
    if (all.empty()) return std::nullopt;
    return all.back().first;
}

std::string resolve_checkpoint(const TrainConfig& config, const std::string& load_path) {
    if (load_path != "latest") return load_path;
    auto all = complete_checkpoints(*config.save_folder);
    if (all.empty()) {
        user_error("load_path \"latest\": no complete checkpoint in save_folder {}", *config.save_folder);
    }
    return all.back().second;
}

std::optional<long> step_of_folder_name(const std::string& path) {
    const std::string name = fs::path(path).lexically_normal().filename().string();
    if (name.size() <= 4 || name.size() > 22 || name.compare(0, 4, "step") != 0 ||
        name.find_first_not_of("0123456789", 4) != std::string::npos)
        return std::nullopt;
    return std::stol(name.substr(4));
}

VerifiedCheckpoint verified_or_named_alternative(const std::string& path) {
    try {
        return verified_metadata(path);
    } catch (const UserError& e) {
        // Its place among its siblings: the folder's name (step<N>), else what its metadata.json says.
        const fs::path parent = fs::path(path).lexically_normal().parent_path();
        std::optional<long> step = step_of_folder_name(path);
        if (!step) {
            try {
                step = checkpoint_step(path);
            } catch (const UserError&) {
            }
        }
        if (!step || parent.empty()) throw;
        auto siblings = complete_checkpoints(parent.string());
        for (auto it = siblings.rbegin(); it != siblings.rend(); ++it) {
            if (it->first >= *step) continue;
            try {
                (void)verified_metadata(it->second);
            } catch (const UserError&) {
                continue;
            }
            user_error(
                "{}; the newest checkpoint before it that verifies is {}: resume with --load-path latest "
                "--save-folder {}, which moves the checkpoints newer than it that do not verify aside "
                "(.step<N>.corrupt-*) and resumes from it",
                e.what(), it->second, parent.string());
        }
        throw;
    }
}

std::optional<std::string> newest_sound_checkpoint(const std::string& save_folder, const std::string& run_tag) {
    const auto all = complete_checkpoints(save_folder);
    std::vector<std::pair<long, std::string>> unsound;
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
        try {
            (void)verified_metadata(it->second);
        } catch (const UserError& e) {
            unsound.emplace_back(it->first, e.what());
            continue;
        }
        for (const auto& [step, why] : unsound) {
            const fs::path from = fs::path(save_folder) / fmt::format("step{}", step);
            const fs::path to = fs::path(save_folder) / fmt::format(".step{}.corrupt-{}", step, run_tag);
            std::error_code ec;
            fs::rename(from, to, ec);
            if (ec)
                user_error("checkpoint {}: does not verify and cannot be moved aside ({})", from.string(),
                           ec.message());
            std::fprintf(stderr, "warning: %s; moved aside as %s, kept for a look; resuming from %s\n", why.c_str(),
                         to.string().c_str(), it->second.c_str());
        }
        return it->second;
    }
    if (!unsound.empty()) {
        user_error("save_folder {}: none of its {} checkpoints verifies (the newest: {}); nothing was moved",
                   save_folder, unsound.size(), unsound.front().second);
    }
    return std::nullopt;
}

}  // namespace trainer
