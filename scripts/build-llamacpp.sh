#!/usr/bin/env bash
# Builds llama.cpp's own tools, the reference ggufspec measures against, from the llama.cpp source inside
# the installed llama-cpp-python version's sdist, for the same backend and CPU flags as scripts/install
# (scripts/cmake-args.sh: CUDA where nvcc and an NVIDIA GPU are found, Metal on Apple Silicon, else the
# CPU; a CMAKE_ARGS already set is used as given). The RPC backend is always on.
# Tools: llama-server, llama-speculative-simple, llama-bench, llama-completion, llama-cli and
# ggml-rpc-server, each where this llama.cpp version has it.
# Output: third_party/llama.cpp/build/bin/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')"
dest=third_party/llama.cpp
if [ ! -f "$dest/CMakeLists.txt" ]; then
  mkdir -p third_party/sdist
  .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: -d third_party/sdist "llama-cpp-python==$version"
  tar -xzf "third_party/sdist/llama_cpp_python-$version.tar.gz" -C third_party/sdist
  rm -rf "$dest" && mv "third_party/sdist/llama_cpp_python-$version/vendor/llama.cpp" "$dest"
fi
if [ -n "${CMAKE_ARGS:-}" ]; then
  flags="$CMAKE_ARGS" backend="as given in CMAKE_ARGS"
else
  flags="$(scripts/cmake-args.sh)" backend="$(scripts/cmake-args.sh --backend)"
fi
case "$flags" in *GGML_RPC*) ;; *) flags="${flags:+$flags }-DGGML_RPC=ON" ;; esac
echo "ggufspec: building llama.cpp's tools for backend: $backend ($flags)" >&2
# shellcheck disable=SC2086
cmake -S "$dest" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON $flags >&2
# the targets this llama.cpp version defines (llama-completion is newer than llama-cli's split, etc.)
available="$(cmake --build "$dest/build" --target help 2>/dev/null || true)"
targets=()
for t in llama-server llama-speculative-simple llama-bench llama-batched-bench llama-completion llama-cli ggml-rpc-server rpc-server; do
  grep -qE "(^|[ :.])$t(:|$| )" <<<"$available" && targets+=("$t")
done
cmake --build "$dest/build" -j "$(nproc)" --target "${targets[@]}" >&2
ls "$dest/build/bin/"
