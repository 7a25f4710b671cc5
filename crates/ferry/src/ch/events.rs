//! `--event-monitor`: Cloud Hypervisor's event stream — one JSON object per line, each in one
//! `write` as it happens: `{"timestamp":{"secs":S,"nanos":N},"source":"vm","event":"booted",
//! "properties":null}`. The timestamp is the time since the VMM started, as CH's is. One write
//! per event matters: libvirt's reader takes what one read returns as whole events, and on a
//! pipe a line cut in pieces is taken as broken ones.

use migration::sync::Locked;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Mutex;
use std::time::Instant;

use serde_json::json;

pub struct Events {
    out: Option<Mutex<Box<dyn Write + Send>>>,
    started: Instant,
}

impl Events {
    /// Events to `out`, or nowhere.
    pub fn new(out: Option<Box<dyn Write + Send>>) -> Self {
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
        let mut text = line.to_string();
        text.push('\n');
        let _ = out.locked().write_all(text.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// Counts the writes it is given.
    struct Writes(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Write for Writes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn each_event_is_one_write() {
        let writes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let events = Events::new(Some(Box::new(Writes(writes.clone()))));
        events.emit("vmm", "starting", &[]);
        events.emit("vm", "migration-progress", &[("round", "2".into())]);
        assert_eq!(writes.load(std::sync::atomic::Ordering::Relaxed), 2);
    }

    #[test]
    fn one_object_per_line() {
        let mut file = tempfile::tempfile().unwrap();
        let events = Events::new(Some(Box::new(file.try_clone().unwrap())));
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
