# cmake/CudaArchitectures.cmake, checked without a GPU or nvcc: `cmake -DMODULE=<file> -DWORK=<dir> -P run.cmake`.
# The default list from nvidia-smi's answer (a stand-in script prints it), the list without a GPU, and the refusal of
# architectures older than sm_80 (each in a child cmake, since a refusal is a FATAL_ERROR).
if(CHECK_ONE)
  include(${MODULE})
  string(REPLACE "," ";" archs "${CHECK_ONE}")  # commas on the command line: a ; would split the argument
  loom_check_cuda_architectures("${archs}")
  message("accepted")
  return()
endif()

include(${MODULE})
file(MAKE_DIRECTORY ${WORK})
set(failures "")
macro(expect what got want)
  if(NOT "${got}" STREQUAL "${want}")
    string(APPEND failures "\n  ${what}: got '${got}', want '${want}'")
  endif()
endmacro()

# A stand-in nvidia-smi printing `text` and exiting with `rc`.
function(fake_smi path text rc)
  file(WRITE ${path} "#!/bin/sh\nprintf '${text}'\nexit ${rc}\n")
  file(CHMOD ${path} PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
endfunction()

fake_smi(${WORK}/smi_two "8.0\\n8.6\\n8.0\\n" 0)
loom_default_cuda_architectures(archs from ${WORK}/smi_two)
expect("two A100s and an A10" "${archs}" "80;86")
fake_smi(${WORK}/smi_h100 "9.0\\n" 0)
loom_default_cuda_architectures(archs from ${WORK}/smi_h100)
expect("an H100" "${archs}" "90")
fake_smi(${WORK}/smi_none "No devices were found\\n" 6)
loom_default_cuda_architectures(archs from ${WORK}/smi_none)
expect("nvidia-smi without a GPU" "${archs}" "80-real;90")
loom_default_cuda_architectures(archs from "")
expect("no nvidia-smi" "${archs}" "80-real;90")

foreach(case 80 80-real,90 86,89-real,90a native 75 70-real,80 all all-major)
  execute_process(COMMAND ${CMAKE_COMMAND} -DMODULE=${MODULE} "-DCHECK_ONE=${case}" -P ${CMAKE_CURRENT_LIST_FILE}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REPLACE "," ";" shown "${case}")
  if(case MATCHES "^(75|70|all)")
    if(rc EQUAL 0 OR NOT out MATCHES "CMAKE_CUDA_ARCHITECTURES='${shown}'")
      string(APPEND failures "\n  '${shown}' should be refused with a message naming it: ${out}")
    endif()
  elseif(NOT rc EQUAL 0 OR NOT out MATCHES "accepted")
    string(APPEND failures "\n  '${shown}' should be accepted: ${out}")
  endif()
endforeach()

if(failures)
  message(FATAL_ERROR "CudaArchitectures.cmake:${failures}")
endif()
message("CudaArchitectures.cmake: all cases pass")
