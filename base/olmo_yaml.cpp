// OLMo's YAML configs (see olmo_yaml.h).
#include "base/olmo_yaml.h"

#include <glob.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <sstream>

#include "base/common.h"
#include "base/files.h"
#include "base/utf8.h"

namespace trainer {
namespace {

// ---- YAML -> Json ----

// Whether s[i..] starts a run of digits with '_' separators (YAML 1.1: the first a digit); moves i past it.
bool digits(const std::string& s, size_t& i) {
    if (i >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i]))) return false;
    while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '_')) ++i;
    return true;
}

// A plain scalar as OmegaConf's loader (PyYAML's SafeLoader with YAML 1.1 number rules) types it: null,
// true/false, integers ("739_328", "0x1F"), floats with or without a '.' ("4.0e-4", "3e12", ".5"); a
// float JSON cannot hold (.inf, .nan) stays text, for the schema to refuse by name. (Hand-written:
// std::regex trips GCC 12's -Wmaybe-uninitialized in the sanitizer build.)
Json plain_scalar(const std::string& s) {
    if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
    if (s == "true" || s == "True" || s == "TRUE") return true;
    if (s == "false" || s == "False" || s == "FALSE") return false;
    std::string plain;  // without the '_' separators
    for (char c : s) {
        if (c != '_') plain += c;
    }
    size_t i = (s[0] == '+' || s[0] == '-') ? 1 : 0;
    if (s.compare(i, 2, "0x") == 0 && i == 0 && s.size() > 2 &&
        s.find_first_not_of("0123456789abcdefABCDEF_", 2) == std::string::npos) {
        try {
            return std::stoll(plain.substr(2), nullptr, 16);
        } catch (const std::out_of_range&) {
            return s;
        }
    }
    size_t j = i;
    const bool int_part = digits(s, j);
    if (int_part && j == s.size() && (s[i] != '0' || j == i + 1)) {  // an integer (no leading zeros)
        try {
            return std::stoll(plain);
        } catch (const std::out_of_range&) {
            // Beyond an int64: a double where one holds it, else text (over 308 digits), for the schema to refuse.
            try {
                return std::stod(plain);
            } catch (const std::out_of_range&) {
                return s;
            }
        }
    }
    bool is_float = false;
    if (j < s.size() && s[j] == '.') {  // [digits] . [digits] [exponent]
        ++j;
        size_t k = j;
        const bool frac = digits(s, k);
        j = k;
        is_float = int_part || frac;
    } else {
        is_float = int_part;  // digits then a required exponent
        if (j == s.size() || (s[j] != 'e' && s[j] != 'E')) is_float = false;
    }
    if (is_float && j < s.size()) {  // the exponent
        if (s[j] != 'e' && s[j] != 'E') {
            is_float = false;
        } else {
            ++j;
            if (j < s.size() && (s[j] == '+' || s[j] == '-')) ++j;
            const size_t e = j;
            while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
            is_float = j > e && j == s.size();
        }
    }
    if (is_float) {
        try {
            return std::stod(plain);
        } catch (const std::out_of_range&) {
            return s;  // beyond a double: the schema refuses it by name
        }
    }
    return s;
}

// Under the JSON reading policy (base/config.h): at most kMaxJsonDepth levels and kMaxJsonValues values
// once aliases are expanded (nine levels of nine aliases expand to 9^9 values from a few hundred bytes).
Json to_json(const YAML::Node& n, const std::string& path, const std::string& file, int depth, size_t& values) {
    if (++values > kMaxJsonValues) {
        user_error(
            "config file {}: expands to more than {} values (aliases that repeat one another?); a config "
            "holds hundreds",
            file, kMaxJsonValues);
    }
    if (depth > kMaxJsonDepth) user_error("config file {}: {}: nests deeper than {} levels", file, path, kMaxJsonDepth);
    switch (n.Type()) {
        case YAML::NodeType::Null:
        case YAML::NodeType::Undefined:
            return nullptr;
        case YAML::NodeType::Scalar:
            if (invalid_utf8_offset(n.Scalar()) != std::string_view::npos)
                user_error("config file {}: {}: a value that is not valid UTF-8", file, path);
            return n.Tag() == "!" ? Json(n.Scalar()) : plain_scalar(n.Scalar());
        case YAML::NodeType::Sequence: {
            Json a = Json::array();
            for (size_t i = 0; i < n.size(); ++i)
                a.push_back(to_json(n[i], fmt::format("{}[{}]", path, i), file, depth + 1, values));
            return a;
        }
        case YAML::NodeType::Map: {
            Json o = Json::object();
            for (const auto& kv : n) {
                if (!kv.first.IsScalar()) user_error("config file {}: {}: a key that is not a scalar", file, path);
                const std::string key = kv.first.Scalar();
                if (invalid_utf8_offset(key) != std::string_view::npos)
                    user_error("config file {}: {}: a key that is not valid UTF-8", file, path);
                if (o.contains(key))
                    user_error("config file {}: {}{} appears twice", file, path.empty() ? "" : path + ".", key);
                o[key] = to_json(kv.second, path.empty() ? key : path + "." + key, file, depth + 1, values);
            }
            return o;
        }
    }
    return nullptr;
}

