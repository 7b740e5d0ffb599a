#!/bin/sh
# denv-replica-run GPU_INDEX MIG_PROFILE|- MIG_INSTANCE ENGINE run ARGS...
# Runs ENGINE run with NVIDIA_VISIBLE_DEVICES set to the UUID of that GPU or MIG instance.
set -eu
gpu=$1 profile=$2 instance=$3
shift 3
uuid=$(nvidia-smi -L | awk -v gpu="$gpu" -v profile="$profile" -v instance="$instance" '
  /^GPU / { current = $2; sub(":", "", current); seen = 0
            if (current == gpu && profile == "-") { found = $0 } }
  /^ +MIG / { if (current == gpu && $2 == profile) { if (seen == instance) found = $0; seen++ } }
  END { if (found != "") { sub(/.*UUID: */, "", found); sub(/\).*/, "", found); print found } }')
if [ -z "$uuid" ]; then
  echo "denv-replica-run: GPU $gpu share $profile#$instance not found by nvidia-smi -L" >&2
  exit 1
fi
engine=$1 verb=$2
shift 2
exec "$engine" "$verb" -e "NVIDIA_VISIBLE_DEVICES=$uuid" "$@"
