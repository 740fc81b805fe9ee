#!/usr/bin/env bash
# Adds apache-tvm-ffi (the kernels' calling convention, cute_kernels/compile.py) to the GPU host's
# bundle: run after ../shared/gpu/pack.sh, from the project root. The bundle's own env.sh then unpacks
# it on the host. Only the Python package and libtvm_ffi*.so go (headers and sources are for building
# C++ extensions): 1.5 MB instead of the wheel's 3.3, which keeps the upload under its 64 MiB.
set -euo pipefail
VER=0.1.15.post2
root=$(git rev-parse --show-toplevel)
[ -f "$root/.gpu/env.sh" ] || { echo "no .gpu/env.sh: run bash ../shared/gpu/pack.sh first" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$tmp/whl" "apache-tvm-ffi==$VER"
mkdir "$tmp/tree" && (cd "$tmp/tree" && python3 -m zipfile -e "$tmp"/whl/*.whl .)
rm -rf "$tmp/tree/tvm_ffi/include" "$tmp/tree/tvm_ffi/src" "$tmp/tree/tvm_ffi/3rdparty"
tar -C "$tmp/tree" -cJf "$root/.gpu/tvm_ffi.tar.xz" .
grep -q tvm_ffi.tar.xz "$root/.gpu/env.sh" || cat >> "$root/.gpu/env.sh" <<'ENV'
if [ ! -f /tmp/site/.tvm_ffi_ok ]; then
  tar xJf "$_gpu_dir/tvm_ffi.tar.xz" -C /tmp/site && touch /tmp/site/.tvm_ffi_ok || echo "gpu bundle: tvm_ffi unpacking failed" >&2
fi
ENV
du -sh "$root/.gpu" | awk '{print "gpu bundle with tvm_ffi: " $1}'
