// Sharded checkpoints written atomically (see checkpoint.h).
#include "core/weights/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "base/common.h"
#include "core/model/init.h"
#include "core/optimizer.h"
#include "core/weights/checkpoint_meta.h"
#include "core/weights/checkpoint_verify.h"
#include "core/weights/hf_export.h"
#include "core/weights/hf_names.h"
#include "core/weights/peft.h"
#include "core/weights/safetensors.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

// A checkpoint's weights written as export_checkpoint writes them, without its check of the destination (a
// checkpoint's own save_safetensors copy is written into its folder).
std::string export_weights(const std::string& path, const std::string& out, const HfExportOptions& options);

constexpr int kFormatVersion = kCheckpointFormatVersion;

void fsync_path(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd >= 0) {
        ::fsync(fd);
        ::close(fd);
    }
}

class Writer {
   public:
    explicit Writer(const std::string& path) : path_(path), f_(std::fopen(path.c_str(), "wb")) {
        if (!f_) user_error("checkpoint: cannot write {} ({})", path, std::strerror(errno));
    }
    ~Writer() {
        if (f_) std::fclose(f_);
    }
    void write(const void* data, size_t bytes) {
        if (bytes == 0) return;
        if (std::fwrite(data, 1, bytes, f_) != bytes) {
            user_error("checkpoint: writing {} failed ({}); the previous checkpoints are untouched", path_,
                       std::strerror(errno));
        }
    }
    void close() {
        if (std::fflush(f_) != 0 || ::fsync(fileno(f_)) != 0 || std::fclose(f_) != 0) {
            f_ = nullptr;
            user_error("checkpoint: writing {} failed ({}); the previous checkpoints are untouched", path_,
                       std::strerror(errno));
        }
        f_ = nullptr;
    }

   private:
    std::string path_;
    std::FILE* f_;
};

// Reads and verifies a checkpoint's metadata and file checksums.
// The checkpoint's units (their count, names and sizes) are the ones `layout` builds.
void check_units_match(const Json& meta, const ParamLayout& layout, const std::string& path) {
    if (meta["units"].size() != layout.units().size()) {
        user_error("checkpoint {}: {} units, but the model configured has {}", path, meta["units"].size(),
                   layout.units().size());
    }
    for (size_t u = 0; u < layout.units().size(); ++u) {
        const Unit& unit = layout.units()[u];
        const Json& saved = meta["units"][u];
        if (saved["name"] != unit.name || saved["numel"].get<size_t>() != unit.numel) {
            user_error("checkpoint {}: unit {} is {} with {} parameters, but the model configured is {} with {}", path,
                       u, json_text(saved["name"]), saved["numel"].get<size_t>(), unit.name, unit.numel);
        }
    }
}

// Assembles the first `states` of unit `u`'s states (params, exp_avg, exp_avg_sq) into out[0..states)
// from its pieces in the shard files, one open and one seek per piece. Every element of the unit is in
// exactly one piece; `pieces` entries are [file, begin, end, offset]: elements [begin, end) of the unit,
// stored in rank<file>.bin from byte `offset` as three consecutive runs of end - begin floats.
void read_unit_state(const std::string& path, const Json& meta, int u, int states, std::vector<float>* out) {
    const Json& unit = meta["units"][u];
    const size_t numel = unit["numel"].get<size_t>();
    for (int k = 0; k < states; ++k) out[k].assign(numel, 0.0f);
    size_t covered = 0;
    for (const Json& piece : unit["pieces"]) {
        const int file_index = piece[0].get<int>();
        const size_t begin = piece[1].get<size_t>(), end = piece[2].get<size_t>();
        const size_t file_offset = piece[3].get<size_t>();
        if (begin > end || end > numel) {
            user_error("checkpoint {}: unit {} has a piece [{}, {}) outside its {} elements", path,
                       unit["name"].get<std::string>(), begin, end, numel);
        }
        const std::string file = (fs::path(path) / fmt::format("rank{}.bin", file_index)).string();
        std::FILE* f = std::fopen(file.c_str(), "rb");
        if (!f) user_error("checkpoint {}: cannot read {} ({})", path, file, std::strerror(errno));
        const size_t n = end - begin;
        bool ok = std::fseek(f, static_cast<long>(file_offset), SEEK_SET) == 0;
        for (int k = 0; ok && k < states; ++k) ok = std::fread(out[k].data() + begin, sizeof(float), n, f) == n;
        std::fclose(f);
        if (!ok) user_error("checkpoint {}: {} is shorter than its metadata says", path, file);
        covered += n;
    }
    if (covered != numel) {
        user_error("checkpoint {}: the pieces of unit {} cover {} of its {} elements", path,
                   unit["name"].get<std::string>(), covered, numel);
    }
}

}  // namespace

