// OLMo's YAML config reader: YAML parsing (aliases included), interpolation, the OLMo key mapping, then
// validation, on any bytes (runs expanded, fuzz_common.h); what validates is dumped as a checkpoint's
// metadata would dump it. dev/fuzz.sh bounds the memory (-rss_limit_mb), which an alias bomb passes.
#include "base/config.h"
#include "base/olmo_yaml.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string path = fuzz::as_file(fuzz::expand(data, size), ".yaml");
    fuzz::expect_user_errors_only([&] {
        trainer::Json doc = trainer::read_yaml_config(path);
        trainer::finish_olmo_config(doc, path, false);
        fuzz::check_dumps(trainer::config_json(trainer::validate_config(doc)));
    });
    return 0;
}
