// The safetensors reader (--init-from): any bytes (runs expanded, fuzz_common.h) as a .safetensors file.
#include "core/weights/safetensors.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string path = fuzz::as_file(fuzz::expand(data, size), ".safetensors");
    fuzz::expect_user_errors_only([&] {
        std::map<std::string, std::string> meta;
        for (const auto& [name, t] : trainer::read_safetensors(path, &meta)) {
            if (static_cast<int64_t>(t.data.size()) != t.numel()) std::abort();  // the reader's own promise
        }
    });
    return 0;
}
