//! Cloud Hypervisor's command line (`--api-socket path=…|fd=N`, `--kernel`, `--memory
//! size=…`, `--disk path=…,readonly=on`, …), read into the same `VmConfig` JSON a `vm.create`
//! carries, so that one reader (`api::ch::VmSpec`) decides what ferry honours.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Result, anyhow, bail};
use api::ch::{ConsoleMode, VmSpec};
use serde_json::{Map, Value, json};

use crate::metrics::MetricsAddr;

/// A socket or file given by path or as an inherited file descriptor.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    Path(PathBuf),
    Fd(i32),
}

#[derive(Debug, Default)]
pub struct ChArgs {
    pub api_socket: Option<Target>,
    pub event_monitor: Option<Target>,
    /// The VM to create and boot at once (`--kernel` given).
    pub spec: Option<VmSpec>,
    /// Where an arriving VM's serial port goes (`--serial` without `--kernel`).
    pub arrival_serial: Option<ConsoleMode>,
    /// TCP migrations without `tls_dir` allowed, as CH allows them (not with ferry's own
    /// `--require-tls`).
    pub plain_tcp: bool,
    /// ferry's own: where to serve OpenMetrics (`--metrics tcp:HOST:PORT|unix:PATH`).
    pub metrics: Option<MetricsAddr>,
    /// ferry's own: the bearer token a scrape must carry (`--metrics-token-file FILE`).
    pub metrics_token_file: Option<PathBuf>,
    /// ferry's own: directories the files an arriving VM names may lie in: its disks, its
    /// serial port's file or socket, its payload to boot again (`--allow-disk-dir`).
    pub allow_disk_dirs: Vec<PathBuf>,
    /// ferry's own: taps an arriving VM's NICs may attach to (`--allow-tap NAME|PREFIX*`).
    pub allow_taps: Vec<String>,
    /// CH's `--seccomp true|false`: ferry's sandbox, on unless `false`.
    pub sandbox: bool,
    /// CH's `--landlock`: the process reaches only the files its flags name (docs/security.md).
    pub landlock: bool,
    /// CH's `--landlock-rules path=PATH,access=r|w|rw ...`: more it may reach.
    pub landlock_rules: Vec<vmm::landlock::Rule>,
    pub version: bool,
}

/// The flags, each with the values that follow it (`--disk a b` gives two disks, as CH's do).
fn flags(argv: &[String]) -> Result<BTreeMap<String, Vec<String>>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for arg in argv {
        if let Some(name) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) {
            let (name, value) = match name.split_once('=') {
                Some((n, v)) if !["api-socket", "event-monitor"].contains(&n) => {
                    (n.to_string(), Some(v.to_string()))
                }
                _ => (name.to_string(), None),
            };
            let values = out.entry(name.clone()).or_default();
            values.extend(value);
            current = Some(name);
        } else {
            let name = current
                .clone()
                .ok_or_else(|| anyhow!("'{arg}' follows no flag"))?;
            out.entry(name).or_default().push(arg.clone());
        }
    }
    Ok(out)
}

/// `key=value,key=value` with only `allowed` keys.
fn options<'a>(flag: &str, s: &'a str, allowed: &[&str]) -> Result<BTreeMap<&'a str, &'a str>> {
    let mut out = BTreeMap::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| anyhow!("--{flag} '{s}': '{part}' is not key=value"))?;
        if !allowed.contains(&k) {
            bail!(
                "--{flag} '{s}': ferry does not support '{k}' (it takes {})",
                allowed.join(", ")
            );
        }
        out.insert(k, v);
    }
    Ok(out)
}

fn on_off(flag: &str, key: &str, v: &str) -> Result<bool> {
    match v {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        _ => bail!("--{flag} {key}={v}: use on or off"),
    }
}

fn target(flag: &str, s: &str) -> Result<Target> {
    if let Some(fd) = s.strip_prefix("fd=") {
        let fd = fd
            .parse()
            .map_err(|_| anyhow!("--{flag} {s}: fd must be a number"))?;
        return Ok(Target::Fd(fd));
    }
    let path = s.strip_prefix("path=").unwrap_or(s);
    if path.is_empty() || path.contains(',') {
        bail!("--{flag} '{s}': use path=PATH or fd=N");
    }
    Ok(Target::Path(path.into()))
}

fn one<'a>(flags: &'a BTreeMap<String, Vec<String>>, name: &str) -> Result<Option<&'a str>> {
    match flags.get(name).map(Vec::as_slice) {
        None => Ok(None),
        Some([v]) => Ok(Some(v)),
        Some(_) => bail!("--{name} takes one value"),
    }
}

/// Every value of a flag that may repeat.
fn list<'a>(flags: &'a BTreeMap<String, Vec<String>>, name: &str) -> impl Iterator<Item = &'a str> {
    flags.get(name).into_iter().flatten().map(String::as_str)
}

