# The optional `infiniops` provider (src/providers/infiniops/): InfiniTensor's InfiniOps operator library, built as it
# ships, with its runtime InfiniRT, into the build directory, and bridged to Loom's ops.
#
#   -DLOOM_INFINIOPS=ON|OFF           default ON when the sources are found, else skipped with one STATUS line
#   -DLOOM_INFINIOPS_SOURCE=<dir>     a folder with infiniops-*.tar.gz and infinirt-*.tar.gz (or unpacked infiniops/
#                                     and infinirt/ folders); default ${PROJECT_SOURCE_DIR}/../shared/third_party
#   -DLOOM_INFINIOPS_ROOT=<prefix>    an installed InfiniOps + InfiniRT prefix instead (lib/libinfiniops.so,
#                                     lib/libinfinirt.so, include/infini/operator_call_instantiations.h)
#   -DLOOM_INFINIOPS_NVIDIA=ON        also build InfiniOps' NVIDIA backend (needs LOOM_CUDA and CUTLASS headers:
#                                     cutlass-*-include.tar.gz beside the sources, or -DLOOM_INFINIOPS_CUTLASS=<dir>)
#
# The sources are unpacked into <build>/_deps/infiniops/ (InfiniOps writes generated files into its source tree, so
# never into the given folder) and configured, built and installed there at configure time: Loom's provider needs
# the generated list of operator instantiations to know what it can call. A stamp skips the work on a reconfigure
# with the same inputs.

set(LOOM_INFINIOPS_SOURCE "" CACHE PATH "Folder with the InfiniOps and InfiniRT snapshots (tarballs or unpacked)")
set(LOOM_INFINIOPS_ROOT "" CACHE PATH "An installed InfiniOps + InfiniRT prefix (instead of building the sources)")
set(LOOM_INFINIOPS_CUTLASS "" CACHE PATH "CUTLASS source folder (with include/cutlass) for InfiniOps' NVIDIA build")

# ---- Find the inputs. ----
set(_io_src_dir "${LOOM_INFINIOPS_SOURCE}")
if(NOT _io_src_dir AND EXISTS "${PROJECT_SOURCE_DIR}/../shared/third_party")
  get_filename_component(_io_src_dir "${PROJECT_SOURCE_DIR}/../shared/third_party" ABSOLUTE)
endif()

# Sets <var> to the snapshot of `name` in _io_src_dir: an unpacked folder <name>/, or the newest <name>-*.tar.gz.
function(_loom_io_find var name)
  set(${var} "" PARENT_SCOPE)
  if(NOT _io_src_dir)
    return()
  endif()
  if(EXISTS "${_io_src_dir}/${name}/CMakeLists.txt")
    set(${var} "${_io_src_dir}/${name}" PARENT_SCOPE)
    return()
  endif()
  file(GLOB _tars "${_io_src_dir}/${name}-*.tar.gz")
  list(FILTER _tars EXCLUDE REGEX "-include\\.tar\\.gz$")
  if(_tars)
    list(SORT _tars)
    list(GET _tars -1 _tar)
    set(${var} "${_tar}" PARENT_SCOPE)
  endif()
endfunction()

set(_io_found OFF)
if(LOOM_INFINIOPS_ROOT)
  if(EXISTS "${LOOM_INFINIOPS_ROOT}/include/infini/operator_call_instantiations.h")
    set(_io_found ON)
  endif()
else()
  _loom_io_find(_io_ops_in infiniops)
  _loom_io_find(_io_rt_in infinirt)
  if(_io_ops_in AND _io_rt_in)
    set(_io_found ON)
  endif()
endif()

option(LOOM_INFINIOPS "Build the infiniops provider (InfiniOps + InfiniRT from their snapshots)" ${_io_found})
# NVIDIA is its own switch, on by default only where Loom's CUDA is on and a GPU is visible: InfiniOps' NVIDIA
# backend (49 operators, CUTLASS and cuBLAS through nvcc) builds with CUDA 13 but took 12 min (738 s, one job beside
# other builds) on 2 cores without a GPU (as in CI), where it cannot run.
set(_io_nv_default OFF)
if(LOOM_CUDA AND EXISTS /dev/nvidia0)
  set(_io_nv_default ON)