// ---- interpolation ----

// Splits `s` at the commas outside ${...}.
std::vector<std::string> split_args(const std::string& s) {
    std::vector<std::string> out;
    int depth = 0;
    std::string cur;
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '$' && i + 1 < s.size() && s[i + 1] == '{') ++depth;
        if (s[i] == '}' && depth > 0) --depth;
        if (s[i] == ',' && depth == 0) {
            out.push_back(cur);
            cur.clear();
        } else {
            cur += s[i];
        }
    }
    out.push_back(cur);
    for (auto& a : out) {
        const size_t b = a.find_first_not_of(' '), e = a.find_last_not_of(' ');
        a = b == std::string::npos ? std::string() : a.substr(b, e - b + 1);
    }
    return out;
}

class Resolver {
   public:
    static constexpr size_t kMaxInterpolatedText = 1 << 20;

    Resolver(Json& root, const std::string& file) : root_(root), file_(file) {}

    void resolve_all() { walk(root_, ""); }

   private:
    void walk(Json& v, const std::string& path) {
        if (v.is_object()) {
            for (auto it = v.begin(); it != v.end(); ++it)
                walk(it.value(), path.empty() ? it.key() : path + "." + it.key());
        } else if (v.is_array()) {
            for (size_t i = 0; i < v.size(); ++i) walk(v[i], fmt::format("{}[{}]", path, i));
        } else if (v.is_string() && v.get<std::string>().find("${") != std::string::npos) {
            v = value_of(v.get<std::string>(), path, 0);
        }
    }

    // The value of a string with interpolations: the referenced value itself when the string is exactly
    // one ${...}, else the text with each one replaced.
    Json value_of(const std::string& s, const std::string& key, int depth) {
        if (depth > 32) user_error("config file {}: {}: interpolations nest too deep (a cycle?)", file_, key);
        size_t end = 0;
        if (s.compare(0, 2, "${") == 0 && (end = closing(s, 0, key)) == s.size() - 1) {
            return evaluate(s.substr(2, end - 2), key, depth);
        }
        std::string out;
        for (size_t i = 0; i < s.size();) {
            if (s.compare(i, 2, "${") == 0) {
                const size_t e = closing(s, i, key);
                const Json v = evaluate(s.substr(i + 2, e - i - 2), key, depth);
                out += v.is_string() ? v.get<std::string>() : json_text(v);
                if (out.size() > kMaxInterpolatedText) {
                    user_error(
                        "config file {}: {}: interpolation makes a text longer than {} bytes (references "
                        "that repeat one another?)",
                        file_, key, kMaxInterpolatedText);
                }
                i = e + 1;
            } else {
                out += s[i++];
            }
        }
        return out;
    }

    size_t closing(const std::string& s, size_t open, const std::string& key) const {
        int depth = 0;
        for (size_t i = open; i < s.size(); ++i) {
            if (s.compare(i, 2, "${") == 0)
                ++depth, ++i;
            else if (s[i] == '}' && --depth == 0)
                return i;
        }
        user_error("config file {}: {}: unclosed ${{ in \"{}\"", file_, key, s);
    }

    std::string text_of(const std::string& arg, const std::string& key, int depth) {
        const Json v = value_of(arg, key, depth + 1);
        return v.is_string() ? v.get<std::string>() : json_text(v);
    }

