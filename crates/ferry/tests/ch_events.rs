//! ferry's event stream against Cloud Hypervisor's own. The same calls, in the same order,
//! drive a VMM exec'd under the name `cloud-hypervisor` (as libvirt, Virtink and Kata exec
//! it), and what each call makes the VMM say is compared with what Cloud Hypervisor v54 said
//! to the same calls: tests/data/ch-v54-events.json, written by
//! `record_cloud_hypervisors_stream` (ignored: it needs a Cloud Hypervisor binary, named by
//! `FERRY_CH_BINARY`).
//!
//! Compared per call: each event's source, name and property names, in order; a run of the
//! same event said again (a pre-copy round each) counts as one, since the number of rounds
//! is the guest's doing. Times and property values are not compared, nor ferry's own
//! `migration` `progress` events (a source of its own, which CH's readers pass over).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::ch_api::call;
use common::{FERRY, guest, kvm_available, repo_root, wait_for};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

const RECORDING: &str = "crates/ferry/tests/data/ch-v54-events.json";

/// One event as compared: where it came from, its name, and the names of its properties.
#[derive(Serialize, Deserialize, PartialEq, Eq, Debug, Clone)]
struct Event {
    source: String,
    event: String,
    properties: Vec<String>,
}

/// What one VMM said to one call.
#[derive(Serialize, Deserialize, PartialEq, Eq, Debug)]
struct Step {
    vmm: String,
    call: String,
    events: Vec<Event>,
}

#[derive(Serialize, Deserialize)]
struct Recording {
    recorded_with: String,
    steps: Vec<Step>,
}

/// A VMM process exec'd as `cloud-hypervisor`, with its API socket and event monitor; killed
/// when dropped.
struct Vmm {
    name: &'static str,
    child: Child,
    socket: PathBuf,
    events: PathBuf,
    /// How many events earlier steps took.
    taken: usize,
}

