# Two commands on a fresh machine (Python 3.11+): `make demo` and `make test`.
PYTHON ?= python3
# pytest-xdist processes for `make test`; each simulates 8 CPU devices (about 1-2 GB of memory)
TEST_WORKERS ?= 2
VENV   := .venv
comma  := ,
BIN    := $(VENV)/bin

# pip extras: `cuda` (jax[cuda12]) where an NVIDIA driver answers, so `make demo` trains on the GPU
EXTRAS ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda)

.PHONY: demo test test-fast bench bench-gpu clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install -q -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	touch $@

# One pip run for the test extras (not the plain install first, then the extras: that resolved
# and built the editable wheel twice); it also satisfies `demo`'s install.
$(VENV)/.installed-dev: $(BIN)/activate pyproject.toml
	$(BIN)/pip install -q -e '.[dev$(if $(EXTRAS),$(comma)$(EXTRAS))]'
	touch $(VENV)/.installed $@

demo: $(VENV)/.installed            ## install; train Llama tiny on the standard library's source on every GPU (else 8 simulated CPU devices), print samples
	$(BIN)/python examples/stdlib_corpus.py --out runs/data
	rm -rf runs/demo
	$(BIN)/jaxpar train --config examples/configs/tiny.yaml --samples 3

test: $(VENV)/.installed-dev        ## the whole suite on 8 simulated CPU devices, TEST_WORKERS processes
	rm -rf .cache/jax-tests          # the suite's compilation cache starts empty, as on a fresh machine
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

test-fast: $(VENV)/.installed-dev   ## the suite without tests marked slow
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"

bench: $(VENV)/.installed-dev       ## step benchmark over a list of strategies (CPU figures here)
	$(BIN)/python benchmarks/step.py

bench-gpu: $(VENV)/.installed-dev   ## jaxpar vs a hand-written jax.jit loop on the accelerator there is (scaled down on a CPU)
	$(BIN)/python benchmarks/gpu.py

clean:
	rm -rf $(VENV) runs .pytest_cache