/// `--serial`/`--console` as CH writes them: off, null, tty, pty, file=PATH, socket=PATH.
fn console(s: &str) -> Value {
    match s.split_once('=') {
        Some(("file", f)) => json!({"mode": "File", "file": f}),
        Some(("socket", p)) => json!({"mode": "Socket", "socket": p}),
        _ => {
            let mut mode = s.to_string();
            if let Some(first) = mode.get_mut(..1) {
                first.make_ascii_uppercase();
            }
            json!({"mode": mode})
        }
    }
}

const KNOWN: &[&str] = &[
    "api-socket",
    "event-monitor",
    "kernel",
    "cmdline",
    "initramfs",
    "memory",
    "cpus",
    "disk",
    "net",
    "serial",
    "console",
    "plain-tcp",
    "require-tls",
    "metrics",
    "metrics-token-file",
    "allow-disk-dir",
    "allow-tap",
    "seccomp",
    "landlock",
    "landlock-rules",
    "v",
    "version",
    "V",
];

pub fn parse(argv: &[String]) -> Result<ChArgs> {
    let flags = flags(argv)?;
    if let Some(unknown) = flags.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        bail!(
            "--{unknown}: ferry's Cloud Hypervisor mode does not take it (docs/orchestrators.md)"
        );
    }
    let mut args = ChArgs {
        api_socket: one(&flags, "api-socket")?
            .map(|s| target("api-socket", s))
            .transpose()?,
        event_monitor: one(&flags, "event-monitor")?
            .map(|s| target("event-monitor", s))
            .transpose()?,
        // CH migrates over plain TCP when no tls_dir is given; --require-tls (ferry's own)
        // refuses that. --plain-tcp, once needed, is the default now.
        plain_tcp: !flags.contains_key("require-tls"),
        metrics: one(&flags, "metrics")?
            .map(|s| s.parse().map_err(|e| anyhow!("--metrics {e}")))
            .transpose()?,
        metrics_token_file: one(&flags, "metrics-token-file")?.map(PathBuf::from),
        allow_disk_dirs: list(&flags, "allow-disk-dir").map(PathBuf::from).collect(),
        allow_taps: list(&flags, "allow-tap").map(String::from).collect(),
        sandbox: match one(&flags, "seccomp")? {
            None | Some("true") => true,
            Some("false") => false,
            Some(other) => {
                bail!("--seccomp {other}: ferry takes true or false (it has no logging mode)")
            }
        },
        landlock: flags.contains_key("landlock"),
        landlock_rules: list(&flags, "landlock-rules")
            .map(|r| r.parse().map_err(|e| anyhow!("--landlock-rules {e}")))
            .collect::<Result<_>>()?,
        version: flags.contains_key("version") || flags.contains_key("V"),
        ..Default::default()
    };
    if !args.landlock_rules.is_empty() && !args.landlock {
        bail!("--landlock-rules needs --landlock");
    }
    let config = config(&flags)?;
    match config {
        Some(config) => {
            args.spec = Some(VmSpec::from_json(&config).map_err(|e| anyhow!(e.message))?)
        }
        None => {
            if let Some(s) = one(&flags, "serial")? {
                let spec = json!({"payload": {"kernel": ""}, "serial": console(s)});
                args.arrival_serial = Some(
                    VmSpec::from_json(&spec)
                        .map_err(|e| anyhow!(e.message))?
                        .serial,
                );
            }
        }
    }
    Ok(args)
}

