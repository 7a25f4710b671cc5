//! The sending side: live pre-copy, warm (pause first), and cold snapshots to a file.
//!
//! Until the destination confirms it runs the VM, any failure — the peer dies, the link drops,
//! a bad answer, a timeout, a cancel — leaves the source running: vCPUs resumed, dirty
//! logging off, the error in the status.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::bitmap::Bitmap;
use crate::error::{Error, Result};
use crate::memory::GuestRam;
use crate::pages::{PageSender, memory_checksum, populated_pages};
use crate::policy::{self, Decision, Limits, Measured};
use crate::postcopy;
use crate::prepaging::Strategy;
use crate::protocol::{self, Control, StreamMode};
use crate::ratelimit::RateLimiter;
use crate::stats::{MigrationPhase, RoundStats, SharedStatus, lock};
use crate::transport::{Endpoint, Stream};
use crate::vm::Migratable;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Live: rounds while the guest runs, then a short stop-and-copy.
    Precopy,
    /// Pause, send everything, resume on the destination.
    Warm,
    /// Resume on the destination at once with the vCPU state; pages follow on demand and by
    /// push (Hines & Gopalan).
    Postcopy,
    /// One live pre-copy round, then post-copy for what was dirtied since.
    Hybrid,
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "precopy" => Ok(Mode::Precopy),
            "warm" => Ok(Mode::Warm),
            "postcopy" => Ok(Mode::Postcopy),
            "hybrid" => Ok(Mode::Hybrid),
            other => Err(Error::Param(format!(
                "unknown mode '{other}' (use precopy, warm, postcopy or hybrid)"
            ))),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct MigrationParams {
    pub mode: Mode,
    pub max_downtime_ms: u64,
    pub max_bandwidth_mbps: Option<u64>,
    pub max_rounds: u32,
    pub timeout_s: u64,
    /// Both ends checksum guest memory at the switch (costs downtime; for tests).
    pub checksum: bool,
    /// When pre-copy will not converge, switch to post-copy instead of stop-and-copy.
    pub auto_postcopy: bool,
    /// Post-copy push order: bubble (pre-paging around faults) or linear (push only).
    pub prepaging: Strategy,
}

impl Default for MigrationParams {
    fn default() -> Self {
        Self {
            mode: Mode::Precopy,
            max_downtime_ms: 300,
            max_bandwidth_mbps: None,
            max_rounds: 30,
            timeout_s: 600,
            checksum: false,
            auto_postcopy: false,
            prepaging: Strategy::Bubble,
        }
    }
}

impl MigrationParams {
    pub fn validate(&self) -> Result<()> {
        let positive = |name: &str, v: u64| {
            if v == 0 {
                Err(Error::Param(format!("{name} must be positive")))
            } else {
                Ok(())
            }
        };
        positive("max_downtime_ms", self.max_downtime_ms)?;
        positive("max_rounds", u64::from(self.max_rounds))?;
        positive("timeout_s", self.timeout_s)?;
        if let Some(b) = self.max_bandwidth_mbps {
            positive("max_bandwidth_mbps", b)?;
        }
        Ok(())
    }
}

pub(crate) const DEFAULT_BATCH_PAGES: usize = 256;
/// The longest the source waits for its send queue to empty before pausing the guest.
const SWITCH_DRAIN_LIMIT: Duration = Duration::from_secs(2);
/// Rounds without progress before pre-copy gives up iterating (see `policy`).
const MAX_STALLED_ROUNDS: u32 = 3;
/// How long the source waits for the destination's guest report after completion.
const GUEST_REPORT_WAIT: Duration = Duration::from_secs(4);
/// Live status is refreshed every this many pages inside a round.
const STATUS_EVERY_PAGES: u64 = 4096;
/// Window for the guest's progress rate before the migration.
const RATE_WINDOW_NS: u64 = 2_000_000_000;

/// What others may ask of a running migration, and what an interrupted one leaves behind.
#[derive(Debug, Default)]
pub struct Signals {
    pub cancel: AtomicBool,
    /// Switch a running pre-copy to post-copy at the next round boundary.
    pub start_postcopy: AtomicBool,
    /// The pages a post-copy that lost its connection still owed the destination.
    pub postcopy_leftover: std::sync::Mutex<Option<Bitmap>>,
}

