// The JSON reading policy (see json.h).
#include "base/json.h"

#include <cstdint>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "base/common.h"
#include "base/files.h"
#include "base/utf8.h"

namespace trainer {

Json parse_json(std::string_view text, const std::string& what) {
    // The nesting depth and the count of values, from one pass over the text outside strings.
    int depth = 0;
    size_t values = 0;
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\')
                ++i;
            else if (c == '"')
                in_string = false;
            continue;
        }
        if (c == '"') {
            in_string = true;
            ++values;
        } else if (c == '[' || c == '{') {
            if (++depth > kMaxJsonDepth)
                user_error("{}: arrays and objects nest deeper than {} levels at byte {}", what, kMaxJsonDepth, i);
            ++values;
        } else if (c == ']' || c == '}') {
            --depth;
        } else if (c == ',') {
            ++values;
        }
        if (values > kMaxJsonValues)
            user_error("{}: more than {} values; expected a much smaller document", what, kMaxJsonValues);
    }
    // A key written twice in one object: nlohmann keeps the last silently; refused here (a safetensors
    // header naming one tensor twice, a config setting one key twice).
    std::vector<std::unordered_set<std::string>> keys;  // of each open object
    std::string twice;
    const Json::parser_callback_t callback = [&](int, Json::parse_event_t event, Json& parsed) {
        if (event == Json::parse_event_t::object_start) {
            keys.emplace_back();
        } else if (event == Json::parse_event_t::object_end) {
            keys.pop_back();
        } else if (event == Json::parse_event_t::key && twice.empty()) {
            const std::string& k = parsed.get_ref<const std::string&>();
            if (!keys.back().insert(k).second) twice = k;
        }
        return true;
    };
    try {
        Json doc = Json::parse(text, callback);
        if (!twice.empty()) user_error("{}: the key \"{}\" appears twice in one object", what, twice);
        return doc;
    } catch (const Json::parse_error& e) {
        user_error("{}: not valid JSON at byte {}: {}", what, e.byte, e.what());
    } catch (const Json::exception& e) {  // e.g. a number too large for a double
        user_error("{}: not valid JSON: {}", what, e.what());
    }
}

Json read_json_file(const std::string& path, const std::string& what) {
    return parse_json(read_file(path, what), what + " " + path);
}

namespace {
void find_invalid_utf8(const Json& v, const std::string& path, std::optional<std::string>& found) {
    if (found) return;
    if (v.is_string()) {
        if (invalid_utf8_offset(v.get_ref<const std::string&>()) != std::string_view::npos) found = path;
    } else if (v.is_object()) {
        for (auto it = v.begin(); it != v.end() && !found; ++it) {
            const std::string key = path.empty() ? it.key() : path + "." + it.key();
            if (invalid_utf8_offset(it.key()) != std::string_view::npos)
                found = key;
            else
                find_invalid_utf8(it.value(), key, found);
        }
    } else if (v.is_array()) {
        for (size_t i = 0; i < v.size() && !found; ++i) find_invalid_utf8(v[i], fmt::format("{}[{}]", path, i), found);
    }
}
}  // namespace

std::optional<std::string> invalid_utf8_path(const Json& v) {
    std::optional<std::string> found;
    find_invalid_utf8(v, "", found);
    return found;
}

std::string json_text(const Json& v) { return v.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string short_json(const Json& v) {
    std::string s = json_text(v);
    if (s.size() <= 80) return s;
    size_t cut = 77;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a character
    return s.substr(0, cut) + "...";
}

void require_json_object(const Json& doc, const std::string& what) {
    if (!doc.is_object()) user_error("{}: expected a JSON object, got {}", what, short_json(doc));
}

namespace {
template <typename T>
bool holds(const Json& v) {
    if constexpr (std::is_same_v<T, std::string>) return v.is_string();
    if constexpr (std::is_same_v<T, double>) return v.is_number();
    if constexpr (std::is_same_v<T, int64_t>) return v.is_number_integer();
    if constexpr (std::is_same_v<T, bool>) return v.is_boolean();
}
template <typename T>
const char* type_name() {
    if constexpr (std::is_same_v<T, std::string>) return "a string";
    if constexpr (std::is_same_v<T, double>) return "a number";
    if constexpr (std::is_same_v<T, int64_t>) return "an integer";
    if constexpr (std::is_same_v<T, bool>) return "true or false";
}
}  // namespace

template <typename T>
T json_field(const Json& doc, const char* key, T fallback, const std::string& what) {
    require_json_object(doc, what);
    const auto it = doc.find(key);
    if (it == doc.end() || it->is_null()) return fallback;
    if (!holds<T>(*it)) user_error("{}: {} is {}; expected {}", what, key, short_json(*it), type_name<T>());
    return it->get<T>();
}
template std::string json_field<std::string>(const Json&, const char*, std::string, const std::string&);
template double json_field<double>(const Json&, const char*, double, const std::string&);
template int64_t json_field<int64_t>(const Json&, const char*, int64_t, const std::string&);
template bool json_field<bool>(const Json&, const char*, bool, const std::string&);

}  // namespace trainer
