#!/usr/bin/env bash
# Builds libvirt with its Cloud Hypervisor driver (Debian ships none) from Debian's source of
# libvirt 11.3 (bookworm-backports), for tests/libvirt.rs to drive ferry through a client no
# one here wrote. Only what the `ch` driver needs is built (virtchd, virtlogd, virsh), into a
# prefix of its own under $FERRY_CACHE (default ~/.cache/ferry), keyed on the source's version
# and this script, so a second run takes a second; the first takes 2-3 minutes on two cores.
# Prints the prefix; target/libvirt-ch links to it.
#
# libvirt 11.3's ch driver has three defects of its own on paths the test walks, each of which
# breaks Cloud Hypervisor as it breaks ferry; they are mended here, as the lines below say:
#  1. vm.restore (virsh restore, start after managedsave) never sets the pidfile path, so it
#     fails for any VMM;
#  2. stopping a domain never ends its VMM: the VMM is started daemonized (not a child), and
#     virProcessAbort only reaps children, so a saved or destroyed domain's VMM runs on (and
#     holds its taps: the restore that follows cannot make them again); ended here, and
#     what it says as it ends no longer stops the domain a second time (which turned a
#     save's "saved" into "shutdown");
#  3. restore makes each NIC's tap with `driver.virtio.queues` taps, which only start
#     defaults to 1: a NIC without <driver queues=.../> gets no tap.
set -euo pipefail
cd "$(dirname "$0")/.."

suite=bookworm-backports
need=()
for tool in meson ninja pkg-config gcc xsltproc xmllint rst2man python3; do
    command -v "$tool" >/dev/null || need+=("$tool")
done
for pc in glib-2.0 json-c libcurl libnl-3.0 libnl-route-3.0 libtirpc gnutls libxml-2.0; do
    pkg-config --exists "$pc" 2>/dev/null || need+=("pc:$pc")
