# ctest driver for a libFuzzer binary (tests/fuzz/CMakeLists.txt):
#   cmake -DFUZZER=<binary> -DSEEDS=<committed corpus> -DWORK=<scratch dir> -DSECONDS=<n>
#         [-DDICT=<file>] -P run_fuzzer.cmake
# New inputs go to WORK/corpus (a copy of the seeds, refreshed each run) so the committed
# corpus is never modified; crash/leak/timeout reproducers go to WORK/artifacts.
foreach(var FUZZER SEEDS WORK SECONDS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_fuzzer.cmake: ${var} not set")
  endif()
endforeach()

file(REMOVE_RECURSE ${WORK}/corpus)
file(MAKE_DIRECTORY ${WORK}/corpus ${WORK}/artifacts)
file(GLOB seeds ${SEEDS}/*)
file(COPY ${seeds} DESTINATION ${WORK}/corpus)

# -entropic_scale_per_exec_time: inputs that build multi-megabyte streams run ~1000x slower
# than the rest; without it they take most of the time (about 10x fewer executions).
set(args -max_total_time=${SECONDS} -timeout=5 -rss_limit_mb=2048 -print_final_stats=1
         -entropic_scale_per_exec_time=1 -artifact_prefix=${WORK}/artifacts/)
if(DICT)
  list(APPEND args -dict=${DICT})
endif()
execute_process(COMMAND ${FUZZER} ${args} ${WORK}/corpus ${SEEDS}
                WORKING_DIRECTORY ${WORK} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${FUZZER} failed (${rc}); reproducer in ${WORK}/artifacts/, rerun with: "
                      "${FUZZER} ${WORK}/artifacts/<file>")
endif()
