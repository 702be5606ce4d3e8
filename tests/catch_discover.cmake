# Registers each TEST_CASE of a Catch2 v2 executable as its own CTest test, as the executable lists them after each
# build (catch_list.cmake; Catch2 v2's ParseAndAddCatchTests is deprecated and not shipped by Debian, and reading the
# sources would miss cases a macro makes, such as tests/gpu's kernel families). `ctest -N` lists them once built.
# Options: TEST_SPEC, the Catch2 test spec of the cases to register (all by default); PREFIX, a word before each CTest
# name (the Catch2 name is what runs); ENVIRONMENT, variables each case runs with; LABELS, added to each case's tags;
# TIMEOUT, each case's seconds (300 by default); COST, each case's expected seconds, which `ctest -j` starts longest
# first (a clean build's first run has no times of its own, and runs the cases in the order registered otherwise).
function(trainer_discover_catch_tests target)
  cmake_parse_arguments(D "" "TEST_SPEC;PREFIX;TIMEOUT;COST" "ENVIRONMENT;LABELS" ${ARGN})
  set(listed "${CMAKE_CURRENT_BINARY_DIR}/${target}_tests.cmake")
  string(REPLACE ";" "," environment "${D_ENVIRONMENT}")
  string(REPLACE ";" "," labels "${D_LABELS}")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -D "EXECUTABLE=$<TARGET_FILE:${target}>" -D "OUTPUT=${listed}"
            -D "TEST_SPEC=${D_TEST_SPEC}" -D "PREFIX=${D_PREFIX}" -D "ENVIRONMENT=${environment}"
            -D "EXTRA_LABELS=${labels}" -D "TIMEOUT=${D_TIMEOUT}" -D "COST=${D_COST}"
            -P "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/catch_list.cmake"
    BYPRODUCTS "${listed}" VERBATIM)
  # The list is made anew when the script changes too.
  set_property(TARGET ${target} APPEND PROPERTY LINK_DEPENDS "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/catch_list.cmake")
  # Before the first build there is no list: one test says so.
  set(include "${CMAKE_CURRENT_BINARY_DIR}/${target}_include.cmake")
  file(WRITE "${include}" "if(EXISTS [==[${listed}]==])\n  include([==[${listed}]==])\nelse()\n"
       "  add_test(${target}_NOT_BUILT [==[${target} is not built: build it first]==])\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include}")
endfunction()
