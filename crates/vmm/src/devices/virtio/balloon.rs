//! virtio-balloon (`ferry run --balloon`): the guest hands pages back to the host so that
//! they take no memory and, above all, never cross the wire in a migration.
//!
//! - **Inflate and deflate** (queues 0 and 1): the driver gives pages (arrays of 32-bit page
//!   frame numbers) and takes them back, following the target `num_pages` that ferry's API
//!   sets (`vm.balloon`) and saying how many it holds in `actual`. An inflated page is
//!   discarded at once (`MADV_DONTNEED`; for memfd memory `MADV_REMOVE`, which punches it out
//!   of the file): it reads as never populated, so a migration skips it without reading it.
//! - **Statistics** (`VIRTIO_BALLOON_F_STATS_VQ`): the driver's buffer of free and total
//!   memory, swap-ins and faults is read and held; every `stats_s` the device gives it back,
//!   which asks the driver for fresh figures (`vm.info` shows the last).
//! - **Free page reporting** (`VIRTIO_BALLOON_F_REPORTING`): the driver names ranges of pages
//!   it freed, which are discarded like inflated ones, and keeps using them when it likes.
//! - **Free page hinting** (`VIRTIO_BALLOON_F_FREE_PAGE_HINT`): a migration asks the driver
//!   for its free pages under a new command id (`start_hints`); the driver says the id, hands
//!   over ranges it holds back meanwhile, and says STOP; the ranges are discarded like reported
//!   ones. The driver keeps them until the device says DONE (`end_hints`), so none is written
//!   while the migration runs; hints under any other id are ignored.
//! - `VIRTIO_BALLOON_F_DEFLATE_ON_OOM` is offered (the driver may deflate below the target
//!   when it runs short), and `VIRTIO_BALLOON_F_MUST_TELL_HOST` (it waits for a deflate to be
//!   served before it reuses the pages).
//!
//! A page that held data when it was discarded changed (to zeros): it is logged as written by
//! the device, so a migration in progress sends it again (as a zero page) and the destination
//! never keeps a stale copy. While post-copy holds the destination's memory (userfaultfd),
//! discarding would make a page the engine installed missing again: discards are then held
//! (`hold_discards`), inflated pages remembered and given back once it lets go, reported ones
//! left alone.

mod buffers;

use std::time::Duration;

use migration::bitmap::Bitmap;
use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;
use virtio_queue::Queue;
use virtio_queue::desc::split::Descriptor;
use vm_memory::GuestMemoryBackend;
use vmm_sys_util::timerfd::TimerFd;

use super::{DriverError, VirtioDevice, WriteLog, complete, each_chain, read_config_bytes};
use crate::memory::GuestMemory;
pub use buffers::GuestStats;
use buffers::{PAGE, Refused, Runs, Served, Turn, pfn_runs, read_stats, report_ranges};

const F_MUST_TELL_HOST: u64 = 1 << 0;
const F_STATS_VQ: u64 = 1 << 1;
const F_DEFLATE_ON_OOM: u64 = 1 << 2;
const F_FREE_PAGE_HINT: u64 = 1 << 3;
const F_REPORTING: u64 = 1 << 5;
/// `free_page_hint_cmd_id` values with a meaning of their own; a session's id is above them.
const CMD_ID_STOP: u32 = 0;
const CMD_ID_DONE: u32 = 1;
const CMD_ID_FIRST: u32 = 2;
const QUEUE_SIZE: u16 = 256;
/// Refusals logged per device (a guest that lies often fills no log).
const WARNINGS: u64 = 8;

/// `--balloon [size=SIZE][,deflate_on_oom=on|off][,free_page_reporting=on|off]
/// [,free_page_hint=on|off][,stats_s=N]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BalloonConfig {
    /// The target at boot, in bytes (default 0: the guest keeps all its memory).
    pub size: u64,
    pub deflate_on_oom: bool,
    pub free_page_reporting: bool,
    pub free_page_hint: bool,
    /// How often the guest is asked for fresh statistics, in seconds (0: never again after
    /// the first).
    pub stats_s: u32,
}

impl Default for BalloonConfig {
    fn default() -> Self {
        Self {
            size: 0,
            deflate_on_oom: true,
            free_page_reporting: true,
            free_page_hint: true,
            stats_s: 1,
        }
    }
}

impl BalloonConfig {
    /// Whether a balloon offering `features` (a descriptor's) offers free page hinting (the
    /// wire's descriptor names it only there).
    pub fn hints_in(features: u64) -> bool {
        features & F_FREE_PAGE_HINT != 0
    }
}

impl std::str::FromStr for BalloonConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut c = Self::default();
        let on_off = |v: &str, what: &str| match v {
            "on" => Ok(true),
            "off" => Ok(false),
            _ => Err(format!("{what}={v} in --balloon (use on or off)")),
        };
        for part in s.split(',').filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some(("size", v)) => c.size = crate::memory::MemorySize::from_str(v)?.0,
                Some(("deflate_on_oom", v)) => c.deflate_on_oom = on_off(v, "deflate_on_oom")?,
                Some(("free_page_reporting", v)) => {
                    c.free_page_reporting = on_off(v, "free_page_reporting")?
                }
                Some(("free_page_hint", v)) => c.free_page_hint = on_off(v, "free_page_hint")?,
                Some(("stats_s", v)) => {
                    c.stats_s = v
                        .parse()
                        .map_err(|_| format!("stats_s={v} in --balloon is not a number"))?
                }
                _ => {
                    return Err(format!(
                        "'{part}' in --balloon '{s}' (use size=SIZE, deflate_on_oom=on|off, \
                         free_page_reporting=on|off, free_page_hint=on|off, stats_s=N)"
                    ));
                }
            }
        }
        if !c.size.is_multiple_of(PAGE) {
            return Err(format!("--balloon size={} is not whole pages", c.size));
        }
        Ok(c)
    }
}

/// What the balloon did, since the VM booted (it moves with the VM).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonCounters {
    pub inflated_pages: u64,
    pub deflated_pages: u64,
    pub reported_pages: u64,
    /// Pages the driver hinted free while a migration asked.
    pub hinted_pages: u64,
    /// Bytes given back to the host that held data (the rest of what was inflated or reported
    /// had never been touched, or was given back already).
    pub freed_bytes: u64,
    /// Page numbers, report ranges and buffers refused: outside RAM or malformed.
    pub refused: u64,
    pub stats_updates: u64,
}

