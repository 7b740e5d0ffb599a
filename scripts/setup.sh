#!/usr/bin/env bash
# One-shot set-up for a fresh machine: uv, the locked virtual environment, and the system packages
# the data plane and node-deploy tests run for real (scripts/system-packages.txt says why each).
# Safe to re-run: every step checks first and does nothing when nothing is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t APT_PACKAGES < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' -e 's/[[:space:]]//g' scripts/system-packages.txt)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing system packages: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing system packages: ${missing[*]}" >&2
    echo "setup: install them (e.g. 'sudo apt-get install ${missing[*]}') and re-run" >&2
    exit 1
  fi
fi

if ! uv --version >/dev/null 2>&1; then
  echo "setup: installing uv"
  python3 -m pip install --quiet uv || python3 -m pip install --quiet --user uv
  export PATH="$HOME/.local/bin:$PATH"
fi

if [[ ! -x .venv/bin/python ]]; then
  uv venv --quiet --python python3 .venv
fi
# The lock pins every third-party package by hash; our own two packages are installed editable on top.
grep -v '^-e ' requirements.lock > .venv/requirements.hashed
uv pip sync --quiet --python .venv/bin/python --require-hashes .venv/requirements.hashed
uv pip install --quiet --python .venv/bin/python --no-deps -e . -e ./agent
# A wheelhouse of every locked wheel, for the install tests: they build fresh environments with no
# index at all. uv's cache is no such store: on a new machine `uv pip install --offline` found
# none of the locked packages that the sync above had just put in it. pip checks every hash.
# docopt (num2words's, under Pipecat) is published only as a source archive: it comes as one, and
# the fresh environments build it offline with the locked setuptools.
.venv/bin/python -m pip download --quiet --quiet --disable-pip-version-check --require-hashes \
  --no-deps --only-binary :all: --no-binary docopt --dest .venv/wheelhouse \
  --requirement .venv/requirements.hashed
touch .venv/.installed
echo "setup: environment ready (.venv)"
