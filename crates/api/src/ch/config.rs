//! Cloud Hypervisor's `VmConfig`, read for what ferry honours. Every field of CH's schema is
//! known here: one ferry honours is taken; one it lacks is accepted only at CH's default value
//! (or null, or as CH's `vm.info` writes the default), since a client that fills every field
//! in (ch-remote, libvirt, a config read back from CH) asks for nothing by it; any other value
//! is refused naming its path. A field CH's schema here does not have (a newer CH's) is
//! accepted and logged, as CH itself accepts it.

use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// How a field ferry lacks may be given: what CH does by default.
#[derive(Clone, Copy)]
enum AtDefault {
    /// Absent, null, or this JSON literal.
    Is(&'static str),
    /// Absent, null, an empty array or an empty object.
    Empty,
}

/// Where a console (serial or virtio-console) goes, as ferry can do it.
#[derive(Clone, Debug, PartialEq)]
pub enum ConsoleMode {
    /// Off or Null: the output is dropped.
    Off,
    /// Tty: this process's standard output.
    Tty,
    File(String),
    /// A pseudo-terminal ferry opens; its path (`/dev/pts/N`) once it is open.
    Pty(Option<String>),
    /// A Unix socket ferry listens on, at this path.
    Socket(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Disk {
    pub path: String,
    pub readonly: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Net {
    pub tap: String,
    /// As given (xx:xx:xx:xx:xx:xx); ferry's NIC parser checks it.
    pub mac: Option<String>,
    /// The tap's open file, when the client passed it (`vm.add-net`, libvirt's way); `tap`
    /// is then the name it is attached to.
    pub file: Option<sockets::passed::PassedFd>,
    /// The client's name for it (`vm.info` calls it `_netN` when none was given).
    pub id: Option<String>,
}

/// The part of a `VmConfig` ferry honours.
#[derive(Clone, Debug, PartialEq)]
pub struct VmSpec {
    pub kernel: String,
    pub cmdline: String,
    pub initramfs: Option<String>,
    pub memory_bytes: u64,
    /// `memory.shared`: guest memory is a memfd mapped shared (ferry's memfd backend).
    pub shared_memory: bool,
    pub vcpus: usize,
    pub disks: Vec<Disk>,
    pub nets: Vec<Net>,
    pub serial: ConsoleMode,
    pub console: ConsoleMode,
}

/// CH's defaults where the body leaves a field out.
const DEFAULT_MEMORY: u64 = 512 << 20;

const TOP: &[(&str, AtDefault)] = &[
    ("rate_limit_groups", AtDefault::Empty),
    (
        "rng",
        AtDefault::Is(r#"{"src": "/dev/urandom", "iommu": false, "pci_segment": 0}"#),
    ),
    ("balloon", AtDefault::Empty),
    ("fs", AtDefault::Empty),
    ("generic_vhost_user", AtDefault::Empty),
    ("pmem", AtDefault::Empty),
    (
        "debug_console",
        AtDefault::Is(r#"{"file": null, "mode": "Off", "iobase": 233}"#),
    ),
    ("devices", AtDefault::Empty),
    ("user_devices", AtDefault::Empty),
    ("vdpa", AtDefault::Empty),
    ("vsock", AtDefault::Empty),
    ("numa", AtDefault::Empty),
    ("iommu", AtDefault::Is("false")),
    ("watchdog", AtDefault::Is("false")),
    ("rtc", AtDefault::Empty),
    ("pvpanic", AtDefault::Is("false")),
    ("pci_segments", AtDefault::Empty),
    ("platform", AtDefault::Empty),
    ("tpm", AtDefault::Empty),
    ("landlock_enable", AtDefault::Is("false")),
    ("landlock_rules", AtDefault::Empty),
    ("preserved_fds", AtDefault::Empty),
];
const TOP_USED: &[&str] = &[
    "cpus", "memory", "payload", "disks", "net", "serial", "console",
];

const PAYLOAD: &[(&str, AtDefault)] = &[
    ("firmware", AtDefault::Empty),
    ("igvm", AtDefault::Empty),
    ("host_data", AtDefault::Empty),
];
const PAYLOAD_USED: &[&str] = &["kernel", "cmdline", "initramfs"];

const CPUS: &[(&str, AtDefault)] = &[
    ("topology", AtDefault::Empty),
    ("kvm_hyperv", AtDefault::Is("false")),
    ("max_phys_bits", AtDefault::Is("46")),
    ("nested", AtDefault::Is("true")),
    ("affinity", AtDefault::Empty),
    ("features", AtDefault::Is(r#"{"amx": false}"#)),
    ("core_scheduling", AtDefault::Is("\"Vm\"")),
    ("profile", AtDefault::Is("\"Host\"")),
];
const CPUS_USED: &[&str] = &["boot_vcpus", "max_vcpus"];

const MEMORY: &[(&str, AtDefault)] = &[
    ("hotplug_size", AtDefault::Is("0")),
    ("hotplugged_size", AtDefault::Is("0")),
    ("mergeable", AtDefault::Is("false")),
    ("hotplug_method", AtDefault::Is("\"Acpi\"")),
    ("hugepages", AtDefault::Is("false")),
    ("hugepage_size", AtDefault::Empty),
    ("prefault", AtDefault::Is("false")),
    ("reserve", AtDefault::Is("false")),
    ("thp", AtDefault::Is("true")),
    ("zones", AtDefault::Empty),
];
const MEMORY_USED: &[&str] = &["size", "shared"];

const DISK: &[(&str, AtDefault)] = &[
    ("direct", AtDefault::Is("false")),
    ("iommu", AtDefault::Is("false")),
    ("num_queues", AtDefault::Is("1")),
    ("queue_size", AtDefault::Is("128")),
    ("vhost_user", AtDefault::Is("false")),
    ("vhost_socket", AtDefault::Empty),
    ("rate_limiter_config", AtDefault::Empty),
    ("pci_segment", AtDefault::Is("0")),
    ("pci_device_id", AtDefault::Empty),
    ("serial", AtDefault::Empty),
    ("rate_limit_group", AtDefault::Empty),
    ("queue_affinity", AtDefault::Empty),
    ("disable_io_uring", AtDefault::Is("false")),
    ("disable_aio", AtDefault::Is("false")),
    ("backing_files", AtDefault::Is("false")),
    ("sparse", AtDefault::Is("true")),
    // CH's defaults: find the image's format out (ferry's disks are raw), and lock the
    // whole file (ferry locks it whole too).
    ("image_type", AtDefault::Is("\"Unknown\"")),
    ("lock_granularity", AtDefault::Is("\"ByteRange\"")),
];
/// `id` names the device; `vm.info` and `vm.counters` name them `_diskN`/`_netN` in order.
const DISK_USED: &[&str] = &["path", "readonly", "id"];

const NET: &[(&str, AtDefault)] = &[
    ("ip", AtDefault::Is("\"192.168.249.1\"")),
    ("mask", AtDefault::Is("\"255.255.255.0\"")),
    ("host_mac", AtDefault::Empty),
    ("mtu", AtDefault::Empty),
    ("iommu", AtDefault::Is("false")),
    ("num_queues", AtDefault::Is("2")),
    ("queue_size", AtDefault::Is("256")),
    ("vhost_user", AtDefault::Is("false")),
    ("vhost_socket", AtDefault::Empty),
    ("vhost_mode", AtDefault::Is("\"Client\"")),
    ("pci_segment", AtDefault::Is("0")),
    ("pci_device_id", AtDefault::Empty),
    ("rate_limiter_config", AtDefault::Empty),
    ("offload_tso", AtDefault::Is("true")),
    ("offload_ufo", AtDefault::Is("true")),
    ("offload_csum", AtDefault::Is("true")),
    // The files a client passes arrive with the request, not in the body.
    ("fds", AtDefault::Empty),
];
const NET_USED: &[&str] = &["tap", "mac", "id"];

const CONSOLE: &[(&str, AtDefault)] = &[
    ("iommu", AtDefault::Is("false")),
    ("id", AtDefault::Empty),
    ("pci_segment", AtDefault::Is("0")),
    ("pci_device_id", AtDefault::Empty),
];
const CONSOLE_USED: &[&str] = &["mode", "file", "socket"];

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

fn is_default(value: &Value, default: AtDefault) -> bool {
    match (value, default) {
        (Value::Null, _) => true,
        // An object at its default: each field given is null or the default's (CH leaves
        // out the ones at null when it writes a config, others write them all).
        (Value::Object(given), AtDefault::Is(literal)) => {
            match serde_json::from_str::<Value>(literal) {
                Ok(Value::Object(d)) => given
                    .iter()
                    .all(|(k, v)| v.is_null() || d.get(k) == Some(v)),
                _ => false,
            }
        }
        (v, AtDefault::Is(literal)) => {
            serde_json::from_str::<Value>(literal).is_ok_and(|d| *v == d)
        }
        (Value::Array(a), AtDefault::Empty) => a.is_empty(),
        (Value::Object(o), AtDefault::Empty) => o.is_empty(),
        _ => false,
    }
}

/// `object` at `path` as a map, its fields checked against what ferry takes (`used`) and what
/// it accepts only at CH's default (`lacks`).
fn fields<'a>(
    object: &'a Value,
    path: &str,
    used: &[&str],
    lacks: &[(&str, AtDefault)],
) -> Result<&'a Map<String, Value>, ApiError> {
    let map = object
        .as_object()
        .ok_or_else(|| bad(format!("{path} must be an object")))?;
    for (name, value) in map {
        if used.contains(&name.as_str()) {
            continue;
        }
        let Some((_, default)) = lacks.iter().find(|(n, _)| n == name) else {
            tracing::warn!("{path}.{name}: a field ferry does not know, ignored");
            continue;
        };
        if !is_default(value, *default) {
            return Err(bad(format!(
                "{path}.{name}={value}: ferry does not support it (leave it out or at \
                 Cloud Hypervisor's default)"
            )));
        }
    }
    Ok(map)
}

fn string(map: &Map<String, Value>, path: &str, name: &str) -> Result<Option<String>, ApiError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(bad(format!("{path}.{name} must be a string, not {other}"))),
    }
}

fn number(map: &Map<String, Value>, path: &str, name: &str) -> Result<Option<u64>, ApiError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            bad(format!(
                "{path}.{name} must be a non-negative integer, not {v}"
            ))
        }),
    }
}

