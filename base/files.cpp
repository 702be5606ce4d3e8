// Whole files read and written (see files.h).
#include "base/files.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "base/common.h"

namespace trainer {

bool path_exists(const std::string& path) {
    std::error_code ec;
    return std::filesystem::exists(path, ec);
}

bool is_directory_path(const std::string& path) {
    std::error_code ec;
    return std::filesystem::is_directory(path, ec);
}

bool is_regular_file_path(const std::string& path) {
    std::error_code ec;
    return std::filesystem::is_regular_file(path, ec);
}

std::string read_file(const std::string& path, const std::string& what, const std::string& hint) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    const auto fail = [&](int err) {
        user_error("{} {}: cannot be read ({}){}{}", what, path, std::strerror(err), hint.empty() ? "" : "; ", hint);
    };
    if (f == nullptr) fail(errno);
    std::string text;
    char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
    const int err = std::ferror(f) ? errno : 0;
    std::fclose(f);
    if (err != 0) fail(err);
    return text;
}

void write_text_file(const std::string& path, const std::string& text, const std::string& what) {
    // Beside the destination, then renamed over it: a failed write leaves what was there.
    const std::string tmp = path + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr) user_error("{} {}: cannot be written ({})", what, path, std::strerror(errno));
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        std::remove(tmp.c_str());
        user_error("{} {}: writing failed ({})", what, path, std::strerror(err));
    }
}

void write_new_directory(const std::string& out, const std::string& what,
                         const std::function<void(const std::string& tmp)>& fill) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::exists(fs::symlink_status(out, ec))) {
        user_error("{}: {} already exists; remove it or choose another folder", what, out);
    }
    const std::string tmp = out + ".tmp-" + std::to_string(::getpid());
    fs::remove_all(tmp, ec);
    if (!fs::create_directories(tmp, ec) || ec) user_error("{}: cannot create {} ({})", what, tmp, ec.message());
    try {
        fill(tmp);
        fs::rename(tmp, out, ec);
        if (ec) user_error("{}: cannot rename {} to {} ({})", what, tmp, out, ec.message());
    } catch (...) {
        fs::remove_all(tmp, ec);
        throw;
    }
}

std::string trainer_data_dir(const std::string& installed, const std::string& in_source) {
    std::error_code ec;
    const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) return in_source;
    const std::filesystem::path prefix = exe.parent_path().parent_path();
    const std::filesystem::path share = prefix / "share" / "trainer" / installed;
    if (std::filesystem::is_directory(share, ec)) return share.string();
    return (prefix.parent_path() / in_source).string();
}

int append_whole(std::FILE* f, const std::string& bytes) {
    const long before = std::ftell(f);
    if (std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size() && std::fflush(f) == 0) return 0;
    const int e = errno != 0 ? errno : EIO;
    std::clearerr(f);
    if (before >= 0 && ::ftruncate(::fileno(f), before) == 0) std::fseek(f, before, SEEK_SET);
    return e;
}

}  // namespace trainer
