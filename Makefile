# Two commands a newcomer needs: `make demo` and `make test`. Each does its own set-up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# System tools the end-to-end and system tests drive (installed with apt when root; procps: ps, sysctl;
# libnss3-tools: certutil, for `meshgate tls trust`; conntrack: the NAT traversal tests flush a router's table).
APT_TOOLS := curl chromium firefox-esr dnsperf knot-dnsutils bind9-dnsutils iproute2 nftables iperf3 openssl procps libnss3-tools conntrack
APT_STAMP := $(VENV)/.apt-done
PY_STAMP := $(VENV)/.py-done

.PHONY: test demo venv system-tools lint unit bench clean

$(PY_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(PY_STAMP)

$(APT_STAMP): Makefile | $(PY_STAMP)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(APT_TOOLS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  fi; \
	else echo "not root: skipping apt (end-to-end tests need: $(APT_TOOLS))"; fi
	touch $@

system-tools: $(APT_STAMP)

lint: $(PY_STAMP)
	$(BIN)/ruff check meshgate tests bench
	$(BIN)/mypy meshgate

test: $(PY_STAMP) $(APT_STAMP) lint
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

unit: $(PY_STAMP)
	$(BIN)/python -m pytest -q tests/unit

demo: $(PY_STAMP)
	$(BIN)/meshgate demo

bench: $(PY_STAMP)
	$(BIN)/python bench/socks.py

clean:
	rm -rf $(VENV) build *.egg-info