impl Signals {
    pub(crate) fn leftover(&self) -> std::sync::MutexGuard<'_, Option<Bitmap>> {
        self.postcopy_leftover
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Whether there is an interrupted post-copy to resume.
    pub fn can_resume(&self) -> bool {
        self.leftover().is_some()
    }
}

/// Migrates `vm` to `endpoint`. `Ok` means the destination runs the VM now.
pub fn send_migration(
    vm: &dyn Migratable,
    endpoint: &Endpoint,
    params: &MigrationParams,
    status: &SharedStatus,
    signals: &Signals,
) -> Result<()> {
    params.validate()?;
    let started = Instant::now();
    {
        let mut s = lock(status);
        *s = Default::default();
        s.phase = MigrationPhase::Setup;
        s.role = "source".into();
        s.mode = format!("{:?}", params.mode).to_lowercase();
        s.peer = endpoint.to_string();
        s.memory_pages = vm.ram().pages();
        s.zero_page_check = crate::zero::implementation().into();
    }
    let stream = match endpoint.connect() {
        Ok(s) => s,
        Err(e) => return Err(fail(status, e, MigrationPhase::Failed)),
    };
    let stream_mode = match params.mode {
        Mode::Warm => StreamMode::Warm,
        Mode::Precopy | Mode::Postcopy | Mode::Hybrid => StreamMode::Precopy,
    };
    let mut sender = Sender::new(vm, stream, params, status, signals, started);
    let result = sender.migrate(stream_mode);
    sender.finish(result)
}

/// Writes `vm` to a snapshot file; the VM is left paused (its new home is the file).
pub fn save_snapshot(vm: &dyn Migratable, path: &Path, status: &SharedStatus) -> Result<()> {
    let started = Instant::now();
    {
        let mut s = lock(status);
        *s = Default::default();
        s.phase = MigrationPhase::Setup;
        s.role = "source".into();
        s.mode = "snapshot".into();
        s.peer = path.display().to_string();
        s.memory_pages = vm.ram().pages();
    }
    let file = std::fs::File::create(path)
        .map_err(|e| Error::Transport(format!("cannot create {}: {e}", path.display())));
    let file = match file {
        Ok(f) => f,
        Err(e) => return Err(fail(status, e, MigrationPhase::Failed)),
    };
    let signals = Signals::default();
    let params = MigrationParams::default();
    let mut sender = Sender::new(vm, Stream::File(file), &params, status, &signals, started);
    let result = sender.migrate(StreamMode::Snapshot);
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    sender.finish(result)
}

fn fail(status: &SharedStatus, e: Error, phase: MigrationPhase) -> Error {
    let mut s = lock(status);
    s.phase = phase;
    s.error = Some(e.to_string());
    e
}

struct Sender<'a> {
    vm: &'a dyn Migratable,
    ram: GuestRam,
    stream: Stream,
    pages: PageSender,
    limiter: RateLimiter,
    params: &'a MigrationParams,
    status: &'a SharedStatus,
    signals: &'a Signals,
    started: Instant,
    sent_once: Bitmap,
    /// The destination said it can take post-copy.
    peer_postcopy: bool,
    /// Time spent sending pages, for the bandwidth estimate.
    send_time: Duration,
    paused: bool,
    paused_at_ns: u64,
    dirty_logging: bool,
    go_sent: bool,
    /// When the last page was in place (post-copy ends after the guest resumed).
    finished: Option<Instant>,
}

impl<'a> Sender<'a> {
    fn new(
        vm: &'a dyn Migratable,
        stream: Stream,
        params: &'a MigrationParams,
        status: &'a SharedStatus,
        signals: &'a Signals,
        started: Instant,
    ) -> Self {
        let ram = vm.ram();
        let sent_once = Bitmap::new(ram.gfn_end());
        let limiter = RateLimiter::new(params.max_bandwidth_mbps);
        Self {
            vm,
            ram,
            stream,
            pages: PageSender::new(limiter.batch_pages(DEFAULT_BATCH_PAGES)),
            limiter,
            params,
            status,
            signals,
            started,
            sent_once,
            peer_postcopy: false,
            send_time: Duration::ZERO,
            paused: false,
            paused_at_ns: 0,
            dirty_logging: false,
            go_sent: false,
            finished: None,
        }
    }