void check_model_matches(const TrainConfig& saved, const TrainConfig& config, const std::string& path) {
    // Both validated: a key the checkpoint's trainer did not have yet reads as its default, a derived one (n_kv_heads
    // null) as its value, so the two models compare key by key as the typed configs make them.
    const Json a = config_json(saved)["model"], b = config_json(config)["model"];
    for (auto it = b.begin(); it != b.end(); ++it) {
        if (it.key() == "init_fn" || it.key() == "init_std" || it.key() == "init_cutoff_factor") continue;
        if (a[it.key()] != it.value()) {
            user_error("checkpoint {}: model.{} is {} in the checkpoint but {} in this run's config", path, it.key(),
                       a[it.key()].dump(), it.value().dump());
        }
    }
    // A fine-tune's model is its base and its adapters: what they are and how they scale is the model too (a
    // target swapped for one of the same shape, or another alpha, would load without a size changing).
    const LoraConfig &was = saved.lora, &now = config.lora;
    if (was.enabled != now.enabled) {
        user_error("checkpoint {}: lora.enabled is {} in the checkpoint but {} in this run's config{}", path,
                   was.enabled, now.enabled,
                   was.enabled ? "; set the lora keys it was trained with"
                               : "; to fine-tune a pre-trained checkpoint, export it (trainer export --checkpoint "
                                 "DIR -o base.safetensors) and give that as init_from");
    }
    if (!now.enabled) return;
    Json a_lora = config_json(saved)["lora"], b_lora = config_json(config)["lora"];
    for (Json* lora : {&a_lora, &b_lora}) {
        Json& targets = (*lora)["targets"];  // resolved (never null) where LoRA is enabled; a set: sorted
        std::sort(targets.begin(), targets.end());
    }
    for (const char* key : {"r", "alpha", "use_rslora", "quantize", "double_quant", "targets"}) {
        if (a_lora[key] != b_lora[key]) {
            user_error(
                "checkpoint {}: lora.{} is {} in the checkpoint but {} in this run's config: the adapters "
                "were trained as another model",
                path, key, a_lora[key].dump(), b_lora[key].dump());
        }
    }
}

SavePaths prepare_save(const TrainConfig& config, long step, const std::string& run_tag) {
    SavePaths save;
    save.step = step;
    save.folder = *config.save_folder;
    std::error_code ec;
    fs::create_directories(save.folder, ec);
    if (ec) user_error("save_folder {}: cannot be created ({})", save.folder, ec.message());
    save.final_dir = (fs::path(save.folder) / fmt::format("step{}", step)).string();
    save.tmp_dir = (fs::path(save.folder) / fmt::format(".step{}.tmp-{}", step, run_tag)).string();
    // save_overwrite on every save, not only at the start: a checkpoint written before is never replaced
    // unless the run says so (every rank sees the same folder and decides alike).
    if (!config.save_overwrite && fs::exists(save.final_dir, ec)) {
        user_error(
            "checkpoint {} already exists and save_overwrite is false: this run does not replace it (another run "
            "writing to save_folder {}?); set save_overwrite=true to replace it, or save to another folder",
            save.final_dir, save.folder);
    }
    return save;
}

namespace {

// Writes `bytes` from `data` to a new file `path` and syncs it. The bulk goes with O_DIRECT, from the memory
// to the disk, where the buffer is 4 KiB aligned and the file system takes it: through the page cache, the
// copy into it and its writeback cost the CPU more than the disk's own time (on this project's build machine,
// 340 MiB took 1.5 s of CPU buffered and 0.06 s direct), CPU a rank's compute shares. The unaligned tail, and
// all of it where direct writes are refused (EINVAL), go through the page cache.
bool all_finite(const float* x, size_t n) {
    // No early exit: the loop vectorizes and runs at memory speed (std::find_if's does not).
    uint32_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, x + i, sizeof bits);
        bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
}

