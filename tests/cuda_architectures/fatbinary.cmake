# The built library holds GPU code for exactly the architectures asked for (CMAKE_CUDA_ARCHITECTURES) and no other:
# `cmake -DCUOBJDUMP=<cuobjdump> -DLIBRARY=<libloom.so> -DARCHS=<a,b,...> [-DEXTRA=sm_90a] -P fatbinary.cmake`;
# EXTRA: the code of kernels built for one architecture of their own (the cutlass provider's sm_90a).
execute_process(COMMAND ${CUOBJDUMP} --list-elf ${LIBRARY} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cuobjdump --list-elf ${LIBRARY} failed (${rc}): ${err}")
endif()
string(REGEX MATCHALL "sm_[0-9]+[a-z]?" found "${out}")
list(REMOVE_DUPLICATES found)
list(SORT found)

string(REPLACE "," ";" archs "${ARCHS}")
set(want "")
foreach(arch ${archs})
  if(arch MATCHES "^([0-9]+[a-z]?)(-real)?$")        # 90 and 90-real give SASS; 90-virtual only PTX
    list(APPEND want "sm_${CMAKE_MATCH_1}")
  elseif(NOT arch MATCHES "^[0-9]+[a-z]?-virtual$")  # native and the like: not known here
    message("architectures '${ARCHS}' are not all numbers; the library holds ${found}")
    if(NOT found)
      message(FATAL_ERROR "${LIBRARY} holds no GPU code")
    endif()
    return()
  endif()
endforeach()
string(REPLACE "," ";" extra "${EXTRA}")
list(APPEND want ${extra})
list(REMOVE_DUPLICATES want)
list(SORT want)
if(NOT found STREQUAL want)
  message(FATAL_ERROR "${LIBRARY} holds GPU code for '${found}', but CMAKE_CUDA_ARCHITECTURES='${ARCHS}' asks for "
                      "'${want}'")
endif()
message("${LIBRARY}: GPU code for ${found}, as asked")
