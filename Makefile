# Two entry points, each sets itself up from a fresh clone:
#   make demo   compile and run the built-in tiny model on the CPU
#   make test   run the test suite (what CI runs, through .ci/run)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO   := build/demo

.PHONY: demo test clean

$(STAMP): pyproject.toml
	# Cross-compiling for gfx942 / gfx950 needs ld.lld >= 19 and the ROCm device bitcode
	# (Debian lld-19, rocm-device-libs); sm90 needs nvcc (already on the build machines). The
	# tests disassemble gfx942 / gfx950 code objects with llvm-objdump-19 (Debian llvm-19).
	@command -v ld.lld-19 >/dev/null && command -v llvm-objdump-19 >/dev/null && \
	  [ -d /usr/lib/x86_64-linux-gnu/amdgcn/bitcode ] || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -qq && apt-get install -y -qq lld-19 rocm-device-libs llvm-19 >/dev/null; } || \
	  echo "note: could not install lld-19 / rocm-device-libs / llvm-19; the gfx942 / gfx950 tests will skip and say why"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 resolves to the CPU build on the build machines' local index; see pyproject.toml.
	# setuptools ends every editable install with an informational "Editable installation."
	# warning (pypa/packaging-problems#558) that pip shows for local projects; only that one is muted.
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[test,tvm,tokenizer,serve]'
	touch $@

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/dsv4c make-tiny --out $(DEMO)/tiny-model --seed 0
	$(BIN)/dsv4c compile --model $(DEMO)/tiny-model --target llvm -o $(DEMO)/tiny-llvm
	$(BIN)/dsv4c inspect $(DEMO)/tiny-model --target llvm
	$(BIN)/dsv4c generate $(DEMO)/tiny-llvm --token-ids 1,2,3,4,5,6,7,8 --max-new-tokens 16 --greedy

test: $(STAMP)
	$(BIN)/python -m pytest tests

clean:
	rm -rf build $(VENV)