fn flag(map: &Map<String, Value>, path: &str, name: &str) -> Result<bool, ApiError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(bad(format!("{path}.{name} must be a boolean, not {other}"))),
    }
}

fn list<'a>(map: &'a Map<String, Value>, name: &str) -> Result<&'a [Value], ApiError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(other) => Err(bad(format!("{name} must be an array, not {other}"))),
    }
}

impl VmSpec {
    /// Reads a `vm.create` body.
    pub fn from_json(body: &Value) -> Result<Self, ApiError> {
        let top = fields(body, "VmConfig", TOP_USED, TOP)?;
        let payload = top
            .get("payload")
            .ok_or_else(|| bad("VmConfig.payload is required (payload.kernel)"))?;
        let payload = fields(payload, "payload", PAYLOAD_USED, PAYLOAD)?;
        let kernel = string(payload, "payload", "kernel")?.ok_or_else(|| {
            bad("payload.kernel is required: ferry boots a PVH ELF or a Linux bzImage")
        })?;
        let (memory_bytes, shared_memory) = memory(top.get("memory"))?;
        let serial = console(top.get("serial"), "serial", ConsoleMode::Off)?;
        let console = console(top.get("console"), "console", ConsoleMode::Off)?;
        Ok(Self {
            kernel,
            cmdline: string(payload, "payload", "cmdline")?.unwrap_or_default(),
            initramfs: string(payload, "payload", "initramfs")?,
            memory_bytes,
            shared_memory,
            vcpus: cpus(top.get("cpus"))?,
            disks: disks(top)?,
            nets: nets(top)?,
            serial,
            console,
        })
    }

