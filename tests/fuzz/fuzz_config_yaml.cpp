// OLMo's YAML config reader: YAML parsing, interpolation, the OLMo key mapping, then validation.
#include "base/config.h"
#include "base/olmo_yaml.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string path = fuzz::as_file(data, size, ".yaml");
    fuzz::expect_user_errors_only([&] {
        trainer::Json doc = trainer::read_yaml_config(path);
        trainer::finish_olmo_config(doc, path, false);
        (void)trainer::validate_config(doc);
    });
    return 0;
}
