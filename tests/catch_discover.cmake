# Tags become CTest labels: [serial] runs alone (a test that measures something the other tests' load would change);
# [heavy] is left out of the sanitizer pass (CMakePresets.json's cpu-asan filters the label): a case at sizes too
# slow there whose code paths the lighter cases run under the sanitizers. `ctest -L heavy` lists them.
function(trainer_register_catch_test target name tags)
  add_test(NAME "${name}" COMMAND ${target} "${name}" --warn NoTests)
  # A case that cannot run here says WARN("skipped: why") and returns (Catch2 v2 has no SKIP): CTest reports it
  # skipped, not passed.
  set_tests_properties("${name}" PROPERTIES TIMEOUT 300 SKIP_REGULAR_EXPRESSION "warning:\n +skipped: ")
  string(REGEX MATCHALL "\\[[^]]+\\]" found "${tags}")
  set(labels "")
  foreach(tag ${found})
    string(REGEX REPLACE "^\\[|\\]$" "" label "${tag}")
    list(APPEND labels ${label})
  endforeach()
  if(labels)
    set_tests_properties("${name}" PROPERTIES LABELS "${labels}")
  endif()
  if("serial" IN_LIST labels)
    set_tests_properties("${name}" PROPERTIES RUN_SERIAL TRUE)
  endif()
endfunction()

# Registers each TEST_CASE of a Catch2 v2 executable as its own CTest test, read from the sources at configure time
# (Catch2 v2's ParseAndAddCatchTests is deprecated and not shipped by Debian): the name on the TEST_CASE( line, the
# tags on it or, where clang-format wrapped them, alone on the next line.
function(trainer_discover_catch_tests target)
  get_target_property(sources ${target} SOURCES)
  foreach(src ${sources})
    get_filename_component(abs ${src} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${abs})
    # A name clang-format wrapped onto the next line would not be registered: refuse it.
    file(STRINGS ${abs} wrapped REGEX "^TEST_CASE\\($")
    if(wrapped)
      message(FATAL_ERROR "${abs}: a TEST_CASE name must start on the TEST_CASE( line (shorten it)")
    endif()
    file(STRINGS ${abs} lines REGEX "^TEST_CASE\\(\"|^ +\"(\\[[^]\"]+\\])+\"\\) \\{")
    set(name "")
    set(tags "")
    foreach(line ${lines})
      if(line MATCHES "^TEST_CASE\\(\"([^\"]+)\"(, *\"([^\"]*)\")?")
        if(name)
          trainer_register_catch_test(${target} "${name}" "${tags}")
        endif()
        set(name ${CMAKE_MATCH_1})
        set(tags "${CMAKE_MATCH_3}")
      elseif(name AND line MATCHES "\"([^\"]+)\"")
        set(tags "${CMAKE_MATCH_1}")
      endif()
    endforeach()
    if(name)
      trainer_register_catch_test(${target} "${name}" "${tags}")
    endif()
  endforeach()
endfunction()