    fn migrate(&mut self, mode: StreamMode) -> Result<()> {
        let start_ns = now_ns();
        lock(self.status).guest_pages_per_s_before = self
            .vm
            .guest_progress_rate(start_ns.saturating_sub(RATE_WINDOW_NS), start_ns);
        protocol::write_stream_header(&mut self.stream)?;
        protocol::write_control(
            &mut self.stream,
            &Control::Hello {
                vm: self.vm.descriptor(),
                mode,
                source: format!("ferry {}", env!("CARGO_PKG_VERSION")),
            },
        )?;
        if self.stream.has_peer() {
            match protocol::read_control(&mut self.stream)? {
                Control::Ready { postcopy } => {
                    self.peer_postcopy = postcopy;
                    lock(self.status).destination_supports_postcopy = Some(postcopy);
                }
                other => return Err(unexpected("Ready", &other)),
            }
            let wants = matches!(self.params.mode, Mode::Postcopy | Mode::Hybrid);
            if wants && !self.peer_postcopy {
                return Err(Error::Param(
                    "the destination cannot take post-copy (no userfaultfd there)".into(),
                ));
            }
        }
        {
            let mut s = lock(self.status);
            s.setup_ms = ms(self.started.elapsed());
            s.phase = MigrationPhase::Active;
        }

        // Log first, then look: a page the guest first touches while we scan is still caught.
        if mode == StreamMode::Precopy {
            self.vm.start_dirty_log()?;
            self.dirty_logging = true;
        } else {
            self.pause()?;
        }
        let populated = populated_pages(&self.ram)?;
        lock(self.status).pages_skipped_unpopulated = self.ram.pages() - populated.count();
        if self.params.mode == Mode::Postcopy {
            // Nothing moves before the switch: every page that holds data follows it.
            return self.switch_over(populated, true, start_ns);
        }
        self.send_round(0, &populated)?;

        match (mode, self.params.mode) {
            (StreamMode::Precopy, Mode::Hybrid) => {
                let dirty = self.vm.take_dirty()?;
                self.switch_over(dirty, true, start_ns)
            }
            (StreamMode::Precopy, _) => {
                let (pending, postcopy) = self.iterate()?;
                self.switch_over(pending, postcopy, start_ns)
            }
            _ => self.switch_over(Bitmap::new(self.ram.gfn_end()), false, start_ns),
        }
    }

    /// Live rounds until the policy (or the user) says switch; returns the dirty set not yet
    /// sent, and whether to hand it over by post-copy.
    fn iterate(&mut self) -> Result<(Bitmap, bool)> {
        let limits = Limits {
            max_downtime_ms: self.params.max_downtime_ms as f64,
            max_rounds: self.params.max_rounds,
            max_stalled_rounds: MAX_STALLED_ROUNDS,
        };
        let mut round = 1;
        let (mut previous, mut stalled) = (u64::MAX, 0);
        loop {
            self.check_continue()?;
            let dirty = self.vm.take_dirty()?;
            let count = dirty.count();
            stalled = if policy::shrank(previous, count) {
                0
            } else {
                stalled + 1
            };
            previous = count;
            let measured = self.measure(round, count, stalled);
            if self.signals.start_postcopy.load(Ordering::Acquire) && self.peer_postcopy {
                lock(self.status).note = Some("switched to post-copy on request".into());
                return Ok((dirty, true));
            }
            match policy::decide(&measured, &limits) {
                Decision::Iterate => self.send_round(round, &dirty)?,
                Decision::SwitchOver { converged, why } => {
                    let postcopy = !converged && self.params.auto_postcopy;
                    let mut s = lock(self.status);
                    s.converged = Some(converged);
                    s.note = Some(if postcopy {
                        format!("{why}; switching to post-copy instead")
                    } else {
                        why
                    });
                    return Ok((dirty, postcopy));
                }
            }
            round += 1;
        }
    }

