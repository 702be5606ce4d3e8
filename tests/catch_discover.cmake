# Registers each TEST_CASE of a Catch2 v2 executable as its own CTest test, read from the sources
# at configure time (Catch2 v2's ParseAndAddCatchTests is deprecated and not shipped by Debian).
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
    file(STRINGS ${abs} lines REGEX "^TEST_CASE\\(\"")
    foreach(line ${lines})
      string(REGEX MATCH "^TEST_CASE\\(\"([^\"]+)\"" _ ${line})
      set(name ${CMAKE_MATCH_1})
      add_test(NAME "${name}" COMMAND ${target} "${name}" --warn NoTests)
      # A case that cannot run here says WARN("skipped: why") and returns (Catch2 v2 has no SKIP): CTest reports it
      # skipped, not passed.
      set_tests_properties("${name}" PROPERTIES TIMEOUT 300 SKIP_REGULAR_EXPRESSION "warning:\n +skipped: ")
      # Tagged [serial]: a test that measures something the other tests' load would change runs alone.
      if(line MATCHES "\"\\[serial\\]\"")
        set_tests_properties("${name}" PROPERTIES RUN_SERIAL TRUE)
      endif()
    endforeach()
  endforeach()
endfunction()