/// The balloon as `vm.info` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BalloonInfo {
    pub target_pages: u32,
    /// As the driver says (`actual`).
    pub actual_pages: u32,
    pub deflate_on_oom: bool,
    pub free_page_reporting: bool,
    pub free_page_hint: bool,
    pub counters: BalloonCounters,
    pub stats: GuestStats,
}

/// A queue's job, by its index and the features the driver took (the statistics and
/// reporting queues exist only when negotiated, and each takes the next index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Inflate,
    Deflate,
    Stats,
    Hint,
    Report,
}

/// Free page hinting: the id the device shows, and what the driver said of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Hints {
    /// `free_page_hint_cmd_id` in config space: STOP, DONE or a session's id.
    shown: u32,
    /// The id the next session gets.
    next: u32,
    /// The id the driver last said it hints under (STOP once it said it has no more).
    driver: u32,
    /// The last session the driver finished (said its id, then STOP).
    finished: u32,
}

impl Default for Hints {
    fn default() -> Self {
        Self {
            shown: CMD_ID_STOP,
            next: CMD_ID_FIRST,
            driver: CMD_ID_STOP,
            finished: CMD_ID_STOP,
        }
    }
}

impl Hints {
    /// Whether a hinted range is taken now: the driver hints under the session shown, and
    /// has not said STOP to it (saying its id again after STOP reopens nothing).
    fn taken(&self) -> bool {
        self.shown >= CMD_ID_FIRST && self.driver == self.shown && self.finished != self.shown
    }

    /// The driver said `id` on the hint queue.
    fn driver_said(&mut self, id: u32) {
        if id == CMD_ID_STOP && self.driver >= CMD_ID_FIRST {
            self.finished = self.driver;
        }
        self.driver = id;
    }
}

/// What moves with the VM besides the transport's registers.
#[derive(Serialize, Deserialize)]
pub struct BalloonState {
    target: u32,
    actual: u32,
    stats_head: Option<u16>,
    stats: GuestStats,
    counters: BalloonCounters,
    hints: Hints,
}

pub struct Balloon {
    config: BalloonConfig,
    target: u32,
    actual: u32,
    /// What the driver accepted.
    features: u64,
    /// The statistics buffer the device holds, to give back when it wants fresh figures.
    stats_head: Option<u16>,
    stats: GuestStats,
    /// Fires when fresh statistics are due (armed while a buffer is held).
    timer: TimerFd,
    /// While discards are held: the pages inflated meanwhile (`None`: not held).
    held: Option<Bitmap>,
    /// The pages given back to the host since the VM came here (inflated or reported, and
    /// not deflated since; the guest may have reused a reported one): made at the first.
    given: Option<Bitmap>,
    counters: BalloonCounters,
    hints: Hints,
    /// Per queue: the chain a turn left half served (its head, and where it goes on). The
    /// chain stays available to the driver's eyes until it is done: a VM that moves
    /// meanwhile has it served again, whole, on the destination (giving back is idempotent).
    partial: [Option<(u16, u64)>; QUEUES],
    /// Per queue: a turn ended with work left (`unfinished`).
    more: [bool; QUEUES],
}

/// Inflate, deflate, statistics, hints, reports.
const QUEUES: usize = 5;

impl Balloon {
    pub fn new(config: &BalloonConfig) -> Result<Self, String> {
        let timer = TimerFd::new().map_err(|e| format!("balloon timer: {e}"))?;
        Ok(Self {
            target: (config.size / PAGE).min(u64::from(u32::MAX)) as u32,
            config: config.clone(),
            actual: 0,
            features: 0,
            stats_head: None,
            stats: GuestStats::default(),
            timer,
            held: None,
            given: None,
            counters: BalloonCounters::default(),
            hints: Hints::default(),
            partial: [None; QUEUES],
            more: [false; QUEUES],
        })
    }

    /// Asks the driver for `pages` pages (the caller tells the driver the configuration
    /// changed).
    pub fn set_target(&mut self, pages: u32) {
        self.target = pages;
    }

    pub fn info(&self) -> BalloonInfo {
        BalloonInfo {
            target_pages: self.target,
            actual_pages: self.actual,
            deflate_on_oom: self.config.deflate_on_oom,
            free_page_reporting: self.config.free_page_reporting,
            free_page_hint: self.config.free_page_hint,
            counters: self.counters,
            stats: self.stats,
        }
    }

    /// Asks the driver for its free pages under a new command id; false when the driver took
    /// no hinting (nothing to wait for). The caller tells the driver the configuration changed.
    pub fn start_hints(&mut self) -> bool {
        if self.features & F_FREE_PAGE_HINT == 0 {
            return false;
        }
        let h = &mut self.hints;
        h.shown = h.next;
        h.next = h.next.checked_add(1).unwrap_or(CMD_ID_FIRST);
        true
    }

    /// Whether the driver has handed over all it had for the session shown (or takes no
    /// hinting, or no session runs).
    pub fn hints_finished(&self) -> bool {
        let h = &self.hints;
        self.features & F_FREE_PAGE_HINT == 0 || h.shown < CMD_ID_FIRST || h.finished == h.shown
    }

    /// Ends hinting: DONE, the driver may use the hinted pages again. False when no session
    /// was shown (nothing to tell the driver).
    pub fn end_hints(&mut self) -> bool {
        if self.hints.shown < CMD_ID_FIRST {
            return false;
        }
        self.hints.shown = CMD_ID_DONE;
        true
    }

    /// The pages given back to the host since the VM came here (inflated or reported and not
    /// deflated since), a bit for each page of guest memory; `None` if none ever was.
    pub fn given_back(&self) -> Option<&Bitmap> {
        self.given.as_ref()
    }

