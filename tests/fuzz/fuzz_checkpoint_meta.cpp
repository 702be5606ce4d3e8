// A checkpoint's metadata.json: read as the loader reads it, then the structure check every loader runs first.
#include "core/checkpoint_meta.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string path = fuzz::as_file(data, size, ".json");
    fuzz::expect_user_errors_only([&] {
        const trainer::Json meta = trainer::read_json_file(path, "checkpoint");
        trainer::check_checkpoint_metadata(meta, "fuzz");
    });
    return 0;
}
