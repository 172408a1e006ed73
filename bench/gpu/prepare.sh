#!/usr/bin/env bash
# Everything a device call needs to run the project's benchmarks on a CUDA machine, in
# .gpu/ (ignored by git). Run here, from the project's root, after `make install`:
#     bash bench/gpu/prepare.sh
# It runs ../shared/gpu/prepare.sh with the wheels rank 0 imports beyond the core ones
# (each at the version .venv resolved), adds llguidance (built for manylinux_2_31, which
# that script does not ask for), py-spy, and the default model's tokenizer files (the
# random-weight shapes of bench/shapes.py use them). Then, on the device:
#     call 1, carry [".gpu/a"]:              mkdir -p /root/stash && cp .gpu/a/* /root/stash/
#     call 2 at once, carry [".gpu/b"] and bench/gpu is in the tree:
#                                            bash bench/gpu/measure.sh [what]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
V() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
extra=()
for p in jsonschema jsonschema-specifications attrs referencing rpds-py fastapi starlette \
         uvicorn pydantic pydantic-core annotated-types annotated-doc typing-inspection anyio \
         sniffio h11 click prometheus-client opentelemetry-api psutil; do
  extra+=("$p==$(V "$p")")
done
bash ../shared/gpu/prepare.sh "${extra[@]}"
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
         --implementation cp -d .gpu/b "$@"; }
dl --platform manylinux_2_31_x86_64 "llguidance==$(V llguidance)"
dl --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 py-spy
dl --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 "setproctitle==$(V setproctitle)"  # (each rank's ps title)
mkdir -p .gpu/b/tok
model=$(.venv/bin/python -c "from mlx_relay.model.default_model import resolve_model; print(resolve_model('default', progress=False))")
cp "$model"/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} .gpu/b/tok/
# The GPU timeline's library (measure.sh trace), where CUDA 13's CUPTI headers are here
cuda=/usr/local/cuda-13.0
if [[ -f $cuda/include/cupti.h && -e $cuda/lib64/libcupti.so ]] && command -v gcc > /dev/null; then
  gcc -O2 -shared -fPIC -I"$cuda/include" bench/gpu/cupti_trace.c -L"$cuda/lib64" -lcupti -lpthread \
    -Wl,-rpath,$cuda/targets/x86_64-linux/lib -o .gpu/b/cupti_trace.so
else
  echo "no CUDA 13 CUPTI or gcc here: measure.sh trace will not run" >&2
fi
du -sh .gpu/a .gpu/b
