// The token-file readers: raw memmap (uint16 and uint32), .npy and llm.c shards, detected by header.
#include "core/data/data.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string path = fuzz::as_file(data, size, size > 0 && data[0] == 0x93 ? ".npy" : ".bin");
    for (auto dtype : {trainer::TokenDtype::kUint16, trainer::TokenDtype::kUint32}) {
        fuzz::expect_user_errors_only([&] {
            const trainer::TokenFile file(path, dtype);
            const int64_t n = file.num_tokens();
            if (n <= 0) std::abort();  // the reader promises at least one token
            uint32_t buf[16];
            const int64_t count = std::min<int64_t>(16, n);
            file.read_tokens(n - count, count, buf);  // the last tokens lie inside the mapping
            (void)file.token(0);
        });
    }
    return 0;
}