    /// Holds discards (`true`: post-copy holds guest memory; pages inflated meanwhile are
    /// remembered) or lets them go (`false`: the pages still inflated are discarded now, those
    /// that held data logged to `log`).
    pub fn hold_discards(&mut self, hold: bool, memory: &GuestMemory, log: &mut dyn WriteLog) {
        if hold {
            let pages = memory.last_addr().0 / PAGE + 1;
            self.held.get_or_insert_with(|| Bitmap::new(pages));
            return;
        }
        let Some(held) = self.held.take() else {
            return;
        };
        let mut runs = Runs::default();
        let mut found = Vec::new();
        for gfn in held.iter() {
            let gpa = gfn * PAGE;
            if let Some(end) = buffers::region_end(memory, gpa) {
                runs.add(gpa, end, &mut |g, l| found.push((g, l)));
            }
        }
        runs.flush(&mut |g, l| found.push((g, l)));
        for (gpa, len) in found {
            self.give_back(gpa, len, memory, log);
        }
    }

    fn role(&self, index: usize) -> Option<Role> {
        // Each negotiated queue takes the next index, in the spec's order.
        [
            (Role::Inflate, 0),
            (Role::Deflate, 0),
            (Role::Stats, F_STATS_VQ),
            (Role::Hint, F_FREE_PAGE_HINT),
            (Role::Report, F_REPORTING),
        ]
        .into_iter()
        .filter(|&(_, feature)| feature == 0 || self.features & feature != 0)
        .map(|(role, _)| role)
        .nth(index)
    }

    #[cfg(test)]
    fn role_index(&self, role: Role) -> Option<usize> {
        (0..QUEUES).find(|&i| self.role(i) == Some(role))
    }

    fn stats_queue(&self) -> Option<usize> {
        (self.features & F_STATS_VQ != 0).then_some(2)
    }

    /// A refusal: counted, and logged while there have been few.
    fn refuse(&mut self, n: u64, why: &str) {
        if n == 0 {
            return;
        }
        if self.counters.refused < WARNINGS {
            tracing::warn!("virtio-balloon: refused {why}");
        }
        self.counters.refused += n;
    }

    /// Discards guest pages; those that held data are logged as written (now zeros).
    fn give_back(&mut self, gpa: u64, len: u64, memory: &GuestMemory, log: &mut dyn WriteLog) {
        let mut freed = 0;
        let done = crate::memory::discard(memory, gpa, len, &mut |g, l| {
            log.wrote(g, l as usize);
            freed += l;
        });
        self.counters.freed_bytes += freed;
        if let Err(e) = done {
            tracing::warn!("virtio-balloon: cannot give {len} bytes at {gpa:#x} back: {e}");
            return;
        }
        let pages = memory.last_addr().0 / PAGE + 1;
        let given = self.given.get_or_insert_with(|| Bitmap::new(pages));
        for gfn in gpa / PAGE..(gpa + len) / PAGE {
            given.set(gfn);
        }
    }

    fn inflate(&mut self, gpa: u64, len: u64, memory: &GuestMemory, log: &mut dyn WriteLog) {
        self.counters.inflated_pages += len / PAGE;
        match &mut self.held {
            // Discarded when post-copy lets go, unless deflated first. Without
            // MUST_TELL_HOST the driver may reuse a page before its deflate is served: then
            // it is never discarded.
            Some(held) if self.features & F_MUST_TELL_HOST != 0 => {
                for gfn in gpa / PAGE..(gpa + len) / PAGE {
                    held.set(gfn);
                }
            }
            Some(_) => {}
            None => self.give_back(gpa, len, memory, log),
        }
    }

    fn deflate(&mut self, gpa: u64, len: u64) {
        self.counters.deflated_pages += len / PAGE;
        for map in [&mut self.held, &mut self.given].into_iter().flatten() {
            for gfn in gpa / PAGE..(gpa + len) / PAGE {
                map.unset(gfn);
            }
        }
    }

    fn hint(&mut self, gpa: u64, len: u64, memory: &GuestMemory, log: &mut dyn WriteLog) {
        self.counters.hinted_pages += len / PAGE;
        if self.held.is_none() {
            self.give_back(gpa, len, memory, log);
        }
    }