    fn measure(&self, rounds_done: u32, pages_remaining: u64, stalled_rounds: u32) -> Measured {
        let mut s = lock(self.status);
        let bytes: u64 = s.rounds.iter().map(|r| r.bytes).sum();
        let bandwidth = bytes as f64 / self.send_time.as_secs_f64().max(1e-6);
        // What the guest dirtied while the last round was on its way.
        let dirty_rate = match s.rounds.last_mut() {
            Some(last) => {
                last.dirty_pages_per_s =
                    pages_remaining as f64 / (last.duration_ms / 1e3).max(1e-6);
                last.dirty_pages_per_s
            }
            None => 0.0,
        };
        s.dirty_pages_per_s = dirty_rate;
        let m = Measured {
            rounds_done,
            pages_remaining,
            bandwidth_bytes_per_s: bandwidth,
            dirty_pages_per_s: dirty_rate,
            stalled_rounds,
        };
        s.pages_remaining = pages_remaining;
        s.expected_downtime_ms = policy::expected_downtime_ms(pages_remaining, bandwidth);
        if policy::outpaced(&m) && s.note.is_none() {
            s.note = Some("the guest dirties memory faster than the link sends it".into());
        }
        m
    }

    /// Pauses the guest, sends what is left (or, for post-copy, which pages will follow) and
    /// the VM state, and hands over.
    fn switch_over(&mut self, mut pending: Bitmap, postcopy: bool, start_ns: u64) -> Result<()> {
        self.check_continue()?;
        lock(self.status).phase = MigrationPhase::Switchover;
        if !self.paused {
            // Let the earlier rounds leave the send queue first: the last pages and the state
            // must not wait behind them while the guest is paused.
            self.stream.drain(SWITCH_DRAIN_LIMIT);
            self.pause()?;
        }
        lock(self.status).guest_pages_per_s_during =
            self.vm.guest_progress_rate(start_ns, self.paused_at_ns);
        if self.dirty_logging {
            pending.merge(&self.vm.take_dirty()?);
        }
        self.pages.checked = true; // the guest is still: page data can be checksummed
        let round = lock(self.status).rounds.len() as u32;
        if postcopy {
            lock(self.status).postcopy = true;
            protocol::write_control(
                &mut self.stream,
                &Control::PostcopyPending {
                    pages: pending.pages(),
                    words: pending.words().to_vec(),
                },
            )?;
        } else if pending.count() > 0 || round == 0 {
            self.send_round(round, &pending)?;
        }
        let checksum = if self.params.checksum {
            Some(memory_checksum(&self.ram)?)
        } else {
            None
        };
        lock(self.status).memory_checksum_source = checksum;
        self.send_state(checksum)?;
        if !self.stream.has_peer() {
            self.stream.flush()?;
            if let Stream::File(f) = &self.stream {
                f.sync_all()?;
            }
            self.complete(None);
            return Ok(());
        }
        let dest_checksum = match protocol::read_control(&mut self.stream)? {
            Control::Loaded { memory_checksum } => memory_checksum,
            other => return Err(unexpected("Loaded", &other)),
        };
        lock(self.status).memory_checksum_destination = dest_checksum;
        self.check_continue()?;
        protocol::write_control(&mut self.stream, &Control::Go)?;
        self.go_sent = true;
        let resumed_at_ns = match protocol::read_control(&mut self.stream)? {
            Control::Resumed { resumed_at_ns } => resumed_at_ns,
            other => return Err(unexpected("Resumed", &other)),
        };
        if postcopy {
            self.post_copy(pending)?;
        } else {
            // The report waits for what the guest saw; `complete` marks the end for readers.
            self.await_guest_report();
        }
        self.complete(Some(resumed_at_ns));
        Ok(())
    }

