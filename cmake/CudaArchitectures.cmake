# Which NVIDIA GPUs the CUDA backend is built for (CMAKE_CUDA_ARCHITECTURES), before enable_language(CUDA).
#
#   -DCMAKE_CUDA_ARCHITECTURES=<list> (or the CUDAARCHS environment variable) is taken as given, e.g. 80 for an A100,
#   86 for RTX 30xx / A10 / A40, 89 for RTX 40xx / L4 / L40S, 90 for H100 / H200, "80;90" for both.
#   Otherwise: the compute capabilities nvidia-smi reports for the visible GPUs; with none visible, sm_80 code (which
#   every Ampere and Ada GPU runs: 8.x GPUs run 8.0 code) and sm_90 code with its PTX, which newer GPUs compile when
#   the library loads. Two architectures cost about twice one's nvcc time; 86 and 89 add code tuned for those GPUs.
# sm_80 is the oldest the kernels support (bf16 tensor-core mma, cp.async); an older entry is an error here rather
# than an nvcc failure deep in the build.

set(LOOM_CUDA_ARCHITECTURES_WITHOUT_GPU "80-real;90")

# <out>: the default list; <reason>: where it came from; <smi>: the nvidia-smi program ("" or not found: none).
function(loom_default_cuda_architectures out reason smi)
  set(archs "${LOOM_CUDA_ARCHITECTURES_WITHOUT_GPU}")
  set(from "no GPU visible: sm_80 code for Ampere and Ada, sm_90 and its PTX for Hopper and newer")
  if(smi)
    execute_process(COMMAND ${smi} --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    string(REGEX MATCHALL "[0-9]+\\.[0-9]+" caps "${caps}")
    string(REPLACE "." "" caps "${caps}")
    if(rc EQUAL 0 AND caps)
      list(REMOVE_DUPLICATES caps)
      set(archs "${caps}")
      set(from "the visible GPUs'")
    endif()
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
  set(${reason} "${from}" PARENT_SCOPE)
endfunction()

# A FATAL_ERROR naming the entry when the list asks for a GPU older than sm_80 (or for all of them).
function(loom_check_cuda_architectures archs)
  foreach(arch ${archs})
    if(arch STREQUAL "all" OR arch STREQUAL "all-major")
      message(FATAL_ERROR "CMAKE_CUDA_ARCHITECTURES='${archs}': '${arch}' includes GPUs older than sm_80, which "
                          "Loom's CUDA kernels do not support; name the architectures, e.g. \"80;86;89;90\"")
    endif()
    string(REGEX MATCH "^[0-9]+" number "${arch}")
    if(number AND number LESS 80)
      message(FATAL_ERROR "CMAKE_CUDA_ARCHITECTURES='${archs}': Loom's CUDA kernels need sm_80 (Ampere) or newer; "
                          "'${arch}' is older")
    endif()
  endforeach()
endfunction()