    /// The config as `vm.info` shows it: CH's shape, with what ferry fills in said.
    pub fn to_json(&self) -> Value {
        json!({
            "cpus": {"boot_vcpus": self.vcpus, "max_vcpus": self.vcpus},
            "memory": {"size": self.memory_bytes, "shared": self.shared_memory},
            "payload": {
                "kernel": self.kernel,
                "cmdline": self.cmdline,
                "initramfs": self.initramfs,
            },
            "disks": self.disks.iter().enumerate().map(|(i, d)| json!({
                "path": d.path, "readonly": d.readonly, "id": format!("_disk{i}"),
            })).collect::<Vec<_>>(),
            "net": self.nets.iter().enumerate().map(|(i, n)| json!({
                "tap": n.tap, "mac": n.mac, "id": n.name(i),
            })).collect::<Vec<_>>(),
            "serial": self.serial.to_json(),
            "console": self.console.to_json(),
        })
    }
}

fn memory(memory: Option<&Value>) -> Result<(u64, bool), ApiError> {
    let Some(memory) = memory.filter(|m| !m.is_null()) else {
        return Ok((DEFAULT_MEMORY, false));
    };
    let map = fields(memory, "memory", MEMORY_USED, MEMORY)?;
    let size = number(map, "memory", "size")?.unwrap_or(DEFAULT_MEMORY);
    if size == 0 || size % 4096 != 0 {
        return Err(bad(format!(
            "memory.size {size} must be a positive multiple of 4096 bytes"
        )));
    }
    Ok((size, flag(map, "memory", "shared")?))
}

