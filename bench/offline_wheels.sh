#!/usr/bin/env bash
# Wheels for a GPU machine that has Python, PyTorch, Triton and NumPy but no package index (a lab machine, a
# cluster node): the engine's other dependencies and what the GPU suite and the benchmarks import, for its Python.
#   bash bench/offline_wheels.sh DIR [PYTHON_VERSION]       (default 3.12; about 40 MB)
# On that machine, from the project's root:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
# --no-deps: each package is named here, at one version; the machine's own torch, numpy, triton (and numba, where
# it has one: NUMBA=1 adds numba and llvmlite, ~65 MB, for --cpu-experts) are used as they are. The GUI's packages
# (PySide6, pyqtgraph) are left out: the engine never imports them.
set -eu
DIR=${1:?give the folder for the wheels}
PYV=${2:-3.12}
mkdir -p "$DIR"
names=(
    # the engine and its server
    gguf tokenizers jinja2 markupsafe pydantic pydantic-core annotated-types typing-inspection typing-extensions
    fastapi starlette annotated-doc opentelemetry-api uvicorn h11 click sse-starlette anyio idna sniffio
    nvidia-ml-py psutil requests urllib3 certifi charset-normalizer platformdirs zeroconf ifaddr pyzmq msgpack
    llguidance pyyaml packaging
    # the GPU suite and the benchmarks' clients
    pytest pluggy iniconfig pytest-xdist execnet pytest-timeout hypothesis sortedcontainers jsonschema referencing
    rpds-py jsonschema-specifications attrs httpx httpcore httpx-sse httpx2 httpcore2 truststore openai distro jiter
    anthropic docstring-parser prometheus-client
    # transformers, the reference of the HF comparisons
    transformers huggingface-hub safetensors regex tqdm filelock fsspec kernels tomlkit typer shellingham rich
    markdown-it-py mdurl pygments
)
[ "${NUMBA:-0}" = 1 ] && names+=(numba llvmlite)
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
    manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 any; do
    plat+=(--platform "$p")
done
for n in "${names[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
        "${plat[@]}" -d "$DIR" "$n" || echo "no wheel of $n for Python $PYV"
done
du -sh "$DIR"