/// The `VmConfig` the flags describe, when `--kernel` names a payload.
fn config(flags: &BTreeMap<String, Vec<String>>) -> Result<Option<Value>> {
    let Some(kernel) = one(flags, "kernel")? else {
        for f in [
            "cmdline",
            "initramfs",
            "memory",
            "cpus",
            "disk",
            "net",
            "console",
        ] {
            if flags.contains_key(f) {
                bail!("--{f} needs --kernel (or a vm.create)");
            }
        }
        return Ok(None);
    };
    let mut c = Map::new();
    c.insert(
        "payload".into(),
        json!({"kernel": kernel, "cmdline": one(flags, "cmdline")?, "initramfs": one(flags, "initramfs")?}),
    );
    if let Some(m) = one(flags, "memory")? {
        let o = options("memory", m, &["size", "shared"])?;
        let size: vmm::MemorySize = o
            .get("size")
            .ok_or_else(|| anyhow!("--memory '{m}' needs size="))?
            .parse()
            .map_err(|e| anyhow!("--memory size: {e}"))?;
        let shared = o
            .get("shared")
            .map_or(Ok(false), |v| on_off("memory", "shared", v))?;
        c.insert("memory".into(), json!({"size": size.0, "shared": shared}));
    }
    if let Some(cpus) = one(flags, "cpus")? {
        let o = options("cpus", cpus, &["boot", "max"])?;
        let n = |k: &str| -> Result<Option<u64>> {
            o.get(k)
                .map(|v| {
                    v.parse()
                        .map_err(|_| anyhow!("--cpus {k}={v} is not a number"))
                })
                .transpose()
        };
        c.insert(
            "cpus".into(),
            json!({"boot_vcpus": n("boot")?.unwrap_or(1), "max_vcpus": n("max")?}),
        );
    }
    let mut disks = Vec::new();
    for d in flags.get("disk").into_iter().flatten() {
        let o = options("disk", d, &["path", "readonly"])?;
        let readonly = o
            .get("readonly")
            .map_or(Ok(false), |v| on_off("disk", "readonly", v))?;
        disks.push(json!({"path": o.get("path"), "readonly": readonly}));
    }
    c.insert("disks".into(), Value::Array(disks));
    let mut nets = Vec::new();
    for n in flags.get("net").into_iter().flatten() {
        let o = options("net", n, &["tap", "mac"])?;
        nets.push(json!({"tap": o.get("tap"), "mac": o.get("mac")}));
    }
    c.insert("net".into(), Value::Array(nets));
    // CH's defaults: serial null, console tty (a virtio-console; ferry's console is its serial
    // port: see VmSpec::serial_ports).
    c.insert(
        "serial".into(),
        console(one(flags, "serial")?.unwrap_or("null")),
    );
    c.insert(
        "console".into(),
        console(one(flags, "console")?.unwrap_or("tty")),
    );
    Ok(Some(Value::Object(c)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn reads_cloud_hypervisors_flags() {
        let a = parse(&argv(
            "--api-socket fd=3 --kernel /k --cmdline idle --memory size=1G --cpus boot=2 \
             --disk path=/a,readonly=on path=/b --net tap=t0,mac=52:54:00:00:00:01 \
             --serial file=/s --event-monitor path=/e --metrics unix:/m",
        ))
        .unwrap();
        assert_eq!(a.api_socket, Some(Target::Fd(3)));
        assert_eq!(a.metrics, Some(MetricsAddr::Unix("/m".into())));
        assert_eq!(a.event_monitor, Some(Target::Path("/e".into())));
        let s = a.spec.unwrap();
        assert_eq!((s.memory_bytes, s.vcpus, s.disks.len()), (1 << 30, 2, 2));
        assert!(s.disks[0].readonly && !s.disks[1].readonly);
        assert_eq!(s.serial, ConsoleMode::File("/s".into()));
        let a = parse(&argv("--api-socket /x.sock")).unwrap();
        assert_eq!(a.api_socket, Some(Target::Path("/x.sock".into())));
        assert!(a.spec.is_none());
    }

    #[test]
    fn names_what_it_cannot_take() {
        let e = parse(&argv("--kernel /k --memory size=1G,hugepages=on")).unwrap_err();
        assert!(e.to_string().contains("'hugepages'"), "{e}");
        let e = parse(&argv("--api-socket /a --metrics 9100")).unwrap_err();
        assert!(e.to_string().contains("--metrics 9100"), "{e}");
        let pty = parse(&argv("--kernel /k --console pty --serial file=/s"))
            .unwrap()
            .spec
            .unwrap();
        let both = [&ConsoleMode::File("/s".into()), &ConsoleMode::Pty(None)];
        assert_eq!(pty.serial_ports(), both);
        let e = parse(&argv("--seccomp log")).unwrap_err();
        assert!(e.to_string().contains("--seccomp log"), "{e}");
    }

    /// As CH, a `tcp:` migration without `tls_dir` goes in clear, unless `--require-tls`.
    #[test]
    fn plain_tcp_as_ch_unless_tls_is_required() {
        assert!(parse(&argv("--api-socket /a")).unwrap().plain_tcp);
        assert!(
            parse(&argv("--api-socket /a --plain-tcp"))
                .unwrap()
                .plain_tcp
        );
        assert!(
            !parse(&argv("--api-socket /a --require-tls"))
                .unwrap()
                .plain_tcp
        );
    }

    /// CH's `--seccomp` turns ferry's sandbox off with `false`; it is on otherwise.
    #[test]
    fn seccomp_is_the_sandbox() {
        assert!(parse(&argv("--api-socket /a")).unwrap().sandbox);
        assert!(
            parse(&argv("--api-socket /a --seccomp true"))
                .unwrap()
                .sandbox
        );
        assert!(
            !parse(&argv("--api-socket /a --seccomp false"))
                .unwrap()
                .sandbox
        );
        let a = parse(&argv(
            "--api-socket /a --metrics-token-file /t --metrics unix:/m",
        ))
        .unwrap();
        assert_eq!(a.metrics_token_file, Some("/t".into()));
    }
}
