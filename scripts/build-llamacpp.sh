#!/usr/bin/env bash
# Builds llama.cpp's own llama-speculative-simple and llama-bench, the reference ggufspec measures
# against, from the llama.cpp source inside the installed llama-cpp-python version's sdist, with the
# same CPU flags as scripts/install. Output: third_party/llama.cpp/build/bin/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
version="$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
dest=third_party/llama.cpp
if [ ! -f "$dest/CMakeLists.txt" ]; then
  mkdir -p third_party/sdist
  .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: -d third_party/sdist "llama-cpp-python==$version"
  tar -xzf "third_party/sdist/llama_cpp_python-$version.tar.gz" -C third_party/sdist
  rm -rf "$dest" && mv "third_party/sdist/llama_cpp_python-$version/vendor/llama.cpp" "$dest"
fi
flags="${CMAKE_ARGS:-$(scripts/cmake-args.sh)}"
# shellcheck disable=SC2086
cmake -S "$dest" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF $flags >&2
cmake --build "$dest/build" -j "$(nproc)" --target llama-speculative-simple llama-bench >&2
ls "$dest/build/bin/"
