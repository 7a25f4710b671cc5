# ferry: the two commands that matter are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
GUEST := guest/build/guest.elf
FERRY := target/release/ferry

.PHONY: all deps guest linux-guest libvirt-ch build install test demo bench faults lint fuzz scale-kit clean

all: build

deps:
	@scripts/install-deps.sh

guest: deps
	@$(MAKE) -s -C guest

# ferry's Linux guest (guest/linux): Debian's linux-source-6.12 built for ferry's machine, an
# ext2 root with a syscall-free /init; the kernel is cached by a key on its config and patches.
linux-guest: deps
	@scripts/linux-guest.sh

# libvirt 11.3 with its Cloud Hypervisor driver (Debian ships none), for tests/libvirt.rs to
# drive ferry through it; built from Debian's source into a cached prefix (target/libvirt-ch).
libvirt-ch: deps
	@scripts/libvirt-ch.sh >/dev/null

build: deps guest
	$(CARGO) build --release --workspace

# ferry into $(PREFIX)/bin, and the name orchestrators exec for Cloud Hypervisor (libvirt's
# ch driver, Virtink, Kata): `cloud-hypervisor`, a link to ferry, which answers as CH under it.
PREFIX ?= /usr/local
install: build
	install -D -m 0755 $(FERRY) $(DESTDIR)$(PREFIX)/bin/ferry
	ln -sfn ferry $(DESTDIR)$(PREFIX)/bin/cloud-hypervisor

# Unit and end-to-end tests (doc-tests: none); the last line sums up every runner.
# The fuzz harnesses replay their committed corpus (fuzz/corpus) as plain tests.
# --no-fail-fast: a failure in one test binary does not hide the results of the others.
test: build linux-guest libvirt-ch
	set -o pipefail; $(CARGO) test --no-fail-fast --release --workspace --lib --bins --tests \
		-- --test-threads=2 2>&1 | tee target/test.log
	set -o pipefail; $(CARGO) test --no-fail-fast --release --manifest-path fuzz/Cargo.toml \
		--target-dir target 2>&1 | tee -a target/test.log
	@awk '/^test result:/ {p += $$4; f += $$6} END {printf "tests: %d passed, %d failed\n", p, f}' target/test.log

lint: deps guest
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml -- --check
	$(CARGO) clippy --release --manifest-path fuzz/Cargo.toml --target-dir target --all-targets -- -D warnings

# Each fuzz target for FUZZ_SECONDS (default 600); needs the network once for nightly + cargo-fuzz.
fuzz: deps
	@scripts/fuzz.sh

demo: build
	@scripts/demo.sh

# The results page's headline (docs/benchmarks.md): ferry with no flags against QEMU 10's
# sweep winners; exit 0 when every row ran, whatever the verdict.
bench: build
	@bench/run.sh

faults: build
	@scripts/faults.sh

# What the scale profile needs on a many-core host without a compiler: the (stripped) binary,
# the guest image and the commit they came from. There, from a checkout of the same commit:
#   FERRY_BIN=scale-kit/ferry FERRY_GUEST=scale-kit/guest.elf python3 bench/run.py --profile scale
# BEFORE=<commit> also builds that commit's binary into scale-kit/before/, for
# bench/scale-groups.sh to run the connection rows with it too (an A/B on one lease).
scale-kit: build
	@mkdir -p scale-kit
	strip -o scale-kit/ferry $(FERRY)
	cp $(GUEST) scale-kit/guest.elf
	@echo "$$(git rev-parse HEAD) $$(git diff --quiet HEAD -- && echo clean || echo changed)" > scale-kit/COMMIT
	@if [ -n "$(BEFORE)" ]; then scripts/build-before.sh "$(BEFORE)" scale-kit/before; fi

clean:
	$(CARGO) clean
	$(MAKE) -C guest clean