    /// A hint queue buffer: the id the driver hints under (one readable le32), or ranges it
    /// hands over, taken only while it hints under the session shown.
    fn serve_hint(
        &mut self,
        descs: &[Descriptor],
        at: (u64, &Turn),
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<Served, Refused> {
        let nothing = Served {
            refused: 0,
            resume_at: None,
        };
        if let [d] = descs
            && !d.is_write_only()
        {
            let id = buffers::read_cmd_id(d, memory)?;
            self.hints.driver_said(id);
            return Ok(nothing);
        }
        if !self.hints.taken() {
            return Ok(nothing); // a stale session's: its pages stay the guest's
        }
        Ok(report_ranges(descs, memory, at.0, at.1, &mut |g, l| {
            self.hint(g, l, memory, log)
        }))
    }

    fn report(&mut self, gpa: u64, len: u64, memory: &GuestMemory, log: &mut dyn WriteLog) {
        self.counters.reported_pages += len / PAGE;
        // While held, a reported page stays: the driver may take it back without a word.
        if self.held.is_none() {
            self.give_back(gpa, len, memory, log);
        }
    }

    /// Serves one inflate, deflate, hint or report buffer (given back empty) from `from` on,
    /// for one `turn`: where the next turn goes on, or `None` when it is done.
    fn serve(
        &mut self,
        role: Role,
        descs: &[Descriptor],
        (from, turn): (u64, &Turn),
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Option<u64> {
        let served = match role {
            Role::Inflate => pfn_runs(descs, memory, from, turn, &mut |g, l| {
                self.inflate(g, l, memory, log)
            }),
            Role::Deflate => pfn_runs(descs, memory, from, turn, &mut |g, l| self.deflate(g, l)),
            Role::Report => Ok(report_ranges(descs, memory, from, turn, &mut |g, l| {
                self.report(g, l, memory, log)
            })),
            Role::Hint => self.serve_hint(descs, (from, turn), memory, log),
            Role::Stats => Ok(Served {
                refused: 0,
                resume_at: None,
            }),
        };
        match served {
            Ok(Served { refused, resume_at }) => {
                let why = format!("{refused} pages or ranges outside RAM ({role:?})");
                self.refuse(refused, &why);
                resume_at
            }
            Err(Refused(why)) => {
                self.refuse(1, &format!("{why} ({role:?})"));
                None
            }
        }
    }

    /// Serves the chains the driver made available on queue `index` for one turn: a chain
    /// the turn cannot finish is put back and goes on from where it stopped next turn.
    fn serve_turn(
        &mut self,
        index: usize,
        role: Role,
        queue: &mut Queue,
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        use virtio_queue::{QueueOwnedT, QueueT};
        let turn = Turn::new();
        let mut used = false;
        while !turn.spent() {
            let Some(chain) = queue.pop_descriptor_chain(memory) else {
                return Ok(used);
            };
            let head = chain.head_index();
            let descs: Vec<Descriptor> = chain.collect();
            let from = match self.partial[index].take() {
                Some((h, at)) if h == head => at,
                _ => 0,
            };
            match self.serve(role, &descs, (from, &turn), memory, log) {
                Some(at) => {
                    self.partial[index] = Some((head, at));
                    queue.go_to_previous_position();
                }
                None => {
                    complete(queue, memory, head, 0, log)?;
                    used = true;
                }
            }
        }
        self.more[index] = true;
        Ok(used)
    }

    /// Reads each statistics buffer the driver posted and holds the newest (an older one is
    /// given back); fresh figures are asked for `stats_s` later.
    fn take_stats(
        &mut self,
        queue: &mut Queue,
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        each_chain(queue, memory, |queue, head, descs| {
            let older = self.stats_head.replace(head);
            match read_stats(descs, memory, &mut self.stats) {
                Ok(()) => self.counters.stats_updates += 1,
                Err(Refused(why)) => self.refuse(1, &format!("{why} (statistics)")),
            }
            self.arm_timer();
            match older {
                Some(older) => complete(queue, memory, older, 0, log).map(|()| true),
                None => Ok(false),
            }
        })
    }

    fn arm_timer(&mut self) {
        if self.config.stats_s > 0 && self.stats_head.is_some() {
            let every = Duration::from_secs(u64::from(self.config.stats_s));
            if let Err(e) = self.timer.reset(every, None) {
                tracing::warn!("virtio-balloon: statistics timer: {e}");
            }
        }
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BALLOON
    }

    fn features(&self) -> u64 {
        let mut f = (1 << VIRTIO_F_VERSION_1) | F_MUST_TELL_HOST | F_STATS_VQ;
        if self.config.deflate_on_oom {
            f |= F_DEFLATE_ON_OOM;
        }
        if self.config.free_page_reporting {
            f |= F_REPORTING;
        }
        if self.config.free_page_hint {
            f |= F_FREE_PAGE_HINT;
        }
        f
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 5]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // virtio_balloon_config: num_pages, actual, free_page_hint_cmd_id, poison_val (le32
        // each; poisoning is not offered).
        let mut config = [0u8; 16];
        config[..4].copy_from_slice(&self.target.to_le_bytes());
        config[4..8].copy_from_slice(&self.actual.to_le_bytes());
        config[8..12].copy_from_slice(&self.hints.shown.to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` is the driver's to write.
        if let (4, Ok(v)) = (offset, <[u8; 4]>::try_from(data)) {
            self.actual = u32::from_le_bytes(v);
        }
    }

    fn set_driver_features(&mut self, features: u64) {
        self.features = features;
    }

    fn reset(&mut self) {
        self.features = 0;
        self.actual = 0;
        self.stats_head = None;
        self.hints.driver = CMD_ID_STOP;
        self.partial = [None; QUEUES];
        self.more = [false; QUEUES];
        let _ = self.timer.clear();
        // The driver owns every page again: none inflated meanwhile may be discarded later.
        if let Some(held) = &mut self.held {
            held.clear();
        }
    }

    fn process(
        &mut self,
        index: usize,
        queues: &mut [Queue],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        let (Some(role), Some(queue)) = (self.role(index), queues.get_mut(index)) else {
            return Ok(false);
        };
        if role == Role::Stats {
            return self.take_stats(queue, memory, log);
        }
        self.serve_turn(index, role, queue, memory, log)
    }

    fn unfinished(&mut self, index: usize) -> bool {
        self.more.get_mut(index).is_some_and(std::mem::take)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let c = &self.counters;
        let s = &self.stats;
        let mut v = vec![
            ("target_pages", u64::from(self.target)),
            ("actual_pages", u64::from(self.actual)),
            ("pages_inflated", c.inflated_pages),
            ("pages_deflated", c.deflated_pages),
            ("pages_reported", c.reported_pages),
            ("pages_hinted", c.hinted_pages),
            ("freed_bytes", c.freed_bytes),
            ("refused", c.refused),
            ("stats_updates", c.stats_updates),
        ];
        for (name, value) in [
            ("guest_free_bytes", s.free_bytes),
            ("guest_total_bytes", s.total_bytes),
            ("guest_available_bytes", s.available_bytes),
            ("guest_swap_in_bytes", s.swap_in_bytes),
        ] {
            if let Some(value) = value {
                v.push((name, value));
            }
        }
        v
    }

    fn descriptor(&self) -> migration::DeviceDescriptor {
        migration::DeviceDescriptor::Balloon {
            target_bytes: u64::from(self.target) * PAGE,
            deflate_on_oom: self.config.deflate_on_oom,
            free_page_reporting: self.config.free_page_reporting,
            stats_s: self.config.stats_s,
            features: self.features(),
        }
    }

    fn describe(&self) -> String {
        let mib = |pages: u32| (u64::from(pages) * PAGE) >> 20;
        let c = &self.config;
        let offered: String = [
            (c.deflate_on_oom, ", deflate on OOM"),
            (c.free_page_reporting, ", free page reporting"),
            (c.free_page_hint, ", free page hinting"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, what)| *what)
        .collect();
        format!(
            "balloon: target {} MiB, actual {} MiB{offered}",
            mib(self.target),
            mib(self.actual),
        )
    }

    fn input_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        Some(self.timer.as_raw_fd())
    }

    /// The statistics timer fired: the held buffer goes back, asking for fresh figures.
    fn input(
        &mut self,
        queues: &mut [Queue],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        // Armed while a buffer is held, once: disarmed with one held means it fired (the I/O
        // thread may also call for no reason).
        let fired = self.config.stats_s > 0 && self.timer.is_armed().is_ok_and(|armed| !armed);
        let (true, Some(index), Some(head)) = (fired, self.stats_queue(), self.stats_head) else {
            return Ok(false);
        };
        let _ = self.timer.clear(); // readable no more
        let Some(queue) = queues.get_mut(index) else {
            return Ok(false);
        };
        self.stats_head = None;
        complete(queue, memory, head, 0, log)?;
        Ok(true)
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl crate::persist::Persist for Balloon {
    const NAME: &'static str = "virtio-balloon";
    const VERSION: u32 = 2;
    type State = BalloonState;

    fn save(&self) -> Result<BalloonState, String> {
        Ok(BalloonState {
            target: self.target,
            actual: self.actual,
            stats_head: self.stats_head,
            stats: self.stats,
            counters: self.counters,
            hints: self.hints,
        })
    }

    fn load(&mut self, s: BalloonState) -> Result<(), String> {
        self.target = s.target;
        self.actual = s.actual;
        self.stats_head = s.stats_head;
        self.stats = s.stats;
        self.counters = s.counters;
        self.hints = s.hints;
        self.arm_timer();
        Ok(())
    }
}

/// The balloon of a VM's devices, if it has one (through `as_any_mut`).
pub fn of(device: &mut dyn VirtioDevice) -> Option<&mut Balloon> {
    device.as_any_mut().downcast_mut::<Balloon>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::mmio::MmioTransport;
    use crate::devices::virtio::test_driver::{driver_ok, set_up, write_reg};
    use crate::memory::{MIN_MEMORY, MemoryBackend, create_guest_memory};
    use crate::persist::{Component, Fragment};
    use virtio_bindings::virtio_mmio::*;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    const WRITE: u16 = 2;
    const NEXT: u16 = 1;
    /// Where the test puts what the driver hands over.
    const BUF: u64 = 0x80000;
    /// Pages the guest gives away in the tests.
    const FIRST: u64 = 0x300;
    const ALL: u64 = F_MUST_TELL_HOST | F_STATS_VQ | F_REPORTING | F_DEFLATE_ON_OOM;

    /// A driver's view: the transport, guest memory, the device's write log, and per queue how
    /// many buffers were offered.
    struct Rig {
        t: MmioTransport,
        m: GuestMemory,
        log: Bitmap,
        offered: [u16; 5],
    }

    fn desc_table(q: usize) -> u64 {
        0x10000 + q as u64 * 0x4000
    }

    impl Rig {
        fn new(features: u64) -> Rig {
            let mut r = Rig::set_up(features);
            driver_ok(&mut r.t, &r.m, &mut r.log);
            r
        }

        /// Features accepted and queues ready, `DRIVER_OK` not yet set.
        fn set_up(features: u64) -> Rig {
            let balloon = Balloon::new(&BalloonConfig::default()).unwrap();
            let m = create_guest_memory(MIN_MEMORY, MemoryBackend::Anonymous).unwrap();
            crate::memory::use_small_pages(&m);
            let t = MmioTransport::new(Box::new(balloon), EventFd::new(0).unwrap());
            let mut r = Rig {
                t,
                log: Bitmap::new(MIN_MEMORY / PAGE),
                m,
                offered: [0; 5],
            };
            let rings: Vec<_> = (0..5)
                .map(|q| {
                    (
                        desc_table(q),
                        desc_table(q) + 0x1000,
                        desc_table(q) + 0x2000,
                    )
                })
                .collect();
            set_up(&mut r.t, &r.m, &mut r.log, features as u32, 16, &rings);
            r
        }

        fn w(&mut self, reg: u32, v: u32) {
            write_reg(&mut self.t, &self.m, &mut self.log, reg, v);
        }

        fn balloon(&mut self) -> &mut Balloon {
            of(self.t.device_mut()).unwrap()
        }

        /// Offers a chain of buffers (address, length, device-writable) on queue `q` and
        /// notifies it.
        fn offer(&mut self, q: usize, bufs: &[(u64, u32, bool)]) {
            self.post(q, bufs);
            self.w(VIRTIO_MMIO_QUEUE_NOTIFY, q as u32);
        }

        /// Offers a chain on queue `q` without a notification.
        fn post(&mut self, q: usize, bufs: &[(u64, u32, bool)]) {
            for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
                let d = desc_table(q) + 16 * i as u64;
                let more = if i + 1 < bufs.len() { NEXT } else { 0 };
                let flags = more | if writable { WRITE } else { 0 };
                self.m.write_obj(addr, GuestAddress(d)).unwrap();
                self.m.write_obj(len, GuestAddress(d + 8)).unwrap();
                self.m.write_obj(flags, GuestAddress(d + 12)).unwrap();
                self.m
                    .write_obj(i as u16 + 1, GuestAddress(d + 14))
                    .unwrap();
            }
            let avail = desc_table(q) + 0x1000;
            let idx = self.offered[q];
            self.m
                .write_obj(0u16, GuestAddress(avail + 4 + 2 * u64::from(idx % 16)))
                .unwrap();
            self.offered[q] = idx + 1;
            self.m.write_obj(idx + 1, GuestAddress(avail + 2)).unwrap();
        }

        /// Serves queue `q` for one turn, as its I/O thread does: true with work left.
        fn turn(&mut self, q: usize) -> bool {
            self.t.notify(q, &self.m, &mut self.log)
        }

        /// Offers an array of page numbers.
        fn pfns(&mut self, q: usize, pfns: &[u32]) {
            let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
            self.m.write_slice(&bytes, GuestAddress(BUF)).unwrap();
            self.offer(q, &[(BUF, bytes.len() as u32, false)]);
        }

        fn used(&self, q: usize) -> u16 {
            self.m
                .read_obj(GuestAddress(desc_table(q) + 0x2002))
                .unwrap()
        }

        fn stamp(&self, pages: std::ops::Range<u64>) {
            for p in pages {
                self.m
                    .write_obj(p | 1 << 40, GuestAddress(p * PAGE))
                    .unwrap();
            }
        }

        fn word(&self, page: u64) -> u64 {
            self.m.read_obj(GuestAddress(page * PAGE)).unwrap()
        }

        fn counters(&mut self) -> BalloonCounters {
            self.balloon().info().counters
        }

        /// A config-space word (le32) at `offset`.
        fn config(&self, offset: u64) -> u32 {
            let mut b = [0u8; 4];
            self.t.read(u64::from(VIRTIO_MMIO_CONFIG) + offset, &mut b);
            u32::from_le_bytes(b)
        }

        /// The driver says a free page hinting command id on queue `q`.
        fn say_hint_id(&mut self, q: usize, id: u32) {
            self.m.write_obj(id, GuestAddress(BUF)).unwrap();
            self.offer(q, &[(BUF, 4, false)]);
        }
    }

    fn pfns(pages: std::ops::Range<u64>) -> Vec<u32> {
        pages.map(|p| p as u32).collect()
    }

    #[test]
    fn inflated_pages_are_given_back_and_those_that_held_data_logged() {
        let mut r = Rig::new(ALL);
        r.stamp(FIRST..FIRST + 4);
        // Eight pages (four never touched), and one far outside RAM.
        let mut given = pfns(FIRST..FIRST + 8);
        given.push(0xf_0000);
        r.pfns(0, &given);
        assert_eq!(r.used(0), 1, "the buffer came back");
        assert!(
            (FIRST..FIRST + 8).all(|p| r.word(p) == 0),
            "they read as zeros"
        );
        let logged: Vec<u64> = r.log.iter().filter(|&p| p >= FIRST).collect();
        assert_eq!(logged, (FIRST..FIRST + 4).collect::<Vec<_>>());
        let c = r.counters();
        assert_eq!(
            (c.inflated_pages, c.refused, c.freed_bytes),
            (8, 1, 4 * PAGE)
        );
        r.pfns(1, &pfns(FIRST..FIRST + 2));
        assert_eq!(r.counters().deflated_pages, 2);
        assert!(r.t.broken().is_none());
        let given: Vec<u64> = r.balloon().given_back().unwrap().iter().collect();
        assert_eq!(
            given,
            (FIRST + 2..FIRST + 8).collect::<Vec<_>>(),
            "deflated: taken back"
        );
    }

    /// A buffer of scattered pages is served a turn at a time (the device's lock let go in
    /// between): the chain stays with the device until its last turn, each page is given back
    /// once, and a reset forgets a half-served chain.
    #[test]
    fn a_buffer_of_scattered_pages_is_served_in_bounded_turns() {
        let mut r = Rig::new(ALL);
        let odd: Vec<u32> = (0..1000).map(|i| (FIRST + 2 * i + 1) as u32).collect();
        r.stamp(FIRST..FIRST + 2000);
        let bytes: Vec<u8> = odd.iter().flat_map(|p| p.to_le_bytes()).collect();
        r.m.write_slice(&bytes, GuestAddress(BUF)).unwrap();
        r.post(0, &[(BUF, bytes.len() as u32, false)]);
        let mut turns = vec![];
        while r.turn(0) {
            let inflated = r.counters().inflated_pages;
            turns.push(inflated);
            if inflated < 1000 {
                assert_eq!(r.used(0), 0, "not given back before its last turn");
            }
            assert!(turns.len() < 100, "bounded");
        }
        // A scattered page costs its number and a run: a few hundred a turn.
        assert!(turns.len() >= 3, "{turns:?}");
        assert!(turns.windows(2).all(|w| w[1] - w[0] < 300), "{turns:?}");
        assert_eq!(r.used(0), 1);
        assert_eq!(r.counters().inflated_pages, 1000);
        assert!(odd.iter().all(|&p| r.word(u64::from(p)) == 0));
        assert!(
            (0..1000).all(|i| r.word(FIRST + 2 * i) != 0),
            "even pages kept"
        );

        // Half served, then the driver resets: nothing carries over to the next chain.
        r.post(0, &[(BUF, bytes.len() as u32, false)]);
        assert!(r.turn(0));
        r.balloon().reset();
        assert!(r.balloon().partial.iter().all(Option::is_none));
    }

    /// A report of more pages than a turn gives back is given back over several turns.
    #[test]
    fn a_long_report_is_given_back_a_turn_at_a_time() {
        let mut r = Rig::new(ALL);
        let q = r.balloon().role_index(Role::Report).unwrap();
        let pages = 3000;
        r.stamp(FIRST..FIRST + pages);
        // Eight ranges (the same pages each time): more than two turns' worth in all.
        let range = (FIRST * PAGE, (pages * PAGE) as u32, true);
        r.post(q, &[range; 8]);
        let mut turns = 1;
        while r.turn(q) {
            turns += 1;
            assert!(turns < 100);
        }
        assert!(turns >= 2, "{turns}");
        assert_eq!(r.counters().reported_pages, 8 * pages);
        assert!((FIRST..FIRST + pages).all(|p| r.word(p) == 0));
        assert_eq!(r.used(q), 1);
    }

    /// Buffers of the wrong shape are refused whole and given back; the device serves on.
    #[test]
    fn malformed_buffers_are_refused_and_nothing_is_lost() {
        let mut r = Rig::new(ALL);
        r.stamp(FIRST..FIRST + 2);
        let bytes: Vec<u8> = pfns(FIRST..FIRST + 2)
            .iter()
            .flat_map(|p| p.to_le_bytes())
            .collect();
        r.m.write_slice(&bytes, GuestAddress(BUF)).unwrap();
        r.offer(0, &[(BUF, 8, true)]); // one the device may only write
        r.offer(0, &[(BUF, 7, false)]); // not whole page numbers
        r.offer(0, &[(MIN_MEMORY - 4, 8, false)]); // past the end of RAM
        assert_eq!(r.used(0), 3);
        assert_eq!(r.counters().refused, 3);
        assert_eq!(r.word(FIRST), FIRST | 1 << 40, "nothing was given back");
        assert!(r.t.broken().is_none());
        r.pfns(0, &pfns(FIRST..FIRST + 2));
        assert_eq!(r.word(FIRST), 0, "a good buffer still works");
    }

    #[test]
    fn reported_ranges_are_given_back_and_bad_ones_refused() {
        let mut r = Rig::new(ALL);
        r.stamp(FIRST..FIRST + 8);
        let at = |p: u64| p * PAGE;
        r.offer(
            3,
            &[
                (at(FIRST), 4 * PAGE as u32, true),
                (at(FIRST + 4) + 8, PAGE as u32, true), // not page-aligned
                (at(FIRST + 5), 100, true),             // not whole pages
                (MIN_MEMORY - PAGE, 2 * PAGE as u32, true), // past the end of RAM
                (at(FIRST + 6), 0, true),               // empty
            ],
        );
        assert_eq!(r.used(3), 1);
        let c = r.counters();
        assert_eq!(
            (c.reported_pages, c.refused, c.freed_bytes),
            (4, 4, 4 * PAGE)
        );
        // Reported twice: nothing more held data, nothing more is logged.
        r.log.clear();
        r.offer(3, &[(at(FIRST), 4 * PAGE as u32, false)]);
        assert_eq!(r.counters().reported_pages, 8);
        assert_eq!(r.counters().freed_bytes, 4 * PAGE);
        assert_eq!(r.log.iter().filter(|&p| p >= FIRST).count(), 0);
        assert!((FIRST..FIRST + 4).all(|p| r.word(p) == 0));
        assert_ne!(r.word(FIRST + 4), 0, "a refused range keeps its data");
    }

    /// Without the statistics queue, the reporting queue takes index 2 (queues exist only when
    /// negotiated, each at the next index).
    #[test]
    fn queues_follow_the_negotiated_features() {
        let mut r = Rig::new(F_REPORTING);
        r.stamp(FIRST..FIRST + 1);
        r.offer(2, &[(FIRST * PAGE, PAGE as u32, true)]);
        assert_eq!(r.word(FIRST), 0);
        assert_eq!(r.counters().reported_pages, 1);
        r.offer(3, &[(FIRST * PAGE, PAGE as u32, true)]);
        assert_eq!(r.used(3), 0, "no fourth queue without statistics");
    }

    /// Hints are taken only while the driver hints under the session the device shows: not
    /// before one starts, not after the driver said STOP, not under a stale id; DONE ends it.
    #[test]
    fn free_page_hints_are_taken_only_under_the_session_shown() {
        const HINT: usize = 3; // after inflate, deflate and statistics; reporting is 4
        let mut r = Rig::new(ALL | F_FREE_PAGE_HINT);
        r.stamp(FIRST..FIRST + 16);
        let range = |first: u64, n: u64| [(first * PAGE, (n * PAGE) as u32, true)];
        assert_eq!(r.config(8), CMD_ID_STOP, "no session yet");
        r.say_hint_id(HINT, 7);
        r.offer(HINT, &range(FIRST, 2));
        assert_eq!(
            r.word(FIRST),
            FIRST | 1 << 40,
            "a hint no session asked for"
        );
        assert!(r.balloon().start_hints());
        let id = r.config(8);
        assert!(id >= CMD_ID_FIRST);
        assert!(
            !r.balloon().hints_finished(),
            "the driver has not said STOP"
        );
        r.say_hint_id(HINT, id);
        r.offer(HINT, &range(FIRST, 4));
        assert!(
            (FIRST..FIRST + 4).all(|p| r.word(p) == 0),
            "hinted: given back"
        );
        let logged: Vec<u64> = r.log.iter().filter(|&p| p >= FIRST).collect();
        assert_eq!(logged, (FIRST..FIRST + 4).collect::<Vec<_>>());
        r.say_hint_id(HINT, CMD_ID_STOP);
        assert!(r.balloon().hints_finished());
        r.offer(HINT, &range(FIRST + 4, 2));
        assert_ne!(r.word(FIRST + 4), 0, "after STOP, a hint is not taken");
        r.say_hint_id(HINT, id);
        r.offer(HINT, &range(FIRST + 6, 2));
        assert_ne!(r.word(FIRST + 6), 0, "the finished session's id said again");
        // A new session: a hint under the old id is stale.
        assert!(r.balloon().start_hints());
        assert_eq!(r.config(8), id + 1);
        r.say_hint_id(HINT, id);
        r.offer(HINT, &range(FIRST + 8, 2));
        assert_ne!(r.word(FIRST + 8), 0, "a stale session's hint");
        r.offer(HINT, &[(BUF, 3, false)]); // a command id that is not 4 bytes
        assert_eq!(r.counters().refused, 1);
        assert!(r.balloon().end_hints());
        assert_eq!(r.config(8), CMD_ID_DONE);
        assert_eq!(r.counters().hinted_pages, 4);
        assert_eq!(r.counters().reported_pages, 0);
        assert!(r.t.broken().is_none());
        // A driver that took no hinting is never asked.
        let mut plain = Rig::new(ALL);
        assert!(!plain.balloon().start_hints());
        assert!(plain.balloon().hints_finished());
        assert!(!plain.balloon().end_hints());
    }

    /// Makes the statistics timer fire now.
    fn fire(b: &mut Balloon) {
        assert!(b.timer.is_armed().unwrap(), "armed while a buffer is held");
        b.timer.reset(Duration::from_millis(1), None).unwrap();
        while b.timer.is_armed().unwrap() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn stat(tag: u16, value: u64) -> Vec<u8> {
        let mut v = tag.to_le_bytes().to_vec();
        v.extend_from_slice(&value.to_le_bytes());
        v
    }

    #[test]
    fn statistics_are_read_held_and_asked_for_again() {
        let mut r = Rig::new(ALL);
        let stats: Vec<u8> = [
            stat(4, 100 << 20),
            stat(5, 1 << 30),
            stat(0, 7),
            stat(99, 1),
        ]
        .concat();
        r.m.write_slice(&stats, GuestAddress(BUF)).unwrap();
        r.offer(2, &[(BUF, stats.len() as u32, false)]);
        assert_eq!(r.used(2), 0, "the buffer is held");
        let s = r.balloon().info().stats;
        assert_eq!(s.free_bytes, Some(100 << 20));
        assert_eq!(s.total_bytes, Some(1 << 30));
        assert_eq!(s.swap_in_bytes, Some(7));
        assert_eq!(s.available_bytes, None, "never given");
        assert!(!r.t.input(&r.m, &mut r.log), "not before the timer fires");
        fire(r.balloon());
        // The timer fired: the buffer goes back, asking for fresh figures.
        assert!(r.t.input(&r.m, &mut r.log));
        assert_eq!(r.used(2), 1);
        assert!(
            !r.t.input(&r.m, &mut r.log),
            "nothing held: nothing to give back"
        );
        // 15 bytes: not whole statistics.
        r.offer(2, &[(BUF, 15, false)]);
        assert_eq!(r.counters().refused, 1);
        assert_eq!(r.counters().stats_updates, 1);
    }

    /// Linux's driver posts its first statistics and notifies before it sets DRIVER_OK, when
    /// a notification is not heard: the device reads them as it starts.
    #[test]
    fn statistics_posted_before_the_driver_was_ready_are_read_when_it_is() {
        let mut r = Rig::set_up(ALL);
        let stats = stat(4, 100 << 20);
        r.m.write_slice(&stats, GuestAddress(BUF)).unwrap();
        r.offer(2, &[(BUF, stats.len() as u32, false)]);
        assert_eq!(r.counters().stats_updates, 0, "not heard before DRIVER_OK");
        driver_ok(&mut r.t, &r.m, &mut r.log);
        assert_eq!(r.counters().stats_updates, 1);
        assert_eq!(r.balloon().info().stats.free_bytes, Some(100 << 20));
    }

    #[test]
    fn the_target_and_actual_travel_through_config_space() {
        let mut r = Rig::new(ALL);
        let generation = |r: &Rig| {
            let mut b = [0u8; 4];
            r.t.read(u64::from(VIRTIO_MMIO_CONFIG_GENERATION), &mut b);
            u32::from_le_bytes(b)
        };
        let before = generation(&r);
        r.balloon().set_target(1234);
        r.t.config_changed();
        assert_eq!(generation(&r), before + 1);
        let mut b = [0u8; 4];
        r.t.read(u64::from(VIRTIO_MMIO_CONFIG), &mut b);
        assert_eq!(u32::from_le_bytes(b), 1234);
        let mut actual = 1000u32.to_le_bytes();
        r.t.write(u64::from(VIRTIO_MMIO_CONFIG) + 4, &actual, &r.m, &mut r.log);
        // num_pages is the device's: a driver's write is ignored.
        actual = 5u32.to_le_bytes();
        r.t.write(u64::from(VIRTIO_MMIO_CONFIG), &actual, &r.m, &mut r.log);
        let i = r.balloon().info();
        assert_eq!((i.target_pages, i.actual_pages), (1234, 1000));
    }

    /// While post-copy holds memory nothing is given back; when it lets go, the pages still
    /// inflated are, those deflated meanwhile are not, and reported ones were left alone.
    #[test]
    fn held_discards_wait_for_post_copy_to_let_go() {
        let mut r = Rig::new(ALL);
        r.stamp(FIRST..FIRST + 8);
        let m = r.m.clone();
        r.balloon().hold_discards(true, &m, &mut Bitmap::new(0));
        r.pfns(0, &pfns(FIRST..FIRST + 4));
        r.offer(3, &[((FIRST + 6) * PAGE, 2 * PAGE as u32, true)]);
        assert!(
            (FIRST..FIRST + 8).all(|p| r.word(p) != 0),
            "nothing given back"
        );
        r.pfns(1, &pfns(FIRST + 1..FIRST + 2));
        let mut log = Bitmap::new(MIN_MEMORY / PAGE);
        r.balloon().hold_discards(false, &m, &mut log);
        let gone: Vec<u64> = (FIRST..FIRST + 8).filter(|&p| r.word(p) == 0).collect();
        assert_eq!(gone, vec![FIRST, FIRST + 2, FIRST + 3]);
        assert_eq!(log.iter().collect::<Vec<_>>(), gone, "and logged");
    }

    #[test]
    fn state_moves_to_a_twin_and_a_stranger_is_refused() {
        let mut r = Rig::new(ALL);
        r.balloon().set_target(77);
        r.pfns(0, &pfns(FIRST..FIRST + 3));
        let stats = stat(4, 5);
        r.m.write_slice(&stats, GuestAddress(BUF)).unwrap();
        r.offer(2, &[(BUF, 10, false)]);
        r.balloon().start_hints(); // the driver took no hinting: nothing changes
        let saved = r.t.save_as("virtio.0").unwrap();
        let mut twin = Rig::new(0);
        twin.t.load_from(&saved).unwrap();
        assert_eq!(twin.balloon().info(), r.balloon().info());
        // Mid-session, the command id moves too.
        let mut hinting = Rig::new(ALL | F_FREE_PAGE_HINT);
        hinting.balloon().start_hints();
        let mut twin2 = Rig::new(0);
        twin2
            .t
            .load_from(&hinting.t.save_as("virtio.0").unwrap())
            .unwrap();
        assert_eq!(twin2.config(8), hinting.config(8));
        assert!(
            twin2.balloon().end_hints(),
            "the twin ends the session it was given"
        );
        // The held statistics buffer moved too: the twin gives it back.
        twin.m = r.m.clone();
        fire(twin.balloon());
        assert!(twin.t.input(&twin.m, &mut twin.log));
        let garbage = Fragment {
            name: "virtio-balloon".into(),
            version: <Balloon as crate::persist::Persist>::VERSION,
            bytes: vec![1, 2, 3],
        };
        let mut fresh = Balloon::new(&BalloonConfig::default()).unwrap();
        let e = fresh.load_from(&garbage).unwrap_err();
        assert!(e.contains("undecodable virtio-balloon"), "{e}");
        // A driver that took free page reporting cannot land on a balloon without it.
        let config = BalloonConfig {
            free_page_reporting: false,
            ..Default::default()
        };
        let plain = Balloon::new(&config).unwrap();
        let mut t = MmioTransport::new(Box::new(plain), EventFd::new(0).unwrap());
        assert!(t.load_from(&saved).unwrap_err().contains("does not offer"));
    }

    #[test]
    fn options_parse_and_refuse_with_a_reason() {
        let c: BalloonConfig = "size=256M,deflate_on_oom=off,stats_s=5".parse().unwrap();
        assert_eq!((c.size, c.deflate_on_oom, c.stats_s), (256 << 20, false, 5));
        assert!(c.free_page_reporting && c.free_page_hint);
        let c: BalloonConfig = "free_page_hint=off".parse().unwrap();
        assert!(!c.free_page_hint);
        assert_eq!(
            "".parse::<BalloonConfig>().unwrap(),
            BalloonConfig::default()
        );
        for (bad, why) in [
            ("size=lots", "not a size"),
            ("free_page_reporting=yes", "use on or off"),
            ("stats_s=-1", "not a number"),
            ("hint=on", "use size=SIZE"),
            ("free_page_hint=1", "use on or off"),
            ("size=5000", "whole pages"),
        ] {
            let e = bad.parse::<BalloonConfig>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
