//! The receiving side: build the VM the stream describes, fill its memory, load its state,
//! and resume it only when everything arrived intact and the source said `Go`.
//! On any failure the VM is never resumed and the source is told why.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bitmap::Bitmap;
use crate::error::{Error, Result};
use crate::pages::{PageReceiver, memory_checksum};
use crate::postcopy;
use crate::precopy::now_ns;
use crate::protocol::{self, Control, Frame, StreamMode};
use crate::stats::{MigrationPhase, RoundStats, SharedStatus, lock};
use crate::transport::{Endpoint, Listener, Stream};
use crate::vm::{Migratable, VmDescriptor};

/// Where a VM comes from.
#[derive(Clone, Debug)]
pub enum Incoming {
    Listen(Endpoint),
    Snapshot(std::path::PathBuf),
}

/// A VM that arrived and runs, with the connection to report back on.
pub struct Received<V> {
    pub vm: Arc<V>,
    pub stream: Stream,
    pub resumed_at_ns: u64,
    /// A post-copy whose connection broke after the switch, to carry on with
    /// `postcopy::resume_destination`.
    pub interrupted: Option<Arc<postcopy::Destination>>,
}

/// An incoming VM's source, bound or opened but not yet read.
pub enum Pending {
    Listening(Listener),
    Snapshot(Stream),
}

impl Incoming {
    /// Binds the listener (or opens the file) so that a peer can connect from now on.
    pub fn prepare(&self) -> Result<Pending> {
        Ok(match self {
            Incoming::Listen(endpoint) => Pending::Listening(endpoint.listen()?),
            Incoming::Snapshot(path) => Pending::Snapshot(open_snapshot(path)?),
        })
    }
}

impl Pending {
    /// Waits for the one incoming connection (a snapshot is there already).
    pub fn accept(self) -> Result<Stream> {
        match self {
            Pending::Listening(listener) => listener.accept(),
            Pending::Snapshot(stream) => Ok(stream),
        }
    }
}

fn open_snapshot(path: &Path) -> Result<Stream> {
    std::fs::File::open(path)
        .map(Stream::File)
        .map_err(|e| Error::Transport(format!("cannot open snapshot {}: {e}", path.display())))
}

/// Receives one VM from `stream`. `build` makes a paused, empty VM of the given shape;
/// `on_resumed` gets it the moment it runs (in post-copy, before its memory has all arrived).
pub fn receive_migration<V: Migratable + 'static>(
    mut stream: Stream,
    build: impl FnOnce(&VmDescriptor) -> Result<Arc<V>>,
    on_resumed: impl FnOnce(&Arc<V>),
    status: &SharedStatus,
) -> Result<Received<V>> {
    let started = Instant::now();
    {
        let mut s = lock(status);
        *s = Default::default();
        s.phase = MigrationPhase::Setup;
        s.role = "destination".into();
    }
    let result = receive(&mut stream, build, on_resumed, status, started);
    match result {
        Ok((vm, resumed_at_ns, interrupted)) => Ok(Received {
            vm,
            stream,
            resumed_at_ns,
            interrupted,
        }),
        Err(e) => {
            if stream.has_peer() && !matches!(e, Error::Peer(_)) {
                let _ = stream.set_timeouts(Some(Duration::from_millis(200)));
                let _ = protocol::write_control(
                    &mut stream,
                    &Control::Abort {
                        reason: format!("destination: {e}"),
                    },
                );
            }
            stream.shutdown();
            let mut s = lock(status);
            s.phase = MigrationPhase::Failed;
            s.error = Some(e.to_string());
            Err(e)
        }
    }
}