impl Vmm {
    fn start(binary: &[String], dir: &Path, name: &'static str) -> Vmm {
        let socket = dir.join(format!("{name}.sock"));
        let events = dir.join(format!("{name}.events"));
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        let child = Command::new(&binary[0])
            .args(&binary[1..])
            .arg("--api-socket")
            .arg(format!("path={}", socket.display()))
            .arg("--event-monitor")
            .arg(format!("path={}", events.display()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", binary[0]));
        let vmm = Vmm {
            name,
            child,
            socket,
            events,
            taken: 0,
        };
        wait_for("the API", Duration::from_secs(10), || {
            (call(&vmm.socket, "GET", "vmm.ping", None).0 == 200).then_some(())
        });
        vmm
    }

    fn ok(&self, method: &str, endpoint: &str, body: Option<Value>) {
        let (status, answer) = call(&self.socket, method, endpoint, body);
        assert!(
            status == 200 || status == 204,
            "{}: {endpoint}: {status} {answer}",
            self.name
        );
    }

    /// Every event so far.
    fn said(&self) -> Vec<Event> {
        let text = std::fs::read_to_string(&self.events).unwrap_or_default();
        let mut events = Vec::new();
        // CH writes each event as pretty-printed JSON, one after the other; ferry as a line.
        for e in serde_json::Deserializer::from_str(&text).into_iter::<Value>() {
            let e = e.unwrap_or_else(|e| panic!("{}: an event that is not JSON: {e}", self.name));
            let name = |k: &str| e[k].as_str().unwrap_or_default().to_string();
            let mut properties: Vec<String> = e["properties"]
                .as_object()
                .map(|p| p.keys().cloned().collect())
                .unwrap_or_default();
            properties.sort();
            events.push(Event {
                source: name("source"),
                event: name("event"),
                properties,
            });
        }
        events
    }

    /// The events since the last step, through the one `until` waits for.
    fn step(&mut self, call: &str, until: Until) -> Step {
        let what = format!("{}: {call}: {until:?}", self.name);
        let events = wait_for(&what, Duration::from_secs(60), || {
            let mut all = self.said();
            let new = all.split_off(self.taken.min(all.len()));
            match until {
                Until::Answered => Some(new),
                Until::Said(name) => {
                    let last = new.iter().position(|e| e.event == name)?;
                    Some(new[..=last].to_vec())
                }
                // A VMM that exited has said everything: read once more after it did.
                Until::Exited => self.child.try_wait().unwrap().map(|_| {
                    let all = self.said();
                    all[self.taken.min(all.len())..].to_vec()
                }),
            }
        });
        self.taken += events.len();
        Step {
            vmm: self.name.to_string(),
            call: call.to_string(),
            events,
        }
    }

    fn call_and_step(&mut self, endpoint: &str, body: Option<Value>, until: Until) -> Step {
        self.ok("PUT", endpoint, body);
        self.step(endpoint, until)
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// When a step's events are all there.
#[derive(Debug, Clone, Copy)]
enum Until {
    /// With the answer (the VMM says nothing later for this call).
    Answered,
    /// Once this event is said.
    Said(&'static str),
    /// Once the VMM exited.
    Exited,
}

/// A VM with no device the guest would drive, so that both VMMs see the same guest: the
/// workload guest writing 16 MiB. No serial file either: ferry's receiver opens none that
/// its operator did not allow (`--allow-disk-dir`), a flag Cloud Hypervisor lacks.
fn config() -> Value {
    json!({
        "payload": {"kernel": guest(), "cmdline": "write ws=16M seq"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 256u64 << 20},
        "serial": {"mode": "Null"},
        "console": {"mode": "Off"},
    })
}

/// The calls, in order, and what each VMM said to each: a VM's life on one VMM (boot, pause,
/// snapshot, resume, reboot), its live migration to a second (which shuts it down, boots it
/// again from the config that came with it, and exits), and the snapshot restored on a third
/// (resumed, deleted while running, and the VMM shut down). `binary`: the command line, to
/// which each VMM's API socket and event monitor are added.
fn drive(binary: &[String]) -> Vec<Step> {
    let dir = tempfile::tempdir().unwrap();
    let mut steps = Vec::new();
    let mut a = Vmm::start(binary, dir.path(), "a");
    steps.push(a.step("start", Until::Said("starting")));
    steps.push(a.call_and_step("vm.create", Some(config()), Until::Answered));
    steps.push(a.call_and_step("vm.boot", None, Until::Said("booted")));
    steps.push(a.call_and_step("vm.pause", None, Until::Said("paused")));
    let snapshot = dir.path().join("snapshot");
    std::fs::create_dir(&snapshot).unwrap();
    let url = format!("file://{}", snapshot.display());
    let body = json!({"destination_url": url});
    steps.push(a.call_and_step("vm.snapshot", Some(body), Until::Said("snapshotted")));
    steps.push(a.call_and_step("vm.resume", None, Until::Said("resumed")));
    steps.push(a.call_and_step("vm.reboot", None, Until::Said("rebooted")));

    let mut b = Vmm::start(binary, dir.path(), "b");
    steps.push(b.step("start", Until::Said("starting")));
    let migration = format!("unix:{}", dir.path().join("migration.sock").display());
    let receiver = {
        let (socket, url) = (b.socket.clone(), migration.clone());
        std::thread::spawn(move || {
            call(
                &socket,
                "PUT",
                "vm.receive-migration",
                Some(json!({"receiver_url": url})),
            )
        })
    };
    steps.push(b.step(
        "vm.receive-migration",
        Until::Said("migration-receive-ready"),
    ));
    let body = json!({"destination_url": migration});
    steps.push(a.call_and_step("vm.send-migration", Some(body), Until::Exited));
    let (status, answer) = receiver.join().unwrap();
    assert!(status == 200 || status == 204, "receive: {status} {answer}");
    steps.push(b.step(
        "vm.receive-migration",
        Until::Said("migration-receive-finished"),
    ));
    steps.push(b.call_and_step("vm.shutdown", None, Until::Said("shutdown")));
    steps.push(b.call_and_step("vm.boot", None, Until::Said("booted")));
    steps.push(b.call_and_step("vmm.shutdown", None, Until::Exited));

    let mut c = Vmm::start(binary, dir.path(), "c");
    steps.push(c.step("start", Until::Said("starting")));
    let body = json!({"source_url": url});
    steps.push(c.call_and_step("vm.restore", Some(body), Until::Said("restored")));
    steps.push(c.call_and_step("vm.resume", None, Until::Said("resumed")));
    steps.push(c.call_and_step("vm.delete", None, Until::Said("deleted")));
    steps.push(c.call_and_step("vmm.shutdown", None, Until::Exited));
    steps
}

/// A run of the same event said again counts once.
fn collapsed(events: &[Event]) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::new();
    for e in events {
        if out.last() != Some(e) {
            out.push(e.clone());
        }
    }
    out
}

fn recording() -> Recording {
    let path = repo_root().join(RECORDING);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{RECORDING}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{RECORDING}: {e}"))
}

/// ferry, exec'd as `cloud-hypervisor`, says to every call what Cloud Hypervisor said.
#[test]
fn every_call_says_what_cloud_hypervisor_said() {
    if !kvm_available() {
        return;
    }
    let recorded = recording();
    let bin = tempfile::tempdir().unwrap();
    let ferry = bin.path().join("cloud-hypervisor");
    std::os::unix::fs::symlink(FERRY, &ferry).unwrap();
    // The payload's directory: ferry boots an arrived VM again only from a payload its own
    // operator allowed (a peer does not choose host files); Cloud Hypervisor has no such rule.
    let allow = guest().parent().unwrap().display().to_string();
    let steps = drive(&[
        ferry.display().to_string(),
        "--allow-disk-dir".into(),
        allow,
    ]);
    assert_eq!(
        steps.len(),
        recorded.steps.len(),
        "the calls changed: record again"
    );
    let mut differences = Vec::new();
    for (ours, theirs) in steps.iter().zip(&recorded.steps) {
        assert_eq!((&ours.vmm, &ours.call), (&theirs.vmm, &theirs.call));
        let ours_said: Vec<Event> = (ours.events.iter())
            .filter(|e| e.source != "migration")
            .cloned()
            .collect();
        let (ours_said, theirs_said) = (collapsed(&ours_said), collapsed(&theirs.events));
        if ours_said != theirs_said {
            differences.push(format!(
                "VMM {} to {}:\n  ferry: {}\n  CH:    {}",
                ours.vmm,
                ours.call,
                brief(&ours_said),
                brief(&theirs_said)
            ));
        }
    }
    assert!(
        differences.is_empty(),
        "ferry said otherwise than {}:\n{}",
        recorded.recorded_with,
        differences.join("\n")
    );
}

/// Events as `source/event(property,…)`, one after the other.
fn brief(events: &[Event]) -> String {
    let one = |e: &Event| format!("{}/{}({})", e.source, e.event, e.properties.join(","));
    events.iter().map(one).collect::<Vec<_>>().join(" ")
}

/// Writes the recording from a real Cloud Hypervisor: `FERRY_CH_BINARY=/path/to/
/// cloud-hypervisor FERRY_CH_ORIGIN="(built at …)" cargo test --test ch_events -- --ignored`.
#[test]
#[ignore = "needs a Cloud Hypervisor binary (FERRY_CH_BINARY)"]
fn record_cloud_hypervisors_stream() {
    let binary = PathBuf::from(std::env::var("FERRY_CH_BINARY").expect("FERRY_CH_BINARY"));
    let version = Command::new(&binary).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&version.stdout);
    // Where the binary came from (its commit, local changes), as the recorder says it.
    let origin = std::env::var("FERRY_CH_ORIGIN").unwrap_or_default();
    let recorded_with = format!("{} {origin}", version.lines().next().unwrap_or_default());
    let steps = drive(&[binary.display().to_string()]);
    let text = serde_json::to_string_pretty(&Recording {
        recorded_with,
        steps,
    })
    .unwrap();
    std::fs::write(repo_root().join(RECORDING), text + "\n").unwrap();
}

/// The comparison itself: a changed name, source or property is a difference; repeats are not.
#[test]
fn a_repeated_event_counts_once_and_anything_else_differs() {
    let e = |source: &str, event: &str, properties: &[&str]| Event {
        source: source.into(),
        event: event.into(),
        properties: properties.iter().map(|p| p.to_string()).collect(),
    };
    let round = e("vm", "migration-memory-iteration", &["id"]);
    let three = [
        round.clone(),
        round.clone(),
        round.clone(),
        e("vm", "paused", &[]),
    ];
    assert_eq!(collapsed(&three), collapsed(&three[1..]));
    assert_ne!(
        collapsed(&[e("vm", "paused", &[])]),
        collapsed(&[e("vmm", "paused", &[])])
    );
    assert_ne!(
        collapsed(std::slice::from_ref(&round)),
        collapsed(&[e("vm", "migration-memory-iteration", &[])])
    );
    assert_ne!(
        collapsed(&[e("vm", "pausing", &[]), e("vm", "paused", &[])]),
        collapsed(&[e("vm", "paused", &[]), e("vm", "pausing", &[])])
    );
}