void write_file_direct(const std::string& path, const void* data, size_t bytes, long step,
                       const std::atomic<bool>* cancel) {
    constexpr size_t kAlign = 4096, kChunk = size_t{64} << 20;
    const char* p = static_cast<const char*>(data);
    const bool aligned = reinterpret_cast<uintptr_t>(p) % kAlign == 0;
    int fd = aligned ? ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644) : -1;
    bool direct = fd >= 0;
    if (!direct) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) user_error("checkpoint: cannot write {} ({})", path, std::strerror(errno));
    struct Close {
        int fd;
        ~Close() {
            if (fd >= 0) ::close(fd);
        }
    } guard{fd};
    auto fail = [&](int err) {
        user_error("checkpoint: writing {} failed ({}); the previous checkpoints are untouched", path,
                   std::strerror(err));
    };
    auto buffered = [&] {
        direct = false;
        const int flags = ::fcntl(fd, F_GETFL);
        if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0) fail(errno);
    };
    size_t done = 0;
    while (done < bytes) {
        if (cancel != nullptr && cancel->load()) user_error("checkpoint step {}: cancelled", step);
        size_t n = std::min(kChunk, bytes - done);
        if (direct) n -= n % kAlign;
        if (direct && n == 0) {  // the tail
            buffered();
            continue;
        }
        const ssize_t w = ::write(fd, p + done, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && direct && errno == EINVAL) {  // the file system takes no direct writes after all
            buffered();
            continue;
        }
        if (w < 0) fail(errno);
        if (w == 0) fail(EIO);
        done += static_cast<size_t>(w);
        if (direct && done % kAlign != 0) buffered();  // a short direct write: the rest is unaligned
    }
    if (::fsync(fd) != 0) fail(errno);
    guard.fd = -1;
    if (::close(fd) != 0) fail(errno);
}

}  // namespace

void write_shard_file(const TrainConfig& config, const ParamLayout& layout, const std::vector<ShardView>& shards,
                      Backend* device, const SavePaths& save, int file_index, const std::atomic<bool>* cancel,
                      const void* contiguous) {
    const std::string file = (fs::path(save.tmp_dir) / fmt::format("rank{}.bin", file_index)).string();
    std::optional<Writer> w;  // array by array; a contiguous snapshot is written in one pass below
    if (contiguous == nullptr) w.emplace(file);
    Checksum sum;
    std::vector<float> staging;
    Json pieces = Json::array();
    size_t offset = 0;
    for (const ShardView& s : shards) {
        const size_t n = s.end - s.begin;
        pieces.push_back(Json::array({s.unit, s.begin, s.end, offset}));
        const char* what[] = {"parameters", "first moments (exp_avg)", "second moments (exp_avg_sq)"};
        int k = 0;
        for (const float* src : {s.param, s.exp_avg, s.exp_avg_sq}) {
            if (cancel != nullptr && cancel->load()) user_error("checkpoint step {}: cancelled", save.step);
            const float* host = src;
            if (device != nullptr) {  // device memory, or host memory (offload): through a host copy
                staging.resize(n);
                if (n > 0) device->copy_any(staging.data(), src, n * sizeof(float));
                host = staging.data();
            }
            // The state is committed here: a non-finite value is refused, so that `latest` and the rotation
            // of save_num_checkpoints_to_keep never trade a good checkpoint for it.
            if (!all_finite(host, n)) {
                const float* bad = std::find_if(host, host + n, [](float x) { return !std::isfinite(x); });
                const std::optional<long> newest = latest_checkpoint_step(save.folder);
                const std::string kept =
                    newest ? fmt::format("the newest complete checkpoint, {}/step{}, is kept", save.folder, *newest)
                           : fmt::format("no checkpoint was written to {}", save.folder);
                user_error(
                    "step {}: not saved: the {} of unit {} are not finite ({} at element {}) after the optimizer "
                    "step; {}; {}",
                    save.step, what[k], layout.units()[s.unit].name, *bad, s.begin + (bad - host), kept,
                    divergence_advice(config.optimizer));
            }
            sum.update(host, n * sizeof(float));
            if (w) w->write(host, n * sizeof(float));
            ++k;
        }
        offset += 3 * n * sizeof(float);
    }
    if (w) {
        w->close();
    } else {
        write_file_direct(file, contiguous, offset, save.step, cancel);
    }
    // The unit ranges in the file and the file's size and checksum, taken from the bytes as they were written
    // (loading checks them against the bytes it reads).
    // The list appears whole (written aside, then renamed): a rank<k>.json in the folder means rank<k>.bin is
    // complete and synced, which rank 0 relies on where the ranks' votes never came (salvaged_save).
    const Json list = {{"pieces", pieces}, {"bytes", sum.length}, {"checksum", sum.hex()}};
    const std::string text = list.dump();
    const std::string list_path = (fs::path(save.tmp_dir) / fmt::format("rank{}.json", file_index)).string();
    Writer j(list_path + ".part");
    j.write(text.data(), text.size());
    j.close();
    std::error_code ec;
    fs::rename(list_path + ".part", list_path, ec);
    if (ec) user_error("checkpoint: cannot rename {}.part to {} ({})", list_path, list_path, ec.message());
}

