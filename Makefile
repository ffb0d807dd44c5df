# Two commands for a fresh machine (each installs what it needs into .venv/):
#   make up     - the main job: `vllm-pd up`, a P/D stack (tiny model, 1 prefill + 1 decode
#                 + proxy) behind an OpenAI endpoint on PORT (8000), serving until Ctrl-C
#   make test   - the test suite (unit + integration against real vllm serve)
# Also: make demo (one measured P/D request, then exit); make up UP_ARGS="--mode token".
comma   := ,
VENV    := .venv
EXTRAS  ?= cpu,nixl,mooncake-cpu,dev
STAMP   := $(VENV)/.bootstrap-$(subst $(comma),-,$(EXTRAS))

PORT    ?= 8000
# The unit lane is single-threaded Python: one pytest-xdist worker per core (at most 4, each
# holds vLLM and torch in memory), a test file's tests on one worker (module fixtures once).
# The integration lane stays serial: its engines are pinned to cores 0 and 1.
UNIT_PAR ?= -n auto --maxprocesses 4 --dist loadfile
UP_ARGS ?=

.PHONY: up demo test unit lint venv clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	scripts/bootstrap.sh $(EXTRAS)
	@rm -f $(VENV)/.bootstrap-* && touch $@

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/vllm-pd up --config examples/up-cpu.yaml --port $(PORT) $(UP_ARGS)

demo: $(STAMP)
	$(VENV)/bin/vllm-pd demo

# The fast unit lane first; the rest (tests/integration: real vllm serve) only when it passes.
# Every exit code but 0 stops make, "no tests collected" (5) included. Under CI=true a test
# whose dependency is missing fails instead of skipping (tests/skips.py). The integration lane
# prints its 25 slowest steps (engine starts show up as fixture setups): the run must stay
# well under an hour.
test: $(STAMP)
	$(VENV)/bin/python -m pytest tests/unit $(UNIT_PAR)
	$(VENV)/bin/python -m pytest tests --ignore=tests/unit -m "not manual" --durations=25

unit: $(STAMP)
	$(VENV)/bin/python -m pytest tests/unit $(UNIT_PAR)

lint: $(STAMP)
	$(VENV)/bin/ruff check vllm_pd_ext tests benchmarks examples
	$(VENV)/bin/ruff format --check vllm_pd_ext tests benchmarks examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) logs .pytest_cache .ruff_cache
