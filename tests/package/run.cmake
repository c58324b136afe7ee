# Installs the built Loom into a temporary prefix, then
#  - configures, builds and runs tests/package as an outside project would (find_package(Loom), Loom::loom, whose
#    cxx_std_20 alone makes it C++20);
#  - runs the installed apps without LD_LIBRARY_PATH (their RPATH finds the prefix's lib/): loom-train --help, and
#    loom-conformance from a directory outside the tree, which finds its cases in <prefix>/share/loom/conformance;
#    the installed sample plugin under loom-conformance; and a policy naming an unknown provider (LOOM_PROVIDERS),
#    which both apps report as one line and a non-zero exit.
#  - imports the installed Python package from the prefix, when the build has one.
# Arguments: -DBUILD_DIR=<Loom build> -DSRC=<this folder> -DWORK=<scratch>; with the Python package, -DPYTHON=<its
# interpreter> -DPYTHON_DIR=<its folder under the prefix>
file(REMOVE_RECURSE ${WORK})
set(prefix ${WORK}/prefix)
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC} -B ${WORK}/build -G Ninja -DCMAKE_PREFIX_PATH=${prefix}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed:\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "building the consumer failed:\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/lib ${WORK}/build/consumer
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc OR NOT out MATCHES "4x8")
  message(FATAL_ERROR "the consumer failed (${rc}): ${out}")
endif()

# ---- The installed apps. ----
# Runs an installed app with a clean library path from `dir`; sets rc, out (stdout) and err (stderr).
function(run_installed dir)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH --unset=LOOM_PROVIDERS
                          --unset=LOOM_PROVIDERS_FILE --unset=LOOM_PROVIDER_PATH ${ARGN}
                  WORKING_DIRECTORY ${dir} RESULT_VARIABLE r OUTPUT_VARIABLE o ERROR_VARIABLE e)
  set(rc "${r}" PARENT_SCOPE)
  set(out "${o}" PARENT_SCOPE)
  set(err "${e}" PARENT_SCOPE)
endfunction()

find_program(READELF readelf)
if(READELF)
  execute_process(COMMAND ${READELF} -d ${prefix}/bin/loom-conformance OUTPUT_VARIABLE out)
  if(NOT out MATCHES "R(UN)?PATH[^\n]*\\$ORIGIN/\\.\\./lib")
    message(FATAL_ERROR "installed loom-conformance has no $ORIGIN/../lib run path:\n${out}")
  endif()
endif()

run_installed(${WORK} ${prefix}/bin/loom-train --help)
if(rc OR NOT out MATCHES "--train-data")
  message(FATAL_ERROR "installed loom-train --help failed (${rc}): ${out}${err}")
endif()

# A working directory with no conformance/ in or above it: the cases must come from the prefix.
if(DEFINED ENV{TMPDIR} AND IS_DIRECTORY "$ENV{TMPDIR}")
  set(outside "$ENV{TMPDIR}")
else()
  set(outside /tmp)
endif()
string(RANDOM LENGTH 8 _suffix)
set(outside ${outside}/loom_package_cwd_${_suffix})
file(MAKE_DIRECTORY ${outside})
run_installed(${outside} ${prefix}/bin/loom-conformance --provider native --op add --dtype f32)
string(FIND "${out}" "${prefix}/share/loom/conformance/reference/pytorch_refs.json" found)
if(rc OR found EQUAL -1)
  file(REMOVE_RECURSE ${outside})
  message(FATAL_ERROR "installed loom-conformance without --cases (exit ${rc}) did not run the cases in "
                      "${prefix}/share/loom/conformance:\n${out}${err}")
endif()

if(EXISTS ${prefix}/lib/loom/plugins/libloom_cpu_sample.so)
  run_installed(${outside} ${prefix}/bin/loom-conformance --provider cpu_sample
                --load ${prefix}/lib/loom/plugins/libloom_cpu_sample.so --op add --dtype f32)
  if(rc OR NOT out MATCHES "provider cpu_sample")
    file(REMOVE_RECURSE ${outside})
    message(FATAL_ERROR "installed loom-conformance on the installed cpu_sample failed (${rc}):\n${out}${err}")
  endif()
endif()

# A policy naming a provider that does not exist: one line on stderr, a non-zero exit.
set(expected "LOOM_PROVIDERS names provider 'cpu_smaple', which no kernel is registered under; providers: [^\n]*native")
run_installed(${outside} ${CMAKE_COMMAND} -E env LOOM_PROVIDERS=cpu_smaple:gemm
              ${prefix}/bin/loom-conformance --provider native --op add --dtype f32)
if(NOT rc OR NOT err MATCHES "^loom-conformance: error: ${expected}[^\n]*\n$")
  file(REMOVE_RECURSE ${outside})
  message(FATAL_ERROR "loom-conformance with LOOM_PROVIDERS=cpu_smaple:gemm (exit ${rc}):\n${out}${err}")
endif()
run_installed(${outside} ${CMAKE_COMMAND} -E env LOOM_PROVIDERS=cpu_smaple ${prefix}/bin/loom-train --model d1
              --train-data ${outside}/none.bin --steps 1 --warmup 0)
if(NOT rc OR NOT err MATCHES "^loom-train: error: ${expected}[^\n]*\n$")
  file(REMOVE_RECURSE ${outside})
  message(FATAL_ERROR "loom-train with LOOM_PROVIDERS=cpu_smaple (exit ${rc}):\n${out}${err}")
endif()

# The installed Python package (when built): imported from the prefix by the interpreter it was built for, it finds
# the prefix's libloom.so by itself.
if(PYTHON AND PYTHON_DIR AND EXISTS ${prefix}/${PYTHON_DIR}/loom/__init__.py)
  run_installed(${outside} ${CMAKE_COMMAND} -E env --unset=PYTHONPATH PYTHONPATH=${prefix}/${PYTHON_DIR} ${PYTHON} -c
                "import loom\nprint(loom.__file__)\nprint(loom.ones(2, 3).sum().item())")  # no ';': it splits arguments
  if(rc OR NOT out MATCHES "^${prefix}/${PYTHON_DIR}/loom/__init__.py\n6.0\n$")
    file(REMOVE_RECURSE ${outside})
    message(FATAL_ERROR "the installed Python package (exit ${rc}):\n${out}${err}")
  endif()
endif()

file(REMOVE_RECURSE ${outside})
file(REMOVE_RECURSE ${WORK})