bool shard_lists_complete(const SavePaths& save, int files) {
    std::error_code ec;
    for (int k = 0; k < files; ++k) {
        if (!fs::exists(fs::path(save.tmp_dir) / fmt::format("rank{}.json", k), ec)) return false;
    }
    return true;
}

void abandon_save(const SavePaths& save) {
    std::error_code ignored;
    fs::remove_all(save.tmp_dir, ignored);
}

namespace {

// Removes a save's temporary folder when it goes out of scope while armed (a save that failed).
struct TemporaryFolderGuard {
    const SavePaths& save;
    bool armed;
    ~TemporaryFolderGuard() {
        if (armed) abandon_save(save);
    }
};

}  // namespace

void remove_excess_checkpoints(const TrainConfig& config) {
    if (config.save_num_checkpoints_to_keep <= 0) return;
    const auto all = complete_checkpoints(*config.save_folder);
    const long excess = static_cast<long>(all.size()) - config.save_num_checkpoints_to_keep;
    std::error_code ec;
    for (long i = 0; i < excess; ++i) fs::remove_all(all[i].second, ec);
}

std::string publish_save(const TrainConfig& config, const ParamLayout& layout, const SavePaths& save, int files,
                         bool rotate) {
    const std::string& folder = save.folder;
    const std::string& tmp_dir = save.tmp_dir;
    const std::string& final_dir = save.final_dir;
    const long step = save.step;
    std::error_code ec;
    // A save that fails here leaves no temporary folder behind (a full disk stays full otherwise).
    TemporaryFolderGuard cleanup{save, true};
    Json units = Json::array();
    for (const Unit& u : layout.units()) {
        units.push_back({{"name", u.name}, {"numel", u.numel}, {"pieces", Json::array()}});
    }
    Json file_sums = Json::object();
    for (int k = 0; k < files; ++k) {
        const std::string list_path = (fs::path(tmp_dir) / fmt::format("rank{}.json", k)).string();
        const Json list = read_json_file(list_path, "checkpoint");
        for (const Json& p : list["pieces"]) {
            units.at(p[0].get<size_t>())["pieces"].push_back(Json::array({k, p[1], p[2], p[3]}));
        }
        file_sums[fmt::format("rank{}.bin", k)] = {{"bytes", list["bytes"]}, {"checksum", list["checksum"]}};
        fs::remove(list_path, ec);
    }

    Json meta;
    meta["format"] = "trainer-checkpoint";
    meta["version"] = kFormatVersion;
    meta["step"] = step;
    meta["world_size"] = files;  // shard files in this checkpoint
    meta["units"] = units;
    meta["data"] = {{"global_train_batch_size", config.global_train_batch_size},
                    {"instances_consumed", step * config.global_train_batch_size},
                    {"seed", config.data.seed},
                    {"shuffle", config.data.shuffle}};
    meta["rng"] = {{"seed", config.seed}};
    meta["config"] = config_json(config);
    if (layout.has_adapters() && !layout.frozen_base().empty()) meta["lora_base"] = layout.frozen_base();
    meta["files"] = file_sums;
    {
        const std::string text = meta.dump(2);
        Writer w((fs::path(tmp_dir) / "metadata.json").string());
        w.write(text.data(), text.size());
        w.close();
    }
    // Rank 0's unsharded copy of the weights, assembled from the checkpoint's pieces (their checksums verified) in
    // the temporary folder: part of the checkpoint, published with it or not at all. A fine-tune's trained weights
    // are its adapters: their copy is the PEFT adapter (the folder then loads as one), never the base again.
    if (config.save_safetensors) {
        const char* file = config.lora.enabled ? "adapter_model.safetensors" : "model.safetensors";
        try {
            if (config.lora.enabled) {
                TrainConfig saved;
                std::vector<std::vector<float>> units;
                read_checkpoint_params(tmp_dir, &saved, &units);
                write_peft_adapter_files(saved, ParamLayout(saved), units, tmp_dir, "save_safetensors");
            } else {
                export_weights(tmp_dir, (fs::path(tmp_dir) / file).string(), {});
            }
        } catch (const UserError& e) {
            user_error("checkpoint step {}: not published: its {} (save_safetensors) failed: {}", step, file, e.what());
        }
    }
    fsync_path(tmp_dir);

    // Publish. Without save_overwrite nothing is replaced: a step<N>/ that appeared while this save was written
    // (another run in the folder) is refused, atomically where the filesystem has RENAME_NOREPLACE. With it, an
    // existing step<N>/ is moved aside first and removed only afterwards.
    std::string trash;
    const auto appeared = [&] {
        user_error(
            "checkpoint {} appeared while this run wrote its step {} and save_overwrite is false: another run writes "
            "to save_folder {}; it is left as it is and this save is dropped",
            final_dir, step, folder);
    };
    if (!config.save_overwrite) {
        if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_NOREPLACE) != 0) {
            const int e = errno;
            if (e == EEXIST || e == ENOTEMPTY) appeared();
            if (e != EINVAL && e != ENOSYS) {
                user_error("checkpoint: cannot rename {} to {} ({})", tmp_dir, final_dir, std::strerror(e));
            }
            if (fs::exists(final_dir, ec)) appeared();  // no RENAME_NOREPLACE here: the check just before
            fs::rename(tmp_dir, final_dir, ec);
            if (ec) user_error("checkpoint: cannot rename {} to {} ({})", tmp_dir, final_dir, ec.message());
        }
    } else {
        if (fs::exists(final_dir, ec)) {
            trash = (fs::path(folder) / fmt::format(".step{}.old-{}", step, ::getpid())).string();
            fs::rename(final_dir, trash, ec);
            if (ec) user_error("checkpoint: cannot replace {} ({})", final_dir, ec.message());
        }
        fs::rename(tmp_dir, final_dir, ec);
        if (ec) user_error("checkpoint: cannot rename {} to {} ({})", tmp_dir, final_dir, ec.message());
    }
    cleanup.armed = false;
    fsync_path(folder);
    if (!trash.empty()) fs::remove_all(trash, ec);

    // `latest` symlink for people and scripts (loading does not rely on it), replaced atomically.
    const std::string link_tmp = (fs::path(folder) / fmt::format(".latest.tmp-{}", ::getpid())).string();
    fs::remove(link_tmp, ec);
    fs::create_directory_symlink(fmt::format("step{}", step), link_tmp, ec);
    if (!ec) fs::rename(link_tmp, fs::path(folder) / "latest", ec);

    if (rotate) remove_excess_checkpoints(config);
    return final_dir;
}

