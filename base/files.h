// Whole files read and written, with errors that name the file and what it is.
#pragma once

#include <cstdio>
#include <functional>
#include <string>

namespace trainer {

// Whether a path is a URL (it has "://"): OLMo's configs name remote data so, which the trainer does not fetch.
inline bool is_url(const std::string& path) { return path.find("://") != std::string::npos; }

// Whether `path` names an existing file system entry, a directory, a regular file (symbolic links followed). A path
// that cannot be looked up (a name too long for the file system, a folder on the way that cannot be searched) is
// false here, not the library's exception: the caller's own error names the path and what was expected.
bool path_exists(const std::string& path);
bool is_directory_path(const std::string& path);
bool is_regular_file_path(const std::string& path);

// The whole of the file at `path`, bytes as they are; a file that cannot be read is a UserError
// "<what> <path>: cannot be read (<reason>)", with "; <hint>" after it where a hint is given.
std::string read_file(const std::string& path, const std::string& what, const std::string& hint = "");
// Writes `text` to `path` whole or not at all (a temporary file beside it, renamed over it); UserError naming
// `what` and the path when it cannot.
void write_text_file(const std::string& path, const std::string& text, const std::string& what);

// Writes a new directory `out` whole or not at all: refuses one that exists ("<what>: <out> already exists; ..."),
// lets `fill` write its files into a temporary directory beside it, then renames that to `out`; where `fill` throws
// or the rename fails, the temporary directory is removed and nothing is left at `out`.
void write_new_directory(const std::string& out, const std::string& what,
                         const std::function<void(const std::string& tmp)>& fill);

// Appends `bytes` to the open file `f` and flushes it, whole or not at all: where the write or the flush fails (a
// full disk), the file is cut back to where it ended and the errno is returned (0: written). For the record files a
// run appends to (metrics, TensorBoard), so that they end with the last whole record.
int append_whole(std::FILE* f, const std::string& bytes);

// A folder of the trainer's own data, found from the binary, not the working directory: an installed trainer
// (<prefix>/bin/trainer) reads <prefix>/share/trainer/<installed>, one in a build tree (<source>/<build>/bin/
// trainer) reads <source>/<in_source>.
std::string trainer_data_dir(const std::string& installed, const std::string& in_source);

}  // namespace trainer
