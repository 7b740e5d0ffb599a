#!/bin/sh
# denv-mig-restore GPU=PROFILE,PROFILE... (one argument per GPU of the layout)
# Creates the GPU instances, each with its compute instance, on every such GPU that has none;
# a GPU that has some is left as it is (a second run changes nothing).
set -eu
for arg in "$@"; do
  gpu=${arg%%=*} profiles=${arg#*=}
  have=$(nvidia-smi -L | awk -v gpu="$gpu" '
    /^GPU / { current = $2; sub(":", "", current) }
    /^ +MIG / { if (current == gpu) n++ }
    END { print n + 0 }')
  if [ "$have" -eq 0 ]; then
    nvidia-smi mig -i "$gpu" -cgi "$profiles" -C
  fi
done
