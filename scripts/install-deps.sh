#!/usr/bin/env bash
# Installs what ferry needs on a fresh Debian 12 machine (as root); does nothing when all is there.
set -euo pipefail

need=()
command -v gcc >/dev/null || need+=(gcc)
command -v g++ >/dev/null || need+=(g++)  # libFuzzer (fuzz/, replayed by make test) is C++
command -v make >/dev/null || need+=(make)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v ip >/dev/null || need+=(iproute2)
command -v tc >/dev/null || need+=(iproute2)
command -v bridge >/dev/null || need+=(iproute2)  # the NIC test reads the bridge's table
command -v curl >/dev/null || need+=(curl)
command -v objcopy >/dev/null || need+=(binutils)
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/x86_64-linux-gnu/libclang*.so >/dev/null 2>&1 || need+=(libclang-dev)
[ -x /usr/bin/python3 ] || need+=(python3)
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null || need+=(python3-matplotlib)

if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "ferry: missing packages: ${need[*]}; run as root or install them" >&2
        exit 1
    fi
    echo "ferry: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q "${need[@]}"
fi

# A real distribution kernel for the Linux boot-protocol tests (Linux itself cannot run on
# PVM, but ferry's zero page and E820 for it can be checked): Debian's current amd64 kernel,
# unpacked (not installed) into .cache/kernel.
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
