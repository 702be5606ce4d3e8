# Registers each TEST_CASE of a Catch2 v2 executable as its own CTest test, as the executable lists them after each
# build (catch_list.cmake; Catch2 v2's ParseAndAddCatchTests is deprecated and not shipped by Debian, and reading the
# sources would miss cases a macro makes, such as tests/gpu's kernel families). `ctest -N` lists them once built.
function(trainer_discover_catch_tests target)
  set(listed "${CMAKE_CURRENT_BINARY_DIR}/${target}_tests.cmake")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -D "EXECUTABLE=$<TARGET_FILE:${target}>" -D "OUTPUT=${listed}"
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
