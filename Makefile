# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_DATA := datasets/IronGrain/demo
DEMO_RUN := runs/demo

.PHONY: install demo test image-check lint format lock bench clean-demo

# Every version comes from requirements.lock, as in CI and the image.
$(STAMP): requirements.txt requirements-cpu.txt requirements-dev.txt requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements.lock \
		-r requirements-cpu.txt -r requirements.txt -r requirements-dev.txt
	touch $@

install: $(STAMP)

$(DEMO_DATA)/.complete: datasets/make_synthetic.py | $(STAMP)
	$(PY) datasets/make_synthetic.py --out $(DEMO_DATA) --n-train 8 --n-val 3 --shape 32 96 96 --seed 0
	touch $@

demo: $(STAMP) $(DEMO_DATA)/.complete
	NPROC_PER_NODE=2 PYTHON=$(PY) bash launch.sh --config configs/demo.yaml \
		--data-root $(DEMO_DATA) --output-dir $(DEMO_RUN) --resume auto
	$(PY) -m app.report $(DEMO_RUN)
	@echo "Open TensorBoard with: $(VENV)/bin/tensorboard --logdir $(DEMO_RUN)/tensorboard"

test: $(STAMP)
	$(PY) -m pytest

# The default image built on a stand-in base and run (docker/ci/image-check.sh): root, buildah
# and debootstrap, no Docker engine or registry.
image-check:
	bash docker/ci/image-check.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Resolve the requirements afresh into requirements.lock (then review the diff).
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet --disable-pip-version-check \
		-r requirements-cpu.txt -r requirements.txt -r requirements-dev.txt
	{ grep '^#' requirements.lock; .lock-venv/bin/python -m pip freeze --exclude-editable \
		| grep -v '^torch=='; } > requirements.lock.new
	mv requirements.lock.new requirements.lock && rm -rf .lock-venv

bench: $(STAMP)
	$(PY) bench/train_step.py --config configs/demo.yaml --compare-auto
	$(PY) bench/ddp_strides.py --config configs/demo.yaml
	$(PY) bench/data_pipeline.py --config configs/demo.yaml

clean-demo:
	rm -rf $(DEMO_RUN) $(DEMO_DATA)