endif()
option(LOOM_INFINIOPS_NVIDIA "Also build InfiniOps' NVIDIA backend and serve Loom's CUDA ops through it" ${_io_nv_default})

if(NOT LOOM_INFINIOPS)
  if(_io_found)
    message(STATUS "Loom: infiniops provider off (-DLOOM_INFINIOPS=OFF)")
  else()
    message(STATUS "Loom: infiniops provider skipped: no InfiniOps/InfiniRT snapshots found (give "
                   "-DLOOM_INFINIOPS_SOURCE=<dir> or -DLOOM_INFINIOPS_ROOT=<prefix>)")
  endif()
  return()
endif()
if(NOT _io_found)
  message(FATAL_ERROR "LOOM_INFINIOPS is ON but no InfiniOps/InfiniRT was found: -DLOOM_INFINIOPS_SOURCE='${_io_src_dir}' "
                      "has no infiniops-*.tar.gz + infinirt-*.tar.gz (or infiniops/ + infinirt/), and "
                      "-DLOOM_INFINIOPS_ROOT='${LOOM_INFINIOPS_ROOT}' has no include/infini/operator_call_instantiations.h")
endif()
if(LOOM_INFINIOPS_NVIDIA AND NOT LOOM_CUDA)
  message(FATAL_ERROR "LOOM_INFINIOPS_NVIDIA needs Loom's CUDA backend (-DLOOM_CUDA=ON)")
endif()

# ---- Build it (unless given a prefix). ----
if(LOOM_INFINIOPS_ROOT)
  set(_io_prefix "${LOOM_INFINIOPS_ROOT}")
