# pybind11 for the loom Python package: only its headers are used (no CMake package), so any pybind11 serves,
# Debian's, pip's or the copy PyTorch ships in torch/include. A pybind11 older than the interpreter (or its numpy)
# compiles but fails at run time (Python 3.12 needs pybind11's internals version 5, from 2.11; numpy 2 changed the
# dtype structure pybind11 reads, handled from 2.12), so the version is checked here.
include_guard(GLOBAL)

# The pybind11 version in <dir>/pybind11/detail/common.h, "" when there is none.
function(_loom_pybind11_version dir out)
  set(version "")
  set(header ${dir}/pybind11/detail/common.h)
  if(EXISTS ${header})
    file(STRINGS ${header} lines REGEX "#define PYBIND11_VERSION_(MAJOR|MINOR|PATCH) ")
    foreach(part MAJOR MINOR PATCH)
      foreach(line ${lines})
        if(line MATCHES "PYBIND11_VERSION_${part} +([0-9A-Za-z.]+)")
          string(APPEND version "${CMAKE_MATCH_1}.")
        endif()
      endforeach()
    endforeach()
    string(REGEX REPLACE "\\.$" "" version "${version}")
  endif()
  set(${out} "${version}" PARENT_SCOPE)
endfunction()

# Sets LOOM_PYBIND11_INCLUDE (cache) and LOOM_PYBIND11_VERSION; `problem` gets one line saying what is missing or too
# old for Python3_EXECUTABLE, or "" when the package can be built.
function(loom_find_pybind11 problem)
  set(LOOM_PYBIND11_INCLUDE "" CACHE PATH "pybind11's include directory (holding pybind11/pybind11.h); empty: the \
interpreter's pybind11 package, else /usr/include")
  set(dir "${LOOM_PYBIND11_INCLUDE}")
  if(dir STREQUAL "")
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import pybind11; print(pybind11.get_include())"
                    OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_QUIET)
    if(NOT rc EQUAL 0 OR NOT EXISTS "${dir}/pybind11/pybind11.h")
      set(dir /usr/include)
    endif()
  endif()
  _loom_pybind11_version("${dir}" version)
  set(LOOM_PYBIND11_VERSION "${version}" PARENT_SCOPE)
  set(LOOM_PYBIND11_RESOLVED_INCLUDE "${dir}" PARENT_SCOPE)
  set(fix "give -DLOOM_PYBIND11_INCLUDE=<the include directory of a newer pybind11> (PyTorch ships one in \
<site-packages>/torch/include)")
  if(version STREQUAL "")
    set(${problem} "no pybind11 headers in ${dir} (install pybind11-dev, or ${fix})" PARENT_SCOPE)
    return()
  endif()
  # What the interpreter needs: Python 3.12 -> 2.11, 3.13 -> 2.13, 3.14 -> 3.0; numpy 2 -> 2.12.
  set(need 2.6)
  set(why "")
  foreach(pair "3.12;2.11" "3.13;2.13" "3.14;3.0")
    list(GET pair 0 py)
    list(GET pair 1 pb)
    if(Python3_VERSION VERSION_GREATER_EQUAL ${py} AND pb VERSION_GREATER need)
      set(need ${pb})
      set(why "Python ${Python3_VERSION}")
    endif()
  endforeach()
  execute_process(COMMAND ${Python3_EXECUTABLE} -c "import numpy; print(numpy.__version__)"
                  OUTPUT_VARIABLE numpy OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_QUIET)
  if(rc EQUAL 0 AND numpy VERSION_GREATER_EQUAL 2 AND need VERSION_LESS 2.12)
    set(need 2.12)
    set(why "numpy ${numpy}")
  endif()
  if(version VERSION_LESS need)
    if(why STREQUAL "")
      set(why "Loom")
    endif()
    set(${problem} "pybind11 ${version} (${dir}) is too old for ${why} of ${Python3_EXECUTABLE}, which needs pybind11 \
${need} or newer: ${fix}" PARENT_SCOPE)
    return()
  endif()
  set(${problem} "" PARENT_SCOPE)
endfunction()