    /// The VM runs on the destination; its pages follow, requested ones first.
    fn post_copy(&mut self, pending: Bitmap) -> Result<()> {
        let began = Instant::now();
        // Should the connection drop, these pages are what a resume must still deliver.
        *self.signals.leftover() = Some(pending.clone());
        let events = postcopy::spawn_reader(self.stream.try_clone()?);
        let status = self.status;
        let before = self.pages.counters;
        self.pages.checked = true; // the source guest is paused for good
        let out = postcopy::Outbound {
            stream: &mut self.stream,
            ram: &self.ram,
            limiter: &mut self.limiter,
            sender: &mut self.pages,
        };
        let mut phase = postcopy::SourcePhase::new(out, &events, pending, self.params.prepaging);
        let (counters, report) = phase.run(|c, left| {
            let mut s = lock(status);
            s.pages_pushed = c.pushed;
            s.pages_requested = c.requested;
            s.pages_remaining = left;
        })?;
        let mut guest_report = phase.other.pop();
        self.finished = Some(Instant::now());
        *self.signals.leftover() = None;
        let after = self.pages.counters;
        {
            let mut s = lock(self.status);
            s.pages_pushed = counters.pushed;
            s.pages_requested = counters.requested;
            s.pages_full = after.full;
            s.pages_zero = after.zero;
            s.bytes_on_wire = after.bytes;
            s.memory_checksum_destination = report.memory_checksum;
            s.postcopy_report = Some(report);
            let round = s.rounds.len() as u32;
            s.rounds.push(RoundStats {
                round,
                pages: counters.pushed + counters.requested,
                zero_pages: after.zero - before.zero,
                bytes: after.bytes - before.bytes,
                duration_ms: ms(began.elapsed()),
                dirty_pages_per_s: 0.0,
            });
        }
        // The destination reports what the guest saw a moment after it resumed.
        let deadline = Instant::now() + GUEST_REPORT_WAIT;
        while guest_report.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            match events.recv_timeout(left) {
                Ok(postcopy::FromDestination::Report(c)) => guest_report = Some(c),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        if let Some(Control::GuestReport {
            observed_downtime_ns,
            pages_per_s_after,
        }) = guest_report
        {
            let mut s = lock(self.status);
            s.guest_observed_downtime_ms = observed_downtime_ns.map(|n| n as f64 / 1e6);
            s.guest_pages_per_s_after = pages_per_s_after;
        }
        Ok(())
    }

    fn send_state(&mut self, checksum: Option<u64>) -> Result<()> {
        for (index, state) in self.vm.save_vcpus()?.into_iter().enumerate() {
            protocol::write_control(
                &mut self.stream,
                &Control::VcpuState {
                    index: index as u32,
                    state,
                },
            )?;
        }
        let devices = self.vm.save_devices()?;
        protocol::write_control(&mut self.stream, &Control::DeviceState { state: devices })?;
        let pages_sent = {
            let s = lock(self.status);
            s.pages_full + s.pages_zero
        };
        protocol::write_control(
            &mut self.stream,
            &Control::StateEnd {
                paused_at_ns: self.paused_at_ns,
                pages_sent,
                memory_checksum: checksum,
            },
        )
    }

    fn complete(&mut self, resumed_at_ns: Option<u64>) {
        let mut s = lock(self.status);
        s.phase = MigrationPhase::Completed;
        s.pages_remaining = 0;
        if let Some(r) = resumed_at_ns {
            s.downtime_ms = Some(r.saturating_sub(self.paused_at_ns) as f64 / 1e6);
        }
        // Post-copy ends when the last page is in place; the others when the guest resumed.
        let total = match (self.finished, resumed_at_ns) {
            (Some(done), _) => done.duration_since(self.started),
            (None, Some(r)) => self
                .started
                .elapsed()
                .saturating_sub(Duration::from_nanos(now_ns().saturating_sub(r))),
            (None, None) => self.started.elapsed(),
        };
        s.total_ms = ms(total);
        s.average_throughput_mbps =
            s.bytes_on_wire as f64 * 8.0 / total.as_secs_f64().max(1e-9) / 1e6;
    }

    /// The destination reports what the guest saw once it has run a moment; bounded wait.
    fn await_guest_report(&mut self) {
        let _ = self.stream.set_timeouts(Some(GUEST_REPORT_WAIT));
        if let Ok(Control::GuestReport {
            observed_downtime_ns,
            pages_per_s_after,
        }) = protocol::read_control(&mut self.stream)
        {
            let mut s = lock(self.status);
            s.guest_observed_downtime_ms = observed_downtime_ns.map(|n| n as f64 / 1e6);
            s.guest_pages_per_s_after = pages_per_s_after;
        }
    }

    /// Sends the pages of `set` as round `round`.
    fn send_round(&mut self, round: u32, set: &Bitmap) -> Result<()> {
        let began = Instant::now();
        let before = self.pages.counters;
        let mut resent = 0;
        let total = set.count();
        for (i, pfn) in set.iter().enumerate() {
            if self.sent_once.get(pfn) {
                resent += 1;
            } else {
                self.sent_once.set(pfn);
            }
            self.pages
                .push(&mut self.stream, &self.ram, pfn, &mut self.limiter)?;
            if (i as u64 + 1).is_multiple_of(STATUS_EVERY_PAGES) {
                self.check_continue()?;
                self.live_status(total - i as u64 - 1, began, before.bytes);
            }
        }
        self.pages
            .flush(&mut self.stream, &self.ram, &mut self.limiter)?;
        let elapsed = began.elapsed();
        self.send_time += elapsed;
        protocol::write_control(
            &mut self.stream,
            &Control::RoundEnd {
                round,
                pages: total,
            },
        )?;
        let after = self.pages.counters;
        let mut s = lock(self.status);
        s.round = round;
        s.pages_full = after.full;
        s.pages_zero = after.zero;
        s.pages_resent += resent;
        s.bytes_on_wire = after.bytes;
        s.throughput_mbps =
            (after.bytes - before.bytes) as f64 * 8.0 / elapsed.as_secs_f64().max(1e-9) / 1e6;
        // Its dirty rate is known once the next dirty set is taken (see `measure`).
        s.rounds.push(RoundStats {
            round,
            pages: total,
            zero_pages: after.zero - before.zero,
            bytes: after.bytes - before.bytes,
            duration_ms: ms(elapsed),
            dirty_pages_per_s: 0.0,
        });
        Ok(())
    }

    fn live_status(&self, remaining: u64, began: Instant, bytes_before: u64) {
        let mut s = lock(self.status);
        s.pages_remaining = remaining;
        s.pages_full = self.pages.counters.full;
        s.pages_zero = self.pages.counters.zero;
        s.bytes_on_wire = self.pages.counters.bytes;
        s.throughput_mbps = (self.pages.counters.bytes - bytes_before) as f64 * 8.0
            / began.elapsed().as_secs_f64().max(1e-9)
            / 1e6;
    }

    fn pause(&mut self) -> Result<()> {
        self.vm.pause()?;
        self.paused = true;
        self.paused_at_ns = now_ns();
        Ok(())
    }

    fn check_continue(&self) -> Result<()> {
        if self.signals.cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled);
        }
        if self.started.elapsed() > Duration::from_secs(self.params.timeout_s) {
            return Err(Error::Timeout(self.params.timeout_s));
        }
        Ok(())
    }

    /// Settles the outcome: on failure before `Go`, the source runs on as before.
    fn finish(mut self, result: Result<()>) -> Result<()> {
        let error = match result {
            Ok(()) => {
                if self.dirty_logging {
                    let _ = self.vm.stop_dirty_log();
                }
                return Ok(());
            }
            Err(e) => self.explain(e),
        };
        if self.go_sent {
            return Err(fail(self.status, error, MigrationPhase::Unconfirmed));
        }
        if self.stream.has_peer() {
            let _ = self.stream.set_timeouts(Some(Duration::from_millis(200)));
            let _ = protocol::write_control(
                &mut self.stream,
                &Control::Abort {
                    reason: error.to_string(),
                },
            );
            self.stream.shutdown();
        }
        if self.dirty_logging {
            let _ = self.vm.stop_dirty_log();
        }
        let mut error = error;
        if self.paused
            && let Err(e) = self.vm.resume()
        {
            error = Error::Vm(format!("{error}; and resuming the source failed: {e}"));
        }
        let phase = if matches!(error, Error::Cancelled) {
            MigrationPhase::Cancelled
        } else {
            MigrationPhase::Failed
        };
        Err(fail(self.status, error, phase))
    }

    /// A send that failed because the peer gave up: fetch the peer's reason if it sent one.
    fn explain(&mut self, e: Error) -> Error {
        if !matches!(e, Error::Transport(_)) || !self.stream.has_peer() {
            return e;
        }
        let _ = self.stream.set_timeouts(Some(Duration::from_millis(500)));
        loop {
            match protocol::read_frame(&mut self.stream) {
                Ok(protocol::Frame::Control(Control::Abort { reason })) => {
                    return Error::Peer(reason);
                }
                Ok(protocol::Frame::Control(_)) => continue,
                _ => return e,
            }
        }
    }
}

pub(crate) fn unexpected(wanted: &str, got: &Control) -> Error {
    Error::Protocol(format!(
        "expected {wanted} from the destination, got {got:?}"
    ))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
