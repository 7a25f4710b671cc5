//! `--event-monitor`: Cloud Hypervisor's event stream — one JSON object per line, written and
//! flushed as it happens: `{"timestamp":{"secs":S,"nanos":N},"source":"vm","event":"booted",
//! "properties":null}`. The timestamp is the time since the VMM started, as CH's is.

use migration::sync::Locked;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::sync::Mutex;
use std::time::Instant;

use serde_json::json;

pub struct Events {
    out: Option<Mutex<File>>,
    started: Instant,
}

impl Events {
    /// Events to `out`, or nowhere.
    pub fn new(out: Option<File>) -> Self {
        Self {
            out: out.map(Mutex::new),
            started: Instant::now(),
        }
    }

    /// Writes one event; `properties` are strings, as CH's are. A monitor that went away
    /// (its reader closed the pipe) loses the event, never the VM.
    pub fn emit(&self, source: &str, event: &str, properties: &[(&str, String)]) {
        let Some(out) = &self.out else { return };
        let at = self.started.elapsed();
        let properties = (!properties.is_empty()).then(|| {
            properties
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect::<BTreeMap<_, _>>()
        });
        let line = json!({
            "timestamp": {"secs": at.as_secs(), "nanos": at.subsec_nanos()},
            "source": source,
            "event": event,
            "properties": properties,
        });
        let mut out = out.locked();
        let _ = writeln!(out, "{line}").and_then(|_| out.flush());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn one_object_per_line() {
        let mut file = tempfile::tempfile().unwrap();
        let events = Events::new(Some(file.try_clone().unwrap()));
        events.emit("vmm", "starting", &[]);
        events.emit("vm", "migration-progress", &[("round", "2".into())]);
        let mut text = String::new();
        use std::io::Seek;
        file.rewind().unwrap();
        file.read_to_string(&mut text).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines[0]["event"], "starting");
        assert!(lines[0]["properties"].is_null());
        assert_eq!(lines[1]["properties"]["round"], "2");
        assert!(lines[1]["timestamp"]["nanos"].is_u64());
    }
}