    Json evaluate(const std::string& expr, const std::string& key, int depth) {
        if (++evaluated_ > kMaxJsonValues) {  // references repeated at every level: exponential work
            user_error(
                "config file {}: {}: more than {} interpolations to evaluate (references that repeat one "
                "another?)",
                file_, key, kMaxJsonValues);
        }
        const size_t colon = expr.find(':');
        const std::string head = colon == std::string::npos ? expr : expr.substr(0, colon);
        if (head == "oc.env") {
            const auto args = split_args(expr.substr(colon + 1));
            const char* env = std::getenv(args[0].c_str());
            if (env != nullptr) return std::string(env);
            if (args.size() > 1) return value_of(args[1], key, depth + 1);
            user_error("config file {}: {}: environment variable {} is not set (and ${{oc.env:{}}} has no default)",
                       file_, key, args[0], args[0]);
        }
        if (head == "path.choose") {
            std::vector<std::string> paths;
            for (const auto& a : split_args(expr.substr(colon + 1))) {
                const std::string p = text_of(a, key, depth);
                if (is_url(p) || path_exists(p)) return p;
                paths.push_back(p);
            }
            user_error(
                "config file {}: {}: ${{path.choose:...}} found none of {} (as OLMo, which would stop too); "
                "set {} on the command line",
                file_, key, fmt::join(paths, ", "), key);
        }
        if (head == "path.glob") {
            Json out = Json::array();
            for (const auto& a : split_args(expr.substr(colon + 1))) {
                const std::string pattern = text_of(a, key, depth);
                glob_t g{};
                if (::glob(pattern.c_str(), 0, nullptr, &g) == 0) {
                    for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back(std::string(g.gl_pathv[i]));
                }
                globfree(&g);
            }
            return out;
        }
        if (colon != std::string::npos) {
            user_error(
                "config file {}: {}: the resolver {} is not one this trainer knows (oc.env, path.choose, "
                "path.glob)",
                file_, key, head);
        }
        // A key path, absolute from the root (OmegaConf's default).
        const Json* v = &root_;
        std::string part;
        std::stringstream ss(expr);
        while (std::getline(ss, part, '.')) {
            if (v->is_object() && v->contains(part)) {
                v = &(*v)[part];
            } else if (v->is_array() && !part.empty() && part.find_first_not_of("0123456789") == std::string::npos &&
                       std::stoul(part) < v->size()) {
                v = &(*v)[std::stoul(part)];
            } else {
                user_error("config file {}: {}: ${{{}}} names no key of the config", file_, key, expr);
            }
        }
        if (v->is_string() && v->get<std::string>().find("${") != std::string::npos) {
            return value_of(v->get<std::string>(), expr, depth + 1);
        }
        // Copies of copies multiply like aliases: the values copied count against the same bound.
        copied_ += count_values(*v);
        if (copied_ > kMaxJsonValues) {
            user_error(
                "config file {}: {}: interpolations copy more than {} values (references that repeat one "
                "another?); a config holds hundreds",
                file_, key, kMaxJsonValues);
        }
        return *v;
    }

    static size_t count_values(const Json& v) {
        size_t n = 1;
        if (v.is_structured()) {
            for (const auto& e : v) n += count_values(e);
        }
        return n;
    }

    Json& root_;
    std::string file_;
    size_t copied_ = 0, evaluated_ = 0;
};

}  // namespace

bool is_yaml_config_path(const std::string& path) {
    auto ends = [&](const std::string& ext) {
        return path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
    };
    return ends(".yaml") || ends(".yml");
}

Json read_yaml_config(const std::string& path) {
    YAML::Node root;
    try {
        root = YAML::LoadFile(path);
    } catch (const YAML::BadFile&) {
        user_error("config file {}: cannot be read", path);
    } catch (const YAML::Exception& e) {
        user_error("config file {}: not valid YAML at line {}, column {}: {}", path, e.mark.line + 1, e.mark.column + 1,
                   e.msg);
    }
    size_t values = 0;
    Json doc = to_json(root, "", path, 0, values);
    if (!doc.is_object()) user_error("config file {}: expected a mapping at the top level", path);
    return doc;
}

void resolve_olmo_interpolations(Json& doc, const std::string& path) { Resolver(doc, path).resolve_all(); }

}  // namespace trainer