fn cpus(cpus: Option<&Value>) -> Result<usize, ApiError> {
    let Some(cpus) = cpus.filter(|c| !c.is_null()) else {
        return Ok(1);
    };
    let map = fields(cpus, "cpus", CPUS_USED, CPUS)?;
    let boot = number(map, "cpus", "boot_vcpus")?.unwrap_or(1);
    if boot == 0 || boot > 255 {
        return Err(bad(format!("cpus.boot_vcpus {boot} must be 1..=255")));
    }
    if let Some(max) = number(map, "cpus", "max_vcpus")?
        && max != boot
    {
        return Err(bad(format!(
            "cpus.max_vcpus={max}: ferry has no vCPU hotplug (give max_vcpus = boot_vcpus)"
        )));
    }
    Ok(boot as usize)
}

fn disks(top: &Map<String, Value>) -> Result<Vec<Disk>, ApiError> {
    let mut out = Vec::new();
    for (i, disk) in list(top, "disks")?.iter().enumerate() {
        let path = format!("disks[{i}]");
        let map = fields(disk, &path, DISK_USED, DISK)?;
        out.push(Disk {
            path: string(map, &path, "path")?
                .ok_or_else(|| bad(format!("{path}.path is required")))?,
            readonly: flag(map, &path, "readonly")?,
        });
    }
    Ok(out)
}

fn nets(top: &Map<String, Value>) -> Result<Vec<Net>, ApiError> {
    let mut out = Vec::new();
    for (i, net) in list(top, "net")?.iter().enumerate() {
        let path = format!("net[{i}]");
        let (mut nic, named) = nic(net, &path)?;
        // The id vm.info gives a NIC without one is its place: the same NIC again.
        if nic.id.as_deref() == Some(&format!("_net{i}")) {
            nic.id = None;
        }
        if !named {
            return Err(bad(format!(
                "{path}.tap is required: ferry attaches a NIC to an existing tap device \
                 (or to one whose file vm.add-net passes)"
            )));
        }
        out.push(nic);
    }
    Ok(out)
}

/// A NIC of `vm.add-net`, and whether the body names its tap: a client that passes the tap's
/// file (libvirt) names none, and the caller fills in the tap that file is attached to.
pub fn added_net(body: &Value) -> Result<(Net, bool), ApiError> {
    nic(body, "NetConfig")
}

fn nic(net: &Value, path: &str) -> Result<(Net, bool), ApiError> {
    let map = fields(net, path, NET_USED, NET)?;
    let tap = string(map, path, "tap")?;
    let named = tap.is_some();
    let nic = Net {
        tap: tap.unwrap_or_default(),
        mac: string(map, path, "mac")?,
        file: None,
        id: string(map, path, "id")?,
    };
    Ok((nic, named))
}

