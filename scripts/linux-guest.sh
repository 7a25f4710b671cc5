#!/usr/bin/env bash
# Builds ferry's Linux guest into guest/build/linux: `vmlinux` (Debian's linux-source-6.12,
# tinyconfig + guest/linux/config + guest/linux/patches), `rootfs.ext2` (an ext2 root holding
# the syscall-free /init of guest/linux/writer.c) and `cmdline` (what ferry passes the kernel).
#
# The kernel is cached under $FERRY_CACHE (default ~/.cache/ferry) by a key on everything that
# goes into it (package version, config, patches), so a second clone or a CI run on the same
# machine copies it in seconds; the first build takes 10-17 minutes on two cores. The root
# filesystem is rebuilt every time (a second).
set -euo pipefail
cd "$(dirname "$0")/.."

src=guest/linux
out=guest/build/linux
tarball=/usr/src/linux-source-6.12.tar.xz

need=()
[ -e "$tarball" ] || need+=(linux-source-6.12)
for tool in flex bison bc cpio gcc make patch python3 xz mke2fs; do
    command -v "$tool" >/dev/null || need+=("$tool")
done
[ -e /usr/include/libelf.h ] || need+=(libelf-dev)  # objtool
need=("${need[@]/mke2fs/e2fsprogs}")
need=("${need[@]/xz/xz-utils}")
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "linux-guest: missing packages: ${need[*]}; run as root or install them" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q "${need[@]}"
fi

version=$(dpkg-query -W -f='${Version}' linux-source-6.12)
key=$( { echo "$version"; cat "$src/config" "$src"/patches/*.patch; } | sha256sum | cut -c1-16)
cache="${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}/linux-$key"

build_root() {
    local root
    root=$(mktemp -d "${TMPDIR:-/tmp}/ferry-root.XXXXXX")
    mkdir -p "$root/dev" "$root/proc" "$root/sys" "$out"
    # The file /init reads back as it runs: page k holds k ^ FILE_TAG first and ~k last.
    python3 - "$root/file.bin" <<'PY'
import struct, sys
PAGES, TAG = 4096, 0x66696c65 << 32
with open(sys.argv[1], "wb") as f:
    for k in range(PAGES):
        f.write(struct.pack("<Q", TAG ^ k) + bytes(4080) + struct.pack("<Q", ~k & (2**64 - 1)))
PY
    gcc -O2 -static -nostdlib -ffreestanding -fno-pie -no-pie -fno-stack-protector \
        -Wall -Wextra -Werror -Wl,--build-id=none -Wa,-I,"$root" -o "$root/init" "$src/writer.c"
    rm "$root/file.bin"
    mke2fs -q -t ext2 -b 4096 -d "$root" "$out/rootfs.ext2" 32M >/dev/null
    rm -rf "$root"
}

install_from_cache() {
    mkdir -p "$out"
    cp "$cache/vmlinux" "$out/"
    build_root
    cp "$src/cmdline" "$out/cmdline"
    echo "$key" >"$out/KEY"
    echo "linux-guest: $out (kernel cache key $key, linux-source-6.12 $version)"
}

if [ -e "$cache/vmlinux" ]; then
    install_from_cache
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/ferry-linux.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "linux-guest: building the kernel in $work (cache key $key; ~17 minutes on two cores)"
tar -xf "$tarball" -C "$work"
tree="$work/linux-source-6.12"
for p in "$src"/patches/*.patch; do
    patch -d "$tree" -p1 --quiet <"$p"
done
make -C "$tree" -s tinyconfig
"$tree/scripts/kconfig/merge_config.sh" -m -O "$tree" "$tree/.config" "$src/config" >/dev/null
make -C "$tree" -s olddefconfig
# Every line of the fragment must have survived olddefconfig's dependency resolution.
missing=0
while read -r line; do
    case "$line" in ''|'#'*) continue ;; esac
    name=${line%%=*} value=${line#*=}
    if [ "$value" = n ]; then
        grep -q "^$name=" "$tree/.config" && { echo "linux-guest: $name is set" >&2; missing=1; }
    else
        grep -qx "$line" "$tree/.config" || { echo "linux-guest: $line did not hold" >&2; missing=1; }
    fi
done <"$src/config"
[ "$missing" = 0 ] || exit 1
make -C "$tree" -s -j"$(nproc)" vmlinux

mkdir -p "$cache.tmp"
cp "$tree/vmlinux" "$cache.tmp/"
cp "$tree/.config" "$cache.tmp/config"
rm -rf "$cache"
mv "$cache.tmp" "$cache"
install_from_cache
