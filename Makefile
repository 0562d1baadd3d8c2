PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= models/tiny-llava
ARCH ?= llava

.PHONY: test serve demo bench install clean cluster-demo

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

$(MODEL)/config.json: | $(BIN)/.installed
	$(BIN)/python -m engine.tiny $(MODEL) --arch $(ARCH)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

# The whole disaggregated path on this machine: 1 encoder, 1 prefill, 1 decode, the OpenAI ingress on 127.0.0.1:8000.
serve: $(BIN)/.installed $(MODEL)/config.json
	$(BIN)/raypd serve configs/local.yaml

# The embedded engine, no Ray: prints a streamed completion.
demo: $(BIN)/.installed $(MODEL)/config.json
	$(BIN)/python -m llmapi.demo --model $(MODEL)

# `ray up` for real: three network namespaces of this machine as head, prefill and decode nodes (root; installs sshd
# and rsync with apt-get if missing), configs/cluster/local.yaml, deploy, a completion, rescale, `ray down`.
cluster-demo: $(BIN)/.installed
	$(BIN)/python scripts/cluster_demo

bench: $(BIN)/.installed
	$(BIN)/python -m engine.bench

clean:
	rm -rf $(VENV) models