done
packages() {
    local p
    for p in "$@"; do
        case "$p" in
        ninja) echo ninja-build ;;
        xmllint) echo libxml2-utils ;;
        rst2man) echo python3-docutils ;;
        pc:glib-2.0) echo libglib2.0-dev ;;
        pc:json-c) echo libjson-c-dev ;;
        pc:libcurl) echo libcurl4-gnutls-dev ;;
        pc:libnl-3.0) echo libnl-3-dev ;;
        pc:libnl-route-3.0) echo libnl-route-3-dev ;;
        pc:libtirpc) echo libtirpc-dev ;;
        pc:gnutls) echo libgnutls28-dev ;;
        pc:libxml-2.0) echo libxml2-dev ;;
        *) echo "$p" ;;
        esac
    done
}
sources=/etc/apt/sources.list.d/ferry-deb-src.sources
updated=
if [ ${#need[@]} -gt 0 ] || [ ! -e "$sources" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "libvirt-ch: needs root to install $(packages "${need[@]}" | xargs) and Debian's sources" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if [ ! -e "$sources" ]; then
        printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
            "$suite" >"$sources"
    fi
    apt-get update -q
    updated=1
    if [ ${#need[@]} -gt 0 ]; then
        # shellcheck disable=SC2046
        apt-get install -y -q --no-install-recommends $(packages "${need[@]}")
    fi
fi

# The newest source Debian lists: bookworm-backports' (bookworm's own is 9.0).
newest() { apt-cache showsrc libvirt 2>/dev/null | awk '/^Version:/ {print $2}' | sort -V | tail -1; }
version=$(newest)
if [ -z "$version" ] && [ -z "$updated" ]; then
    apt-get update -q
    version=$(newest)
fi
[ -n "$version" ] || { echo "libvirt-ch: Debian lists no libvirt source in $suite" >&2; exit 1; }
upstream=${version%%-*}
key=$( { echo "$version"; cat "$0"; } | sha256sum | cut -c1-16)
cache="${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}/libvirt-$upstream-$key"
prefix="$cache/prefix"

if [ ! -x "$prefix/sbin/virtchd" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/ferry-libvirt.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    # Only the upstream tarball is needed (Debian's own patches are not the ch driver's).
    (cd "$work" && apt-get source --download-only -q "libvirt/$suite" >/dev/null 2>&1 || true)
    tarball="$work/libvirt_$upstream.orig.tar.xz"
    [ -e "$tarball" ] || { echo "libvirt-ch: could not fetch $tarball" >&2; exit 1; }
    tar -C "$work" -xf "$tarball"
    src="$work/libvirt-$upstream"
    python3 - "$src/src/ch/ch_process.c" "$src/src/ch/ch_events.c" <<'PY'
import sys
path, events = sys.argv[1], sys.argv[2]
text = open(path).read()

def mend(anchor, replacement, why):
    global text
    if text.count(anchor) != 1:
        sys.exit(f"libvirt-ch: {why}: the code around it changed; look at the mend again")
    text = text.replace(anchor, replacement)

# 1 and 3: restore sets the pidfile path and the NICs' tap count as start does.
mend("""    logfile = domainLogContextGetWriteFD(logCtxt);

    if (!priv->monitor) {""",
     """    logfile = domainLogContextGetWriteFD(logCtxt);

    if (!priv->pidfile &&
        !(priv->pidfile = virPidFileBuildPath(cfg->stateDir, vm->def->name)))
        return -1;

    for (size_t i = 0; i < vm->def->nnets; i++) {
        if (vm->def->nets[i]->driver.virtio.queues == 0)
            vm->def->nets[i]->driver.virtio.queues = 1;
    }

    if (!priv->monitor) {""", "restore's pidfile and tap count")
# 2: the daemonized VMM is ended (SIGTERM, then SIGKILL), not only reaped.
mend("""    if (priv->monitor) {
        virProcessAbort(vm->pid);""",
     """    if (priv->monitor) {
        virProcessKillPainfully(vm->pid, true);""", "stopping the VMM")
open(path, "w").write(text)

# 2, and what the VMM says as it ends ("vmm shutdown") changes nothing for a domain libvirt
# already stopped (a save's "saved" stays).
path, text = events, open(events).read()
mend("""    if (virDomainObjBeginJob(vm, VIR_JOB_DESTROY))
        return -1;
    virCHProcessStop(driver, vm, reason);""",
     """    if (virDomainObjBeginJob(vm, VIR_JOB_DESTROY))
        return -1;
    if (virDomainObjIsActive(vm))
        virCHProcessStop(driver, vm, reason);""", "a stopped domain's last events")
open(path, "w").write(text)
PY
    off=(driver_qemu driver_lxc driver_libxl driver_bhyve driver_esx driver_hyperv driver_openvz
        driver_vbox driver_vmware driver_vz driver_test driver_interface driver_network
        driver_secrets storage_dir storage_disk storage_fs storage_gluster storage_iscsi
        storage_iscsi_direct storage_lvm storage_mpath storage_rbd storage_scsi
        storage_vstorage storage_zfs docs tests nls apparmor selinux polkit firewalld udev
        pciaccess netcf)
    disabled=()
    for option in "${off[@]}"; do disabled+=("-D$option=disabled"); done
    meson setup "$work/build" "$src" --prefix="$prefix" -Drunstatedir="$prefix/var/run" \
        -Ddriver_ch=enabled -Ddriver_libvirtd=enabled -Ddriver_remote=enabled \
        "${disabled[@]}" >"$work/setup.log" 2>&1 || {
        tail -30 "$work/setup.log" >&2
        exit 1
    }
    ninja -C "$work/build" >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
    rm -rf "$prefix"
    ninja -C "$work/build" install >"$work/install.log" 2>&1 || {
        tail -30 "$work/install.log" >&2
        exit 1
    }
fi
mkdir -p target
ln -sfn "$prefix" target/libvirt-ch
echo "$prefix"
