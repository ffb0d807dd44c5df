# Two commands for a fresh machine (each installs what it needs into .venv/):
#   make demo   - the main job: a real P/D request on a tiny model, end to end
#   make test   - the test suite (unit + integration against real vllm serve)
comma   := ,
VENV    := .venv
EXTRAS  ?= cpu,nixl,mooncake-cpu,dev
STAMP   := $(VENV)/.bootstrap-$(subst $(comma),-,$(EXTRAS))

.PHONY: demo test unit lint venv clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	scripts/bootstrap.sh $(EXTRAS)
	@rm -f $(VENV)/.bootstrap-* && touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vllm-pd demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

unit: $(STAMP)
	$(VENV)/bin/python -m pytest tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check vllm_pd_ext tests benchmarks examples
	$(VENV)/bin/ruff format --check vllm_pd_ext tests benchmarks examples

clean:
	rm -rf $(VENV) logs .pytest_cache .ruff_cache
