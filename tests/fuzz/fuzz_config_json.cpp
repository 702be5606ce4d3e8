// The JSON config reader and validation: any bytes (runs expanded, fuzz_common.h) as a --config file, or,
// when the input starts with "--set ", each of its lines as a --set override of a valid config. What
// validates is dumped as a checkpoint's metadata would dump it.
#include "base/config.h"
#include "fuzz_common.h"

namespace {
const char* kBase = R"({"run_name": "fuzz", "model": {"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 257,
  "max_sequence_length": 65}, "global_train_batch_size": 8, "device_train_microbatch_size": 4, "max_duration": 30,
  "data": {"paths": ["tokens.bin"]}})";
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string text = fuzz::expand(data, size);
    fuzz::expect_user_errors_only([&] {
        trainer::Json doc;
        if (text.rfind("--set ", 0) == 0) {
            doc = trainer::Json::parse(kBase);
            size_t at = 0;
            while (at < text.size()) {
                size_t end = text.find('\n', at);
                if (end == std::string::npos) end = text.size();
                const std::string line = text.substr(at, end - at);
                if (line.rfind("--set ", 0) == 0) trainer::apply_override(doc, line.substr(6));
                at = end + 1;
            }
        } else {
            doc = trainer::read_config_file(fuzz::as_file(text, ".json"));
        }
        fuzz::check_dumps(trainer::config_json(trainer::validate_config(doc)));
    });
    return 0;
}
