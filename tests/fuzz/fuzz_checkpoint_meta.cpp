// A checkpoint's metadata.json (runs expanded, fuzz_common.h): read as the loader reads it, then the
// structure check every loader runs first.
#include "core/weights/checkpoint_meta.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string path = fuzz::as_file(fuzz::expand(data, size), ".json");
    fuzz::expect_user_errors_only([&] {
        const trainer::Json meta = trainer::read_json_file(path, "checkpoint");
        trainer::check_checkpoint_metadata(meta, "fuzz");
        fuzz::check_dumps(meta);
    });
    return 0;
}
