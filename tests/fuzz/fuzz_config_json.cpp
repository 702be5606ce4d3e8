// The JSON config reader and validation: any bytes as a --config file.
#include "base/config.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string path = fuzz::as_file(data, size, ".json");
    fuzz::expect_user_errors_only([&] { (void)trainer::validate_config(trainer::read_config_file(path)); });
    return 0;
}
