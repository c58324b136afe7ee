# The "cutlass" provider (src/kernels/cuda/sm90/): CUTLASS's Hopper grouped GEMM for the mixture-of-experts products,
# compiled for sm_90a only (TMA and WGMMA exist on Hopper alone), into the library beside the native kernels.
#
#   -DLOOM_CUTLASS_DIR=<folder holding include/cutlass>   CUTLASS's headers (4.x); else a cutlass-*-include.tar.gz
#                                  found in ../shared/third_party or .devdeps/third_party is unpacked into the build
#                                  folder
#   -DLOOM_CUTLASS=OFF             leaves the provider out (default ON when LOOM_CUDA, the architectures include 90,
#                                  and the headers are found)
# One translation unit, about 4 minutes of one core cold: its four kernels are CUTLASS templates.

set(LOOM_CUTLASS_DIR "" CACHE PATH "CUTLASS folder (with include/cutlass) for the sm_90 grouped GEMM")

set(_loom_cutlass_include "")
if(LOOM_CUDA)
  if(LOOM_CUTLASS_DIR)
    if(NOT EXISTS ${LOOM_CUTLASS_DIR}/include/cutlass/cutlass.h)
      message(FATAL_ERROR "LOOM_CUTLASS_DIR='${LOOM_CUTLASS_DIR}' holds no include/cutlass/cutlass.h")
    endif()
    set(_loom_cutlass_include ${LOOM_CUTLASS_DIR}/include)
  else()
    file(GLOB _loom_cutlass_tars ${PROJECT_SOURCE_DIR}/../shared/third_party/cutlass-*-include.tar.gz
         ${PROJECT_SOURCE_DIR}/.devdeps/third_party/cutlass-*-include.tar.gz)
    if(_loom_cutlass_tars)
      list(GET _loom_cutlass_tars 0 _loom_cutlass_tar)
      get_filename_component(_loom_cutlass_name ${_loom_cutlass_tar} NAME)
      set(_loom_cutlass_dest ${PROJECT_BINARY_DIR}/_deps/cutlass)
      if(NOT EXISTS ${_loom_cutlass_dest}/${_loom_cutlass_name}.unpacked)
        file(REMOVE_RECURSE ${_loom_cutlass_dest})
        file(ARCHIVE_EXTRACT INPUT ${_loom_cutlass_tar} DESTINATION ${_loom_cutlass_dest})
        file(TOUCH ${_loom_cutlass_dest}/${_loom_cutlass_name}.unpacked)
      endif()
      file(GLOB _loom_cutlass_found ${_loom_cutlass_dest}/*/include/cutlass/cutlass.h
           ${_loom_cutlass_dest}/include/cutlass/cutlass.h)
      if(_loom_cutlass_found)
        list(GET _loom_cutlass_found 0 _loom_cutlass_header)
        get_filename_component(_loom_cutlass_include ${_loom_cutlass_header} DIRECTORY)
        get_filename_component(_loom_cutlass_include ${_loom_cutlass_include} DIRECTORY)
      endif()
    endif()
  endif()
endif()

set(_loom_cutlass_has_90 OFF)
foreach(_arch ${CMAKE_CUDA_ARCHITECTURES})
  if(_arch MATCHES "^90")
    set(_loom_cutlass_has_90 ON)
  endif()
endforeach()
set(_loom_cutlass_default OFF)
if(LOOM_CUDA AND _loom_cutlass_include AND _loom_cutlass_has_90)
  set(_loom_cutlass_default ON)
endif()
option(LOOM_CUTLASS "Build the cutlass provider (Hopper grouped GEMM; needs CUTLASS's headers and sm_90)"
       ${_loom_cutlass_default})

if(LOOM_CUTLASS)
  if(NOT LOOM_CUDA OR NOT _loom_cutlass_include)
    message(FATAL_ERROR "LOOM_CUTLASS needs LOOM_CUDA and CUTLASS's headers (-DLOOM_CUTLASS_DIR=<folder with "
                        "include/cutlass>, or cutlass-*-include.tar.gz in ../shared/third_party)")
  endif()
  add_library(loom_cutlass_sm90 OBJECT ${PROJECT_SOURCE_DIR}/src/kernels/cuda/sm90/grouped_gemm_cutlass.cu)
  # The architecture is given by hand: sm_90a (the "a" features CUTLASS's Hopper kernels need), not the list's.
  set_target_properties(loom_cutlass_sm90 PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
  target_compile_options(loom_cutlass_sm90 PRIVATE --expt-relaxed-constexpr -lineinfo
                         -gencode=arch=compute_90a,code=sm_90a)
  target_include_directories(loom_cutlass_sm90 PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
  target_include_directories(loom_cutlass_sm90 SYSTEM PRIVATE ${_loom_cutlass_include})
  target_link_libraries(loom_cutlass_sm90 PRIVATE CUDA::cudart)
  target_compile_definitions(loom_cutlass_sm90 PRIVATE $<TARGET_PROPERTY:loom,INTERFACE_COMPILE_DEFINITIONS>)
  target_sources(loom PRIVATE $<TARGET_OBJECTS:loom_cutlass_sm90>)
  message(STATUS "Loom: cutlass provider (Hopper grouped GEMM, sm_90a) with headers from ${_loom_cutlass_include}")
elseif(LOOM_CUDA)
  message(STATUS "Loom: cutlass provider not built (CUTLASS headers: '${_loom_cutlass_include}', sm_90 in the "
                 "architectures: ${_loom_cutlass_has_90})")
endif()