fn receive<V: Migratable + 'static>(
    stream: &mut Stream,
    build: impl FnOnce(&VmDescriptor) -> Result<Arc<V>>,
    on_resumed: impl FnOnce(&Arc<V>),
    status: &SharedStatus,
    started: Instant,
) -> Result<(Arc<V>, u64, Option<Arc<postcopy::Destination>>)> {
    protocol::read_stream_header(stream)?;
    let (descriptor, mode) = match protocol::read_control(stream)? {
        Control::Hello { vm, mode, source } => {
            tracing::info!("incoming {mode:?} migration from {source}: {vm:?}");
            (vm, mode)
        }
        other => {
            return Err(Error::Protocol(format!(
                "stream starts with {other:?} instead of Hello"
            )));
        }
    };
    let vm = build(&descriptor)?;
    let ram = vm.ram();
    if ram.ranges() != descriptor.ranges {
        return Err(Error::Vm(format!(
            "built RAM at {:x?} for a VM whose RAM lies at {:x?}",
            ram.ranges(),
            descriptor.ranges
        )));
    }
    {
        let mut s = lock(status);
        s.mode = format!("{mode:?}").to_lowercase();
        s.memory_pages = ram.pages();
        s.phase = MigrationPhase::Active;
        s.setup_ms = started.elapsed().as_secs_f64() * 1e3;
    }
    if mode != StreamMode::Snapshot {
        protocol::write_control(
            stream,
            &Control::Ready {
                postcopy: postcopy::supported(),
            },
        )?;
    }

    let mut pages = PageReceiver::new(&ram);
    let mut vcpus: Vec<Option<Vec<u8>>> = vec![None; descriptor.vcpus as usize];
    let mut devices = None;
    let mut pending: Option<Bitmap> = None;
    let mut round_started = Instant::now();
    let (paused_at_ns, source_checksum) = loop {
        match protocol::read_frame(stream)? {
            Frame::Pages { header, len } => pages.receive(stream, &ram, &header, len)?,
            Frame::Control(Control::RoundEnd { round, pages: n }) => {
                let mut s = lock(status);
                s.round = round;
                s.rounds.push(RoundStats {
                    round,
                    pages: n,
                    duration_ms: round_started.elapsed().as_secs_f64() * 1e3,
                    ..Default::default()
                });
                round_started = Instant::now();
            }
            Frame::Control(Control::VcpuState { index, state }) => {
                let slot = vcpus.get_mut(index as usize).ok_or_else(|| {
                    Error::Protocol(format!(
                        "state for vCPU {index} of a {}-vCPU VM",
                        descriptor.vcpus
                    ))
                })?;
                *slot = Some(state);
            }
            Frame::Control(Control::DeviceState { state }) => devices = Some(state),
            Frame::Control(Control::PostcopyPending { pages: n, words }) => {
                if n != ram.gfn_end() || words.len() as u64 != n.div_ceil(64) {
                    return Err(Error::Protocol(format!(
                        "post-copy page map of {n} pages for a guest whose pages end at {}",
                        ram.gfn_end()
                    )));
                }
                let map = Bitmap::from_words(words, n);
                if let Some(bad) = map.iter().find(|&gfn| !ram.contains(gfn)) {
                    return Err(Error::Protocol(format!(
                        "post-copy page map names page {bad:#x}, outside guest RAM"
                    )));
                }
                pending = Some(map);
            }
            Frame::Control(Control::StateEnd {
                paused_at_ns,
                pages_sent,
                memory_checksum,
            }) => {
                if pages_sent != pages.pages {
                    return Err(Error::Protocol(format!(
                        "the source sent {pages_sent} pages but {} arrived",
                        pages.pages
                    )));
                }
                break (paused_at_ns, memory_checksum);
            }
            Frame::Control(Control::Abort { reason }) => return Err(Error::Peer(reason)),
            Frame::Control(other) => {
                return Err(Error::Protocol(format!(
                    "unexpected {other:?} in the stream"
                )));
            }
        }
    };
    let vcpus: Vec<Vec<u8>> = vcpus
        .into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| Error::Protocol(format!("no state for vCPU {i}"))))
        .collect::<Result<_>>()?;
    let devices = devices.ok_or_else(|| Error::Protocol("no device state".into()))?;
    vm.load_state(&vcpus, &devices)?;
    let postcopy = match pending {
        Some(p) => Some(postcopy::Destination::arm(
            ram.clone(),
            p,
            pages.written(),
            source_checksum.is_some(),
        )?),
        None => None,
    };
    // In post-copy the pages are not all here yet: the checksum is taken as they arrive.
    let checksum = match (source_checksum, &postcopy) {
        (Some(_), None) => Some(memory_checksum(&ram)?),
        _ => None,
    };
    {
        let mut s = lock(status);
        s.pages_full = pages.pages;
        s.memory_checksum_source = source_checksum;
        s.memory_checksum_destination = checksum;
        s.phase = MigrationPhase::Switchover;
    }
    if postcopy.is_none() && source_checksum.is_some() && checksum != source_checksum {
        return Err(Error::Protocol(format!(
            "guest memory differs from the source's (checksum {:#x?} here, {source_checksum:#x?} there)",
            checksum
        )));
    }
    if mode != StreamMode::Snapshot {
        protocol::write_control(
            stream,
            &Control::Loaded {
                memory_checksum: checksum,
            },
        )?;
        match protocol::read_control(stream)? {
            Control::Go => {}
            other => return Err(Error::Protocol(format!("expected Go, got {other:?}"))),
        }
    }
    vm.resume()?;
    let resumed_at_ns = now_ns();
    if mode != StreamMode::Snapshot {
        // The VM runs here now; a failure to tell the source changes nothing for it.
        let _ = protocol::write_control(stream, &Control::Resumed { resumed_at_ns });
    }
    on_resumed(&vm);
    if let Some(dest) = postcopy {
        lock(status).postcopy = true;
        dest.attach(stream.try_clone()?);
        dest.spawn_fault_handler();
        match dest.receive_pages(stream) {
            Ok(report) => {
                let mut s = lock(status);
                s.memory_checksum_destination = report.memory_checksum;
                s.postcopy_report = Some(report);
            }
            Err(e) => {
                // The VM lives here now, with part of its memory still on the source. It runs
                // on; the fault handler stays armed, so a vCPU that touches a missing page
                // waits for it instead of seeing zeros. Never exit: this is the newest state.
                dest.detach();
                let mut s = lock(status);
                s.phase = MigrationPhase::Failed;
                s.error = Some(format!(
                    "post-copy interrupted after the switch: {e}; the VM runs on the pages it \
                     has, and vCPUs that touch a page still on the source wait for it \
                     (PUT vm.migrate-resume carries on)"
                ));
                return Ok((vm, resumed_at_ns, Some(Arc::new(dest))));
            }
        }
    }
    let mut s = lock(status);
    s.phase = MigrationPhase::Completed;
    s.downtime_ms = (paused_at_ns != 0 && mode != StreamMode::Snapshot)
        .then(|| resumed_at_ns.saturating_sub(paused_at_ns) as f64 / 1e6);
    s.total_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok((vm, resumed_at_ns, None))
}

/// Tells the source what the guest lived through, once it has run here for a moment.
pub fn send_guest_report(
    stream: &mut Stream,
    observed_downtime_ns: Option<u64>,
    rate: Option<f64>,
) {
    let _ = protocol::write_control(
        stream,
        &Control::GuestReport {
            observed_downtime_ns,
            pages_per_s_after: rate,
        },
    );
    stream.shutdown();
}