else()
  set(_io_work "${CMAKE_BINARY_DIR}/_deps/infiniops")
  set(_io_prefix "${_io_work}/prefix")
  set(_io_backends -DWITH_CPU=ON)
  set(_io_cutlass "")
  if(LOOM_INFINIOPS_NVIDIA)
    set(_io_cutlass "${LOOM_INFINIOPS_CUTLASS}")
    if(NOT _io_cutlass)
      file(GLOB _io_cutlass_tar "${_io_src_dir}/cutlass-*-include.tar.gz")
      if(NOT _io_cutlass_tar)
        message(FATAL_ERROR "LOOM_INFINIOPS_NVIDIA: no CUTLASS headers (cutlass-*-include.tar.gz in '${_io_src_dir}' "
                            "or -DLOOM_INFINIOPS_CUTLASS=<dir with include/cutlass>); InfiniOps would download them")
      endif()
      list(GET _io_cutlass_tar 0 _io_cutlass_tar)
      set(_io_cutlass_tar_in "${_io_cutlass_tar}")
    endif()
    # Loom's own architectures, through an initial-cache file (a list in a -D argument would split).
    set(_io_archs_file "${CMAKE_BINARY_DIR}/_deps/infiniops-cuda-architectures.cmake")
    file(WRITE "${_io_archs_file}" "set(CMAKE_CUDA_ARCHITECTURES \"${CMAKE_CUDA_ARCHITECTURES}\" CACHE STRING \"\")\n")
    set(_io_backends -DWITH_CPU=ON -DWITH_NVIDIA=ON -C "${_io_archs_file}"
        -DCMAKE_CUDA_COMPILER=${CMAKE_CUDA_COMPILER})
  endif()

  # What the stamp covers: the inputs (path, size, time) and the backends.
  set(_io_key "rpath-origin;${_io_backends};${CMAKE_CUDA_ARCHITECTURES};${_io_cutlass};${_io_cutlass_tar_in}"
              "${CMAKE_CXX_COMPILER}")
  foreach(_in ${_io_ops_in} ${_io_rt_in} ${_io_cutlass_tar_in})
    file(TIMESTAMP "${_in}" _t)
    file(SIZE "${_in}" _s)
    string(APPEND _io_key ";${_in}@${_t}#${_s}")
  endforeach()
  set(_io_stamp "${_io_work}/stamp.txt")
  set(_io_old_key "")
  if(EXISTS "${_io_stamp}")
    file(READ "${_io_stamp}" _io_old_key)
  endif()

  if(NOT _io_old_key STREQUAL _io_key OR NOT EXISTS "${_io_prefix}/include/infini/operator_call_instantiations.h")
    string(TIMESTAMP _io_t0 "%s")
    file(REMOVE_RECURSE "${_io_work}")
    file(MAKE_DIRECTORY "${_io_work}/src")
    # A writable copy of each source tree: InfiniOps generates files into its own and InfiniRT's.
    function(_loom_io_unpack in out)
      if(IS_DIRECTORY "${in}")
        file(COPY "${in}/" DESTINATION "${out}")
      else()
        file(MAKE_DIRECTORY "${out}")
        file(ARCHIVE_EXTRACT INPUT "${in}" DESTINATION "${out}.tmp")
        file(GLOB _top "${out}.tmp/*")
        list(LENGTH _top _n)
        if(_n EQUAL 1 AND IS_DIRECTORY "${_top}")
          file(COPY "${_top}/" DESTINATION "${out}")
        else()
          file(COPY "${out}.tmp/" DESTINATION "${out}")
        endif()
        file(REMOVE_RECURSE "${out}.tmp")
      endif()
    endfunction()
    _loom_io_unpack("${_io_rt_in}" "${_io_work}/src/infinirt")
    _loom_io_unpack("${_io_ops_in}" "${_io_work}/src/infiniops")
    if(_io_cutlass_tar_in)
      _loom_io_unpack("${_io_cutlass_tar_in}" "${_io_work}/src/cutlass")
      set(_io_cutlass "${_io_work}/src/cutlass")
    endif()

    # Runs one step; a failure stops the configure with the step's log named.
    function(_loom_io_step name)
      execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc OUTPUT_FILE "${_io_work}/${name}.log"
                      ERROR_FILE "${_io_work}/${name}.log")
      if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "infiniops: step '${name}' failed (see ${_io_work}/${name}.log); "
                            "configure with -DLOOM_INFINIOPS=OFF to build Loom without it")
      endif()
    endfunction()
    # $ORIGIN: libinfiniops.so finds libinfinirt.so beside it (in the prefix, and in an installed Loom's lib/).
    set(_io_common -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=${_io_prefix}
        -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER} "-DCMAKE_INSTALL_RPATH=\$ORIGIN")
    if(CCACHE_PROGRAM)
      list(APPEND _io_common -DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE_PROGRAM} -DCMAKE_CUDA_COMPILER_LAUNCHER=${CCACHE_PROGRAM})
    endif()
    message(STATUS "Loom: building InfiniRT and InfiniOps (${_io_backends}) into ${_io_work}")
    _loom_io_step(infinirt-configure ${CMAKE_COMMAND} -S ${_io_work}/src/infinirt -B ${_io_work}/build-infinirt
                  ${_io_common} ${_io_backends})
    _loom_io_step(infinirt-build ${CMAKE_COMMAND} --build ${_io_work}/build-infinirt --target install)
    set(_io_ops_args -DINFINI_RT_ROOT=${_io_prefix} -DGENERATE_PYTHON_BINDINGS=OFF)
    if(_io_cutlass)
      list(APPEND _io_ops_args -DFETCHCONTENT_SOURCE_DIR_CUTLASS=${_io_cutlass} -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
    endif()
    _loom_io_step(infiniops-configure ${CMAKE_COMMAND} -S ${_io_work}/src/infiniops -B ${_io_work}/build-infiniops
                  ${_io_common} ${_io_backends} ${_io_ops_args})
    # Only the library: the snapshot's examples do not build against its own InfiniRT (MemcpyHostToDevice).
    _loom_io_step(infiniops-build ${CMAKE_COMMAND} --build ${_io_work}/build-infiniops --target infiniops)
    _loom_io_step(infiniops-install ${CMAKE_COMMAND} --install ${_io_work}/build-infiniops)
    file(WRITE "${_io_stamp}" "${_io_key}")
    string(TIMESTAMP _io_t1 "%s")
    math(EXPR _io_secs "${_io_t1} - ${_io_t0}")
    message(STATUS "Loom: InfiniRT + InfiniOps built in ${_io_secs} s")
  endif()
endif()

# ---- The operators the library instantiates, from its generated list: the provider calls those only. ----
file(READ "${_io_prefix}/include/infini/operator_call_instantiations.h" _io_inst)
string(REGEX MATCHALL "Operator<::infini::ops::[A-Za-z0-9_]+>::Call<" _io_calls "${_io_inst}")
set(_io_ops "")
foreach(_c ${_io_calls})
  string(REGEX REPLACE "Operator<::infini::ops::([A-Za-z0-9_]+)>::Call<" "\\1" _op "${_c}")
  list(APPEND _io_ops ${_op})
endforeach()
list(REMOVE_DUPLICATES _io_ops)
set(_io_defs LOOM_WITH_INFINIOPS=1 WITH_CPU=1)
foreach(_op ${_io_ops})
  list(APPEND _io_defs LOOM_INFINIOPS_HAS_${_op}=1)
endforeach()
find_library(_io_lib_ops infiniops PATHS "${_io_prefix}/lib" "${_io_prefix}/lib64" NO_DEFAULT_PATH NO_CACHE)
find_library(_io_lib_rt infinirt PATHS "${_io_prefix}/lib" "${_io_prefix}/lib64" NO_DEFAULT_PATH NO_CACHE)
if(NOT _io_lib_ops OR NOT _io_lib_rt)
  message(FATAL_ERROR "infiniops: ${_io_prefix} lacks lib/libinfiniops.so or lib/libinfinirt.so")
endif()
# Whether the library has its NVIDIA backend: it then links the CUDA runtime.
file(STRINGS "${_io_lib_ops}" _io_cudart LIMIT_COUNT 1 REGEX "libcudart\\.so")
set(_io_has_nvidia -1)
if(_io_cudart)
  set(_io_has_nvidia 1)
endif()
if(NOT _io_has_nvidia EQUAL -1)
  list(APPEND _io_defs WITH_NVIDIA=1 LOOM_INFINIOPS_NVIDIA=1)
endif()

add_library(loom_infiniops INTERFACE)
target_include_directories(loom_infiniops SYSTEM INTERFACE "${_io_prefix}/include")
target_link_libraries(loom_infiniops INTERFACE "${_io_lib_ops}" "${_io_lib_rt}")
target_compile_definitions(loom_infiniops INTERFACE ${_io_defs})

file(GLOB LOOM_INFINIOPS_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/providers/infiniops/*.cc)
target_sources(loom PRIVATE ${LOOM_INFINIOPS_SOURCES})
if(NOT _io_has_nvidia EQUAL -1 AND LOOM_CUDA)
  file(GLOB _io_cu CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/providers/infiniops/*.cu)
  target_sources(loom PRIVATE ${_io_cu})
endif()
target_link_libraries(loom PRIVATE loom_infiniops)
# Programs linking libloom.so resolve libinfiniops.so's own dependency (libinfinirt.so) at link time from the prefix,
# also for a given prefix whose libinfiniops.so carries no RUNPATH.
target_link_options(loom INTERFACE "LINKER:-rpath-link,${_io_prefix}/lib")
# An installed Loom carries the two libraries beside libloom.so.
install(FILES "${_io_lib_ops}" "${_io_lib_rt}" DESTINATION ${CMAKE_INSTALL_LIBDIR})
# ... and finds them there: RUNPATH is not inherited from the executables, and the build-tree prefix is dropped.
set_property(TARGET loom APPEND PROPERTY INSTALL_RPATH "$ORIGIN")

list(LENGTH _io_ops _io_n)
if(_io_has_nvidia EQUAL -1)
  set(_io_nv_note "CPU only; NVIDIA off: no GPU visible, and its nvcc build takes ~12 min on 2 cores (-DLOOM_INFINIOPS_NVIDIA=ON)")
else()
  set(_io_nv_note "CPU and NVIDIA")
endif()
message(STATUS "Loom: infiniops provider from ${_io_prefix} (${_io_n} operators instantiated; ${_io_nv_note})")