void debug_kill_in_save(long step) {
    if (const char* kill = std::getenv("TRAINER_DEBUG_KILL_IN_SAVE"); kill && std::atol(kill) == step) {
        ::raise(SIGKILL);  // test hook: dies between the shard files and the metadata
    }
}

std::string save_checkpoint(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Strategy& strategy,
                            long step, const std::string& run_tag) {
    const SavePaths save = prepare_save(config, step, run_tag);
    // The ranks that hold distinct state each write one shard file (rank<k>.bin) and a list of the unit
    // ranges in it (rank<k>.json) into one shared temporary folder; rank 0 then merges the lists into
    // metadata.json and renames the folder. A replicated strategy has one writer, rank 0.
    const int rank = strategy.rank(), file_index = strategy.checkpoint_file();
    const bool multi = strategy.world_size() > 1;
    // A save that fails on rank 0 leaves no temporary folder behind; what another rank's failure leaves is
    // cleared by the next run that takes the folder's lock.
    TemporaryFolderGuard cleanup{save, rank == 0};
    if (rank == 0) {
        // Room first: the folder holds at most save_num_checkpoints_to_keep checkpoints while this one is written
        // (a background save before it published without rotating), before any rank writes (the barrier).
        remove_excess_checkpoints(config);
        abandon_save(save);
        std::error_code ec;
        fs::create_directories(save.tmp_dir, ec);
        if (ec) user_error("checkpoint: cannot create {} ({})", save.tmp_dir, ec.message());
    }
    if (multi) strategy.barrier();
    if (file_index >= 0) write_shard_file(config, layout, strategy.owned_shards(), backend, save, file_index);
    debug_kill_in_save(step);
    if (multi) strategy.barrier();
    if (rank != 0) return save.final_dir;
    cleanup.armed = false;  // publish_save removes it when it fails
    return publish_save(config, layout, save, strategy.checkpoint_files());
}

