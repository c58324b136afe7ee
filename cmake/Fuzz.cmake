# libFuzzer targets for every parser of user files (tests/fuzz/, docs/FUZZING.md). Configure a separate build dir
# with clang:  cmake -S . -B build-fuzz -G Ninja -DLOOM_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang
# (scripts/fuzz.sh does it). libloom itself is built with coverage, ASan and UBSan, so a finding anywhere below a
# parser is caught; the main build stays gcc.
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "LOOM_FUZZ needs clang (libFuzzer): configure with -DCMAKE_CXX_COMPILER=clang++")
endif()
if(LOOM_CUDA)
  message(FATAL_ERROR "LOOM_FUZZ: configure with -DLOOM_CUDA=OFF (the parsers are host code)")
endif()
set(LOOM_FUZZ_SANITIZERS -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
target_compile_options(loom PRIVATE -fsanitize=fuzzer-no-link ${LOOM_FUZZ_SANITIZERS})
target_link_options(loom PRIVATE ${LOOM_FUZZ_SANITIZERS})

file(GLOB LOOM_FUZZ_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/fuzz/fuzz_*.cc)
foreach(src ${LOOM_FUZZ_SOURCES})
  get_filename_component(name ${src} NAME_WE)
  add_executable(${name} ${src})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests/fuzz)
  target_compile_options(${name} PRIVATE -fsanitize=fuzzer ${LOOM_FUZZ_SANITIZERS})
  target_link_options(${name} PRIVATE -fsanitize=fuzzer ${LOOM_FUZZ_SANITIZERS})
  target_link_libraries(${name} PRIVATE loom nlohmann_json::nlohmann_json)
  list(APPEND LOOM_FUZZ_TARGETS ${name})
endforeach()
add_custom_target(fuzz_targets DEPENDS ${LOOM_FUZZ_TARGETS})
