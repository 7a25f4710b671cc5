#!/usr/bin/env bash
# Installs what ferry needs on a fresh Debian 12 machine (as root); does nothing when all is there.
set -euo pipefail

need=()
command -v gcc >/dev/null || need+=(gcc)
command -v g++ >/dev/null || need+=(g++)  # libFuzzer (fuzz/, replayed by make test) is C++
command -v make >/dev/null || need+=(make)
# QEMU 10 (the benchmarks' reference: multifd zero pages, mapped-ram, postcopy-preempt), from
# Debian's bookworm-backports suite; Debian 12's own QEMU is 7.2.
# (`|| true`: with no QEMU at all the pipeline fails, and pipefail would end the script here.)
qemu_major=$(qemu-system-x86_64 --version 2>/dev/null | awk '/version/ {split($4, v, "."); print v[1]; exit}' || true)
[ "${qemu_major:-0}" -ge 10 ] || need_qemu=1
command -v ip >/dev/null || need+=(iproute2)
command -v tc >/dev/null || need+=(iproute2)
command -v bridge >/dev/null || need+=(iproute2)  # the NIC test reads the bridge's table
command -v curl >/dev/null || need+=(curl)
command -v promtool >/dev/null || need_promtool=1  # promtool checks the metrics exposition
command -v objcopy >/dev/null || need+=(binutils)
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/x86_64-linux-gnu/libclang*.so >/dev/null 2>&1 || need+=(libclang-dev)
[ -x /usr/bin/python3 ] || need+=(python3)
command -v zstd >/dev/null || need+=(zstd)  # guest/sample.py says how far its sample shrinks
command -v lz4 >/dev/null || need+=(lz4)
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null || need+=(python3-matplotlib)

# The suite beside bookworm's, on the mirror apt already uses.
add_backports() {
    local list=/etc/apt/sources.list.d/bookworm-backports.sources uri
    [ -e "$list" ] && return 0
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null)
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
        "${uri:-http://deb.debian.org/debian}" /usr/share/keyrings/debian-archive-keyring.gpg >"$list"
}

if [ ${#need[@]} -gt 0 ] || [ -n "${need_qemu:-}" ] || [ -n "${need_promtool:-}" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "ferry: missing packages: ${need[*]} ${need_qemu:+QEMU 10} ${need_promtool:+prometheus (promtool)}; run as root or install them" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    [ -z "${need_qemu:-}" ] || add_backports
    apt-get update -q
    if [ ${#need[@]} -gt 0 ]; then
        echo "ferry: installing ${need[*]}"
        apt-get install -y -q "${need[@]}"
    fi
    if [ -n "${need_promtool:-}" ]; then
        # promtool ships in the server's package; its recommends (exporters, a web UI) are
        # not needed to check an exposition.
        echo "ferry: installing prometheus (for promtool) without its recommends"
        apt-get install -y -q --no-install-recommends prometheus
    fi
    if [ -n "${need_qemu:-}" ]; then
        echo "ferry: installing QEMU 10 from bookworm-backports"
        apt-get install -y -q -t bookworm-backports qemu-system-x86
    fi
fi

# A real distribution kernel for the Linux boot-protocol tests (its zero page and E820 are
# checked; ferry's own Linux guest, make linux-guest, is the one that boots here): Debian's
# current amd64 kernel, unpacked (not installed) into .cache/kernel.
kernel_dir="$(dirname "$0")/../.cache/kernel"
if [ ! -e "$kernel_dir/vmlinuz" ] && [ "$(id -u)" = 0 ]; then
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')
    if [ -z "$pkg" ]; then
        apt-get update -q
        pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
    fi
    echo "ferry: fetching $pkg (unpacked into .cache/kernel for the boot-protocol tests)"
    tmp=$(mktemp -d)
    chmod 755 "$tmp" # apt's download user writes there
    chown _apt "$tmp" 2>/dev/null || true
    (cd "$tmp" && apt-get download -q "$pkg" >/dev/null && dpkg-deb -x ./*.deb root)
    mkdir -p "$kernel_dir"
    cp "$tmp"/root/boot/vmlinuz-* "$kernel_dir/vmlinuz"
    rm -rf "$tmp"
fi

if ! command -v cargo >/dev/null; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        echo "ferry: cargo is in ~/.cargo/bin; add it to PATH" >&2
    else
        echo "ferry: a Rust toolchain (cargo, Rust >= 1.88) is required: install it with rustup" >&2
    fi
    exit 1
fi
