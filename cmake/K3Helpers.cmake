# Helpers shared by every layer's CMakeLists.

function(k3_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wno-unused-parameter>)
  # GCC 12 reports -Wrestrict false positives inside libstdc++'s string code (GCC bug 105329).
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-restrict>)
  endif()
  if(K3_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()

function(k3_sanitize target)
  if(K3_FUZZ)  # coverage instrumentation for libFuzzer, in every k3 library
    target_compile_options(${target} PRIVATE -fsanitize=fuzzer-no-link,address,undefined)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  elseif(K3_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-omit-frame-pointer
                                             -fno-sanitize-recover=undefined)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()

# k3_library(NAME SOURCES ... DEPS ...): one library per layer; DEPS are the layers below it.
function(k3_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  if(NOT ARG_SOURCES)  # a layer with no code yet: header-only placeholder in the link chain
    add_library(k3_${name} INTERFACE)
    target_include_directories(k3_${name} INTERFACE ${PROJECT_SOURCE_DIR}/src)
    target_link_libraries(k3_${name} INTERFACE ${ARG_DEPS})
    return()
  endif()
  add_library(k3_${name} STATIC ${ARG_SOURCES})
  target_include_directories(k3_${name} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(k3_${name} PUBLIC ${ARG_DEPS})
  k3_warnings(k3_${name})
  k3_sanitize(k3_${name})
endfunction()

# k3_test(NAME SOURCES ... DEPS ... [LABELS ...]): a GoogleTest binary registered with CTest.
function(k3_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE K3_SHARED_DIR="${K3_SHARED_DIR}"
                                             K3_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  k3_warnings(${name})
  k3_sanitize(${name})
  include(GoogleTest)
  if(ARG_LABELS)
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES LABELS "${ARG_LABELS}")
  else()
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES LABELS "unit")
    add_dependencies(unit_tests ${name})
  endif()
endfunction()

# k3_layer(NAME DEPS ... [TEST_DEPS ...]): the library of one layer folder. Every *.cc in the
# folder (subfolders included) is a source, every *_test.cc goes into one test binary
# NAME_test, and *_cuda.cu / *_cuda.cc files join the library only when K3_CUDA is on (with
# *_cuda_test.cc in NAME_cuda_test, labelled gpu). Adding a file needs no
# CMake edit.
function(k3_layer name)
  cmake_parse_arguments(ARG "" "" "DEPS;TEST_DEPS" ${ARGN})
  file(GLOB_RECURSE all_cc CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cc)
  set(srcs)
  set(tests)
  set(gpu_tests)
  foreach(f IN LISTS all_cc)
    if(f MATCHES "_cuda_test\\.cc$")
      list(APPEND gpu_tests ${f})
    elseif(f MATCHES "_cuda\\.cc$")
      if(K3_CUDA)  # host code that calls the layer's CUDA kernels
        list(APPEND srcs ${f})
      endif()
    elseif(f MATCHES "_test\\.cc$")
      list(APPEND tests ${f})
    else()
      list(APPEND srcs ${f})
    endif()
  endforeach()
  if(K3_CUDA)
    file(GLOB_RECURSE cu CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*_cuda.cu)
    list(APPEND srcs ${cu})
  endif()
  k3_library(${name} SOURCES ${srcs} DEPS ${ARG_DEPS})
  if(tests)
    k3_test(${name}_test SOURCES ${tests} DEPS k3_${name} ${ARG_TEST_DEPS})
  endif()
  # GPU tests (*_cuda_test.cc) need a device: their own binary, label "gpu", so CPU-only runs
  # exclude them with `ctest -LE gpu` and the H200 runs them with `ctest -L gpu`.
  if(gpu_tests AND K3_CUDA)
    k3_test(${name}_cuda_test SOURCES ${gpu_tests} DEPS k3_${name} ${ARG_TEST_DEPS} LABELS gpu)
  endif()
endfunction()