CheckpointInfo load_checkpoint(const TrainConfig& config, const ParamLayout& layout, Backend* backend,
                               Strategy& strategy, const std::string& path) {
    const VerifiedCheckpoint verified = verified_or_named_alternative(path);
    const Json& meta = verified.meta;
    check_model_matches(verified.config, config, path);
    const Json& data = meta["data"];
    if (data["global_train_batch_size"].get<long>() != config.global_train_batch_size ||
        data["seed"].get<unsigned long long>() != config.data.seed ||
        data["shuffle"].get<bool>() != config.data.shuffle) {
        user_error(
            "checkpoint {}: written with global_train_batch_size {}, data.seed {}, data.shuffle {}; this run "
            "has {}, {}, {}: the data stream would not continue where it stopped",
            path, data["global_train_batch_size"].get<long>(), data["seed"].get<unsigned long long>(),
            data["shuffle"].get<bool>(), config.global_train_batch_size, config.data.seed, config.data.shuffle);
    }
    check_units_match(meta, layout, path);
    if (meta.contains("lora_base") && meta["lora_base"].is_string() && !layout.frozen_base().empty() &&
        meta["lora_base"] != layout.frozen_base()) {
        user_error(
            "checkpoint {}: a LoRA fine-tune of a base that is {}, but this run's base (init_from {}) is {}: "
            "its adapters were trained on another model; resume with the base it was trained from",
            path, meta["lora_base"].get<std::string>(), config.init_from.value_or("none"), layout.frozen_base());
    }
    const Json saved_data = config_json(verified.config)["data"], now_data = config_json(config)["data"];
    if (saved_data["paths"] != now_data["paths"] || saved_data["sources"] != now_data["sources"]) {
        std::fprintf(stderr,
                     "note: resuming %s with data.paths %s and data.sources %s; it was written with %s and %s: the run "
                     "goes on at instance %ld of this data's order\n",
                     path.c_str(), json_text(now_data["paths"]).c_str(), json_text(now_data["sources"]).c_str(),
                     json_text(saved_data["paths"]).c_str(), json_text(saved_data["sources"]).c_str(),
                     data["instances_consumed"].get<long>());
    } else if (saved_data["label_mask_paths"] != now_data["label_mask_paths"]) {
        std::fprintf(stderr,
                     "note: resuming %s with data.label_mask_paths %s; it was written with %s: the same tokens go on "
                     "with another choice of what is in the loss\n",
                     path.c_str(), json_text(now_data["label_mask_paths"]).c_str(),
                     json_text(saved_data["label_mask_paths"]).c_str());
    }
    // Each unit this rank owns part of is assembled once per state from the checkpoint's pieces.
    std::vector<std::vector<ShardView>> by_unit(layout.units().size());
    for (const ShardView& s : strategy.owned_shards()) by_unit.at(s.unit).push_back(s);
    std::vector<float> full[3];
    for (size_t u = 0; u < by_unit.size(); ++u) {
        if (by_unit[u].empty()) continue;
        read_unit_state(path, meta, static_cast<int>(u), 3, full);
        for (const ShardView& s : by_unit[u]) {
            float* dst[3] = {s.param, s.exp_avg, s.exp_avg_sq};
            for (int k = 0; k < 3; ++k) {
                backend->copy_any(dst[k], full[k].data() + s.begin, (s.end - s.begin) * sizeof(float));
            }
        }
    }
    strategy.params_loaded();
    CheckpointInfo info;
    info.path = path;
    info.step = meta["step"].get<long>();
    return info;
}

