# ferry: the two commands that matter are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
GUEST := guest/build/guest.elf
FERRY := target/release/ferry

.PHONY: all deps guest build test demo bench lint clean

all: build

deps:
	@scripts/install-deps.sh

guest: deps
	@$(MAKE) -s -C guest

build: deps guest
	$(CARGO) build --release --workspace

# Unit and end-to-end tests (doc-tests: none); the last line sums up every runner.
test: build
	set -o pipefail; $(CARGO) test --release --workspace --lib --bins --tests -- --test-threads=2 2>&1 \
		| tee target/test.log
	@awk '/^test result:/ {p += $$4; f += $$6} END {printf "tests: %d passed, %d failed\n", p, f}' target/test.log

lint: deps guest
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

demo: build
	@scripts/demo.sh

bench: build
	@bench/run.sh

clean:
	$(CARGO) clean
	$(MAKE) -C guest clean
