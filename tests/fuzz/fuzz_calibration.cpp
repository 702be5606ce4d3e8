// The plan's calibration files (runs expanded, fuzz_common.h): bench-kernels' op times, or (the first input byte
// odd) bench-comm's measured links, read as `trainer plan --calibration` and `--comm-calibration` read them.
#include "core/plan/calibration.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string path = fuzz::as_file(fuzz::expand(data, size), ".json");
    fuzz::expect_user_errors_only([&] {
        if (size > 0 && data[0] % 2 == 1) {
            const trainer::CommCalibration c = trainer::read_comm_calibration(path);
            if (c.intra.empty() && c.inter.empty()) std::abort();  // the reader promises a measured group
        } else {
            const trainer::Calibration c = trainer::read_calibration(path);
            for (const auto& e : c.entries) {
                if (e.op.empty() || !(e.seconds > 0.0)) std::abort();  // the reader promises each entry's time
            }
        }
    });
    return 0;
}