void read_checkpoint_params(const std::string& path, TrainConfig* config, std::vector<std::vector<float>>* units) {
    const VerifiedCheckpoint verified = verified_metadata(path);
    const Json& meta = verified.meta;
    *config = verified.config;
    // The model its config describes must be the one in the shards (an edited metadata.json would export
    // mis-shaped weights).
    const ParamLayout layout(*config);
    check_units_match(meta, layout, path);
    units->resize(meta["units"].size());
    for (size_t u = 0; u < units->size(); ++u) {
        if (!layout.units()[u].frozen) read_unit_state(path, meta, static_cast<int>(u), 1, &(*units)[u]);
    }
}

namespace {

std::string export_weights(const std::string& path, const std::string& out, const HfExportOptions& options) {
    std::error_code ec;
    TrainConfig config;
    std::vector<std::vector<float>> units;
    read_checkpoint_params(path, &config, &units);
    if (!config.lora.enabled && (options.lora_adapter || options.merge_lora)) {
        user_error("export {}: checkpoint {} is no LoRA fine-tune's (its lora.enabled is false)",
                   options.lora_adapter ? "--adapter" : "--merge-lora", path);
    }
    if (config.lora.enabled) {
        if (options.lora_adapter == options.merge_lora) {
            user_error(
                "export: checkpoint {} is a LoRA fine-tune's, which holds its adapters; give {}--adapter (a PEFT "
                "adapter directory) or --merge-lora (the model with them merged into its base)",
                path, options.lora_adapter ? "one of " : "");
        }
        const ParamLayout lora_layout(config);
        if (options.lora_adapter) {
            write_peft_adapter(config, lora_layout, units, out);
            return "PEFT LoRA adapter";
        }
        fill_lora_base(config, lora_layout, units);
        round_trip_frozen(lora_layout, units);  // QLoRA: the base the adapters were trained on
        merge_lora(config, lora_layout, units);
        config.lora = LoraConfig{};
        units.resize(ParamLayout(config).units().size());  // the adapter units follow the base's
    }
    const ParamLayout layout(config);
    const bool file = out.size() > 12 && out.compare(out.size() - 12, 12, ".safetensors") == 0;
    if (!file) return export_hf_directory(config, layout, units, out, options);
    const auto tensors = to_hf_tensors(config, layout, units);
    std::vector<TensorRef> refs;
    for (const auto& [name, t] : tensors) refs.push_back({name, t.shape, t.data.data()});
    const std::string arch = hf_config_json(config)["architectures"][0];
    const std::string tmp = out + fmt::format(".tmp-{}", ::getpid());
    write_safetensors(tmp, refs, {{"format", "pt"}, {"architecture", arch}});
    fs::rename(tmp, out, ec);
    if (ec) user_error("export: cannot rename {} to {} ({})", tmp, out, ec.message());
    return arch;
}

}  // namespace

std::string export_checkpoint(const std::string& path, const std::string& out, const HfExportOptions& options) {
    // A checkpoint's folder holds the checkpoint's files only: an export written into one (or over its
    // model.safetensors, save_safetensors' copy) would mix another model into it.
    const fs::path parent = fs::absolute(out).lexically_normal().parent_path();
    std::error_code ec;
    if (fs::exists(parent / "metadata.json", ec) && fs::exists(parent / "rank0.bin", ec)) {
        user_error(
            "export -o {}: {} is a checkpoint's folder, whose files are the checkpoint's; write the export "
            "outside it",
            out, parent.string());
    }
    return export_weights(path, out, options);
}

}  // namespace trainer
