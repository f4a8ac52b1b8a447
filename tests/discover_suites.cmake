# Run after each build of a gtest binary (tests/CMakeLists.txt, lm_test): lists its test suites
# (--gtest_list_tests) and writes OUT, a CTest file with one test per suite, NAME.Suite, run as
# `EXE --gtest_filter=Suite.*` with the properties macro _lm_props_NAME (defined by the binary's
# include file). A binary that cannot list its tests (it needs files that are not there yet) gets
# one entry for the whole binary, NAME, with a warning: the build does not fail over it.
execute_process(COMMAND "${EXE}" --gtest_list_tests
  OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(WARNING "${EXE} --gtest_list_tests failed (${rc}): one ctest entry for the binary\n${errors}")
  file(WRITE "${OUT}" "add_test([==[${NAME}]==] [==[${EXE}]==])\n_lm_props_${NAME}([==[${NAME}]==])\n")
  return()
endif()
string(REPLACE ";" "," listing "${listing}")  # parameter descriptions may hold ';'
string(REPLACE "\n" ";" lines "${listing}")
set(body "# Generated from ${EXE} --gtest_list_tests by tests/discover_suites.cmake.\n")
set(count 0)
foreach(line IN LISTS lines)
  # Suite lines start in column 0 and end with '.', optionally followed by a TypeParam comment.
  if(line MATCHES "^([^ #][^ ]*)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND body
      "add_test([==[${NAME}.${suite}]==] [==[${EXE}]==] [==[--gtest_filter=${suite}.*]==])\n"
      "_lm_props_${NAME}([==[${NAME}.${suite}]==])\n")
    math(EXPR count "${count} + 1")
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "${EXE} lists no test suites")
endif()
file(WRITE "${OUT}" "${body}")
