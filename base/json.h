// JSON: the one reading policy every JSON document the trainer takes goes through.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace trainer {

using Json = nlohmann::json;

// The reading policy for every JSON document the trainer takes (configs, checkpoint metadata, safetensors
// headers, Hugging Face config files, tokenizer files, --set values): arrays and objects nest at most
// kMaxJsonDepth deep (a config needs 4; nlohmann's dump, used in messages and saves, recurses per level),
// and a document with more than kMaxJsonValues values is refused (a YAML config's aliases can expand to
// that). Both are checked before anything is built, so memory stays within a small multiple of the text.
constexpr int kMaxJsonDepth = 64;
constexpr size_t kMaxJsonValues = 1u << 20;
// Parses `text` under that policy; a bad document is a UserError "<what>: ..." naming the byte offset.
Json parse_json(std::string_view text, const std::string& what);
// Reads a JSON file under that policy; a file that cannot be read or parsed is a UserError "<what> <path>:
// ..." naming the position of the first error.
Json read_json_file(const std::string& path, const std::string& what);
// The first string in `v` (a key or a value) that is not valid UTF-8, as its path ("data.paths[2]"), or
// nullopt. nlohmann's dump throws on such a string: every document written is checked first.
std::optional<std::string> invalid_utf8_path(const Json& v);
// A value as JSON text for a message; invalid UTF-8 in a string (a YAML config can hold any bytes) is
// shown replaced, never thrown.
std::string json_text(const Json& v);
// The same cut to 80 bytes ("..." for the rest, never inside a character): a value quoted in an error.
std::string short_json(const Json& v);

// Reading a document another program wrote (a PEFT adapter's config, a calibration, a Hugging Face config): a
// UserError "<what>: expected a JSON object, got ..." unless `doc` is an object.
void require_json_object(const Json& doc, const std::string& what);
// `key` of the object `doc` as a string, a number (double; int64_t: an integer), or a boolean, or `fallback` where
// the key is absent or null; a value of another type is a UserError "<what>: <key> is <value>; expected <type>"
// (nlohmann's own value() would throw its type_error, which names neither the file nor the key).
template <typename T>
T json_field(const Json& doc, const char* key, T fallback, const std::string& what);
}  // namespace trainer
