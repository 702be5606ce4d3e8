// The one Catch2 main of the unit tests (compiled once; the test files only include catch.hpp).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