fn console(
    value: Option<&Value>,
    path: &str,
    absent: ConsoleMode,
) -> Result<ConsoleMode, ApiError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(absent);
    };
    let map = fields(value, path, CONSOLE_USED, CONSOLE)?;
    let mode = string(map, path, "mode")?.ok_or_else(|| bad(format!("{path}.mode is required")))?;
    let file = string(map, path, "file")?;
    let socket = string(map, path, "socket")?;
    let out = match (mode.as_str(), file, socket) {
        ("Off" | "Null", None, None) => ConsoleMode::Off,
        ("Tty", None, None) => ConsoleMode::Tty,
        // vm.info names the pty it opened; a config posted back gets a new one.
        ("Pty", _, None) => ConsoleMode::Pty(None),
        ("File", Some(f), None) => ConsoleMode::File(f),
        ("Socket", None, Some(s)) => ConsoleMode::Socket(s),
        ("File", None, _) => return Err(bad(format!("{path}.mode File needs {path}.file"))),
        ("Socket", _, None) => {
            return Err(bad(format!("{path}.mode Socket needs {path}.socket")));
        }
        ("Off" | "Null" | "Tty" | "Pty" | "File" | "Socket", _, _) => {
            return Err(bad(format!(
                "{path}: file is only for mode File, socket only for mode Socket"
            )));
        }
        (other, _, _) => {
            return Err(bad(format!(
                "{path}.mode={other}: ferry takes Off, Null, Tty, Pty, File or Socket"
            )));
        }
    };
    Ok(out)
}

fn mode_name(m: &ConsoleMode) -> &'static str {
    match m {
        ConsoleMode::Off => "Off",
        ConsoleMode::Tty => "Tty",
        ConsoleMode::File(_) => "File",
        ConsoleMode::Pty(_) => "Pty",
        ConsoleMode::Socket(_) => "Socket",
    }
}

impl ConsoleMode {
    /// CH's JSON for it.
    fn to_json(&self) -> Value {
        match self {
            ConsoleMode::File(f) | ConsoleMode::Pty(Some(f)) => {
                json!({"mode": mode_name(self), "file": f})
            }
            ConsoleMode::Socket(s) => json!({"mode": "Socket", "socket": s}),
            m => json!({"mode": mode_name(m)}),
        }
    }
}

impl Net {
    /// Its id: the client's, or `_netN` by its place among the NICs.
    pub fn name(&self, index: usize) -> String {
        self.id.clone().unwrap_or_else(|| format!("_net{index}"))
    }
}

impl VmSpec {
    /// Where the guest's serial port writes. ferry has one serial port and no virtio-console,
    /// so a console is the serial port too: its output goes where `serial` says and where
    /// `console` says (a guest's `console=ttyS0` is what a console shows here), but for a
    /// `Tty` console (CH's default) beside a serial of its own, which would only repeat the
    /// serial on standard output.
    pub fn serial_ports(&self) -> Vec<&ConsoleMode> {
        let mut ports = Vec::new();
        if self.serial != ConsoleMode::Off {
            ports.push(&self.serial);
        }
        let repeat = self.console == ConsoleMode::Tty && self.serial != ConsoleMode::Off;
        if self.console != ConsoleMode::Off && self.console != self.serial && !repeat {
            ports.push(&self.console);
        }
        ports
    }

