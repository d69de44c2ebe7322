#!/bin/sh
# The pure-Python wheels the H200 check needs and that machine's image lacks, downloaded
# here into .whl/ (ignored by git), for the device tool's `carry` (under 64 MiB; ~2 MB).
# The image holds JAX 0.11.2 + its CUDA 13 plugin, PyTorch, Triton, absl-py, optax,
# chex, tensorstore, numpy, rich, requests, pyyaml, safetensors (docs/results/gpu_h200.md).
#   dm-haiku, jmp (haiku's mixed precision), ml-collections: the model and configs
#   ai2-olmo-core, dataclass-extensions, importlib_resources, bettermap, dill: OLMo-core
#   (its cached_path, which pulls in boto3 and google-cloud-storage, is stood in for by
#   bench/olmo_core_stubs.py: the bench reads no URL)
# On the machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -e
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  dm-haiku==0.0.17 jmp==0.0.4 ml-collections==1.1.0 ai2-olmo-core==3.0.0 \
  dataclass-extensions==0.5.0 importlib_resources==7.1.0 bettermap==1.3.1 dill==0.4.0
du -ch .whl/*.whl | tail -1