    /// Records the pseudo-terminal `path` the serial port was given, on the serial and on a
    /// console that is its twin.
    pub fn set_pty(&mut self, path: &str) {
        for m in [&mut self.serial, &mut self.console] {
            if matches!(m, ConsoleMode::Pty(_)) {
                *m = ConsoleMode::Pty(Some(path.to_string()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(body: Value) -> Result<VmSpec, String> {
        VmSpec::from_json(&body).map_err(|e| e.message)
    }

    #[test]
    fn takes_what_ferry_honours_and_defaults_of_the_rest() {
        let s = spec(json!({
            "payload": {"kernel": "/k", "cmdline": "idle"},
            "cpus": {"boot_vcpus": 2, "max_vcpus": 2, "kvm_hyperv": false},
            "memory": {"size": 1073741824u64, "hugepages": false, "thp": true},
            "disks": [{"path": "/d", "readonly": true, "num_queues": 1, "id": "_disk0"}],
            "net": [{"tap": "tap0", "mac": "52:54:00:00:00:01"}],
            "serial": {"mode": "File", "file": "/s"},
            "console": {"mode": "Off"},
            "iommu": false,
            "rng": null
        }))
        .unwrap();
        assert_eq!((s.vcpus, s.memory_bytes), (2, 1 << 30));
        assert_eq!(s.serial, ConsoleMode::File("/s".into()));
        assert!(s.disks[0].readonly);
        let again = spec(s.to_json()).unwrap();
        assert_eq!(again, s, "vm.info's config is a config ferry takes back");
    }

    /// What Cloud Hypervisor v54's `vm.info` gave for a VM created with a kernel, 2 vCPUs,
    /// one disk and one NIC, everything else left to CH (recorded from CH built at
    /// ae44c2971): taken as it is, and what ferry takes of it is what CH runs.
    #[test]
    fn a_config_cloud_hypervisor_wrote_is_taken() {
        let info: Value =
            serde_json::from_str(include_str!("testdata/ch-v54-vm-info.json")).unwrap();
        let s = spec(info["config"].clone()).unwrap();
        assert_eq!(
            (
                s.vcpus,
                s.memory_bytes,
                s.kernel.as_str(),
                s.cmdline.as_str()
            ),
            (
                2,
                256 << 20,
                "/work/main/guest/build/guest.elf",
                "write ws=16M seq"
            )
        );
        assert_eq!(
            s.disks,
            [Disk {
                path: "/tmp/chdbg/disk.raw".into(),
                readonly: false
            }]
        );
        assert_eq!(
            (s.nets[0].tap.as_str(), s.nets[0].mac.as_deref()),
            ("chtap0", Some("52:54:00:12:34:56"))
        );
        assert_eq!(s.serial_ports(), Vec::<&ConsoleMode>::new());
    }

    /// The same with every field written out, nulls included (rng, debug_console, the CPU's
    /// address bits and features, a Tty console), with a field a newer CH adds: taken, and
    /// what ferry takes of it is what CH runs.
    #[test]
    fn chs_own_vm_info_config_is_taken() {
        let info = json!({
            "cpus": {"boot_vcpus": 2, "max_vcpus": 2, "topology": null, "kvm_hyperv": false,
                     "max_phys_bits": 46, "affinity": null, "features": {"amx": false},
                     "nested": true},
            "memory": {"size": 1073741824u64, "mergeable": false, "hotplug_method": "Acpi",
                       "hotplug_size": null, "hotplugged_size": null, "shared": false,
                       "hugepages": false, "hugepage_size": null, "prefault": false,
                       "zones": null, "thp": true},
            "payload": {"firmware": null, "kernel": "/k", "cmdline": "console=ttyS0",
                        "initramfs": null},
            "rate_limit_groups": null,
            "disks": [{"path": "/d.img", "readonly": false, "direct": false, "iommu": false,
                       "num_queues": 1, "queue_size": 128, "vhost_user": false,
                       "vhost_socket": null, "rate_limit_group": null,
                       "rate_limiter_config": null, "id": "_disk0", "disable_io_uring": false,
                       "disable_aio": false, "pci_segment": 0, "serial": null,
                       "queue_affinity": null}],
            "net": [{"tap": "tap0", "ip": "192.168.249.1", "mask": "255.255.255.0",
                     "mac": "52:54:00:00:00:01", "host_mac": null, "mtu": null, "iommu": false,
                     "num_queues": 2, "queue_size": 256, "vhost_user": false,
                     "vhost_socket": null, "vhost_mode": "Client", "id": "_net1", "fds": null,
                     "rate_limiter_config": null, "pci_segment": 0, "offload_tso": true,
                     "offload_ufo": true, "offload_csum": true}],
            "rng": {"src": "/dev/urandom", "iommu": false},
            "balloon": null, "fs": null, "pmem": null,
            "serial": {"file": null, "mode": "Null", "iommu": false, "socket": null},
            "console": {"file": null, "mode": "Tty", "iommu": false, "socket": null},
            "debug_console": {"file": null, "mode": "Off", "iobase": 233},
            "devices": null, "user_devices": null, "vdpa": null, "vsock": null,
            "pvpanic": false, "iommu": false, "numa": null, "watchdog": false,
            "platform": null, "tpm": null, "preserved_fds": null, "landlock_enable": false,
            "landlock_rules": null,
            "a_field_of_a_newer_ch": {"x": 1}
        });
        let s = spec(info).unwrap();
        assert_eq!(
            (s.vcpus, s.memory_bytes, s.disks.len(), s.nets.len()),
            (2, 1 << 30, 1, 1)
        );
        assert_eq!(s.serial_ports(), [&ConsoleMode::Tty]);
        // CH's defaults that mean a device ferry lacks, given otherwise, are still refused.
        let e =
            spec(json!({"payload": {"kernel": "/k"}, "rng": {"src": "/dev/random"}})).unwrap_err();
        assert!(e.contains("rng="), "{e}");
        let e =
            spec(json!({"payload": {"kernel": "/k"}, "cpus": {"max_phys_bits": 39}})).unwrap_err();
        assert!(e.contains("cpus.max_phys_bits=39"), "{e}");
    }

    /// libvirt's `<console type='pty'>`: the serial port goes to a pseudo-terminal, whose
    /// path `vm.info` then gives on the console (and on a serial that is its twin).
    #[test]
    fn a_pty_console_is_the_serial_port() {
        let mut s = spec(json!({"payload": {"kernel": "/k"}, "console": {"mode": "Pty"}})).unwrap();
        assert_eq!(s.serial_ports(), [&ConsoleMode::Pty(None)]);
        s.set_pty("/dev/pts/7");
        let info = s.to_json();
        assert_eq!(
            info["console"],
            json!({"mode": "Pty", "file": "/dev/pts/7"})
        );
        assert_eq!(info["serial"], json!({"mode": "Off"}));
        assert_eq!(spec(info).unwrap().console, ConsoleMode::Pty(None));
        // CH's defaults (serial Null, console Tty): standard output, as CH's console goes.
        let defaults = json!({"payload": {"kernel": "/k"}, "serial": {"mode": "Null"}, "console": {"mode": "Tty"}});
        assert_eq!(spec(defaults).unwrap().serial_ports(), [&ConsoleMode::Tty]);
        let socket = json!({"payload": {"kernel": "/k"}, "serial": {"mode": "Socket", "socket": "/run/s"}, "console": {"mode": "Tty"}});
        let socket = spec(socket).unwrap();
        assert_eq!(
            socket.serial_ports(),
            [&ConsoleMode::Socket("/run/s".into())]
        );
        // Virtink's: a Tty serial and a Pty console, both the serial port.
        let virtink = json!({"payload": {"kernel": "/k"}, "serial": {"mode": "Tty"}, "console": {"mode": "Pty"}});
        let both = [&ConsoleMode::Tty, &ConsoleMode::Pty(None)];
        assert_eq!(spec(virtink).unwrap().serial_ports(), both);
        assert_eq!(spec(socket.to_json()).unwrap(), socket);
    }

    #[test]
    fn refuses_what_it_cannot_honour_naming_it() {
        let with = |extra: Value| {
            let mut body = json!({"payload": {"kernel": "/k"}});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            spec(body).unwrap_err()
        };
        let e = with(json!({"memory": {"size": 4096, "hugepages": true}}));
        assert!(e.contains("memory.hugepages=true"), "{e}");
        let e = with(json!({"disks": [{"path": "/d", "direct": true}]}));
        assert!(e.contains("disks[0].direct=true"), "{e}");
        let e = with(json!({"cpus": {"boot_vcpus": 1, "max_vcpus": 4}}));
        assert!(e.contains("cpus.max_vcpus=4"), "{e}");
        let e = with(json!({"serial": {"mode": "Socket"}}));
        assert!(e.contains("serial.mode Socket needs serial.socket"), "{e}");
        let e = with(json!({"serial": {"mode": "Telnet"}}));
        assert!(e.contains("serial.mode=Telnet"), "{e}");
        let e = with(json!({"balloon": {"size": 1}}));
        assert!(e.contains("balloon"), "{e}");
        let e = spec(json!({"payload": {"firmware": "/fw"}})).unwrap_err();
        assert!(e.contains("payload.firmware"), "{e}");
    }
}
