//! What the user asks of a migration, checked once.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::io::transport::LONG_PATH;
pub use crate::prepaging::Strategy;
use crate::wire::codec::Codec;

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
    /// Live update: a process on this host takes the VM over, its memory (a memfd) and its
    /// devices' files passed over a Unix socket, so no page is copied.
    Local,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Precopy => "precopy",
            Mode::Warm => "warm",
            Mode::Postcopy => "postcopy",
            Mode::Hybrid => "hybrid",
            Mode::Local => "local",
        }
    }

    /// Whether the switch hands over by post-copy.
    pub fn wants_postcopy(self) -> bool {
        matches!(self, Mode::Postcopy | Mode::Hybrid)
    }

    /// The delta cache this mode gets when none is asked for: live pre-copy rounds re-send
    /// what the guest dirtied, often a few bytes of a page, which its delta carries in a
    /// fraction of the link; a mode whose pages cross once would only pay for the copies.
    pub const fn default_delta_cache_mb(self) -> u64 {
        match self {
            Mode::Precopy | Mode::Hybrid => DEFAULT_DELTA_CACHE_MB,
            Mode::Warm | Mode::Postcopy | Mode::Local => 0,
        }
    }
}

/// MiB of last-sent copies a re-sending mode keeps by default (grown as pages are sent).
pub const DEFAULT_DELTA_CACHE_MB: u64 = 256;

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        [
            Mode::Precopy,
            Mode::Warm,
            Mode::Postcopy,
            Mode::Hybrid,
            Mode::Local,
        ]
        .into_iter()
        .find(|m| m.name() == s)
        .ok_or_else(|| {
            Error::Param(format!(
                "unknown mode '{s}' (use precopy, warm, postcopy, hybrid or local)"
            ))
        })
    }
}

/// When pre-copy slows the guest's vCPUs (auto-converge, in the steps of
/// `policy::next_throttle`) so that its dirty set can shrink to what fits the downtime budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AutoConverge {
    /// Never: after 3 rounds without progress pre-copy stops and copies the rest, however
    /// long that pause.
    Off,
    /// Once a round shows that pre-copy cannot converge on its own (the guest dirtied nine
    /// tenths of what the link sent, or its dirty set stopped shrinking, with more left than
    /// the budget): the last resort before a stop-and-copy over budget (VMware's vMotion also
    /// throttles by default).
    #[default]
    WhenStalled,
    /// From the round in which the guest dirtied at least half of what the link sent (QEMU's
    /// auto-converge trigger), whether or not pre-copy would have converged without it.
    Early,
}

impl AutoConverge {
    pub fn name(self) -> &'static str {
        match self {
            AutoConverge::Off => "off",
            AutoConverge::WhenStalled => "when-stalled",
            AutoConverge::Early => "early",
        }
    }
}

impl std::str::FromStr for AutoConverge {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        [
            AutoConverge::Off,
            AutoConverge::WhenStalled,
            AutoConverge::Early,
        ]
        .into_iter()
        .find(|a| a.name() == s)
        .ok_or_else(|| {
            Error::Param(format!(
                "unknown auto_converge '{s}' (use off, when-stalled or early)"
            ))
        })
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
    /// When pre-copy slows the guest's vCPUs in steps until it converges.
    pub auto_converge: AutoConverge,
    /// Post-copy push order: bubble (pre-paging around faults) or linear (push only).
    pub prepaging: Strategy,
    /// TCP (or Unix) connections the pages travel on, each with its own sender thread.
    pub connections: u32,
    /// Page data compressed per frame: none, lz4, zstd, or auto (chosen by link and data, by
    /// each connection's sender).
    pub compression: Compression,
    /// Threads that compress page data, shared out among the connections (`None`: each
    /// connection's sender compresses its own). More than `connections` needs compression.
    pub migration_threads: Option<u32>,
    /// Delta encoding of re-sent pages: MiB of last-sent copies kept (shared out among the
    /// connections); 0: off.
    pub delta_cache_mb: u64,
    /// Send `Go` right behind the state instead of after the destination's `Loaded`: the
    /// destination starts the moment it has loaded the state (a round trip less of downtime,
    /// which a long path feels). Should the connection drop before `Loaded` is heard, the
    /// source cannot know whether the VM started there: it stays paused, `unconfirmed`,
    /// instead of running on (as it does when the connection drops after `Go` either way; the
    /// window grows from one round trip to about one and a half). `None`: on a long path
    /// (`transport::LONG_PATH`), where the round trip saved is most of the downtime.
    pub go_with_state: Option<bool>,
    /// Post-copy checkpoints: every this many ms the destination sends the VM's newest state
    /// back (pages it dirtied, vCPUs, devices), so that the source can carry on from it should
    /// the destination die (`vm.migrate-rollback`); `None`: off.
    pub checkpoint_ms: Option<u32>,
    /// How long a pre-copy whose connection broke tries to reconnect and carry on (sending
    /// only what the destination lacks) while the VM runs on here; 0: it fails at once.
    pub resume_window_s: u64,
    /// The VM's disks move with it, their blocks in this stream (pre-copied in rounds with
    /// the guest's writes logged, the last ones in the pause): for hosts that share no
    /// storage. The destination writes each to its own disk at the same slot.
    pub copy_storage: bool,
}

/// Rounds a migration may take at most (copies of a page are counted in 16 bits: see
/// `copies`).
pub const MAX_ROUNDS: u32 = 10_000;

/// How long a broken pre-copy tries to carry on by default.
pub const DEFAULT_RESUME_WINDOW_S: u64 = 60;

/// The range `checkpoint_ms` may take: below 5 ms the pauses would be most of the guest's
/// time; above a minute a rollback would lose more than most guests can afford.
pub const CHECKPOINT_MS: std::ops::RangeInclusive<u32> = 5..=60_000;

impl MigrationParams {
    /// Whether `Go` goes right behind the state on a connection whose round trip is `rtt`
    /// (`None`: not TCP, or not known).
    pub fn goes_with_state(&self, rtt: Option<Duration>) -> bool {
        self.go_with_state
            .unwrap_or_else(|| rtt.is_some_and(|rtt| rtt >= LONG_PATH))
    }
}

impl Default for MigrationParams {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl MigrationParams {
    /// What a migration does where its request says nothing.
    pub const DEFAULT: Self = Self {
        mode: Mode::Precopy,
        max_downtime_ms: 300,
        max_bandwidth_mbps: None,
        max_rounds: 30,
        timeout_s: 600,
        checksum: false,
        auto_postcopy: false,
        auto_converge: AutoConverge::WhenStalled,
        prepaging: Strategy::Bubble,
        connections: 1,
        compression: Compression::Auto,
        migration_threads: None,
        delta_cache_mb: Mode::Precopy.default_delta_cache_mb(),
        go_with_state: None,
        checkpoint_ms: None,
        resume_window_s: DEFAULT_RESUME_WINDOW_S,
        copy_storage: false,
    };
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
        if self.max_rounds > MAX_ROUNDS {
            return Err(Error::Param(format!(
                "max_rounds must be at most {MAX_ROUNDS} (got {})",
                self.max_rounds
            )));
        }
        positive("timeout_s", self.timeout_s)?;
        if let Some(b) = self.max_bandwidth_mbps {
            positive("max_bandwidth_mbps", b)?;
        }
        // Options the mode would silently ignore are refused: the user meant something.
        let mode = self.mode.name();
        if self.auto_postcopy && self.mode != Mode::Precopy {
            return Err(Error::Param(format!(
                "auto_postcopy switches a pre-copy that cannot converge to post-copy; mode \
                 {mode} has no such pre-copy (use mode precopy)"
            )));
        }
        if self.prepaging == Strategy::Linear && !(self.mode.wants_postcopy() || self.auto_postcopy)
        {
            return Err(Error::Param(format!(
                "prepaging orders post-copy's pushes; mode {mode} has no post-copy"
            )));
        }
        if self.auto_converge == AutoConverge::Early
            && matches!(self.mode, Mode::Warm | Mode::Postcopy | Mode::Local)
        {
            return Err(Error::Param(format!(
                "auto_converge slows the guest during pre-copy rounds; mode {mode} has none \
                 while the guest runs"
            )));
        }
        if let Some(ms) = self.checkpoint_ms {
            if !CHECKPOINT_MS.contains(&ms) {
                return Err(Error::Param(format!(
                    "checkpoint_ms must be {}..={} (got {ms})",
                    CHECKPOINT_MS.start(),
                    CHECKPOINT_MS.end()
                )));
            }
            if !(self.mode.wants_postcopy() || self.auto_postcopy) {
                return Err(Error::Param(format!(
                    "checkpoint_ms needs a mode that can end in post-copy (postcopy, hybrid, \
                     or auto_postcopy), not {}",
                    self.mode.name()
                )));
            }
        }
        if self.mode == Mode::Local {
            self.check_local()?;
        }
        if self.copy_storage {
            self.check_copy_storage()?;
        }
        let most = crate::wire::lanes::MAX_CONNECTIONS;
        if !(1..=most).contains(&self.connections) {
            return Err(Error::Param(format!(
                "connections must be 1..={most} (got {})",
                self.connections
            )));
        }
        if let Some(t) = self.migration_threads {
            if !(self.connections..=MAX_MIGRATION_THREADS).contains(&t) {
                return Err(Error::Param(format!(
                    "migration_threads must be {}..={MAX_MIGRATION_THREADS}, at least one per \
                     connection (got {t})",
                    self.connections
                )));
            }
            if t > self.connections && self.compression == Compression::None {
                return Err(Error::Param(
                    "migration_threads above connections needs compression (lz4, zstd or \
                     auto): the extra threads compress"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Disk blocks go before the switch, so only the modes that copy everything before it
    /// take them: the source's disk stays the only authority until the VM runs elsewhere.
    fn check_copy_storage(&self) -> Result<()> {
        let mode = self.mode.name();
        if !matches!(self.mode, Mode::Precopy | Mode::Warm) {
            return Err(Error::Param(format!(
                "copy_storage moves disks before the switch, in modes precopy and warm; mode                  {mode} hands over first (or, local, keeps the disks where they are)"
            )));
        }
        if self.auto_postcopy {
            return Err(Error::Param(
                "copy_storage moves disks before the switch; auto_postcopy would switch before                  they arrived"
                    .into(),
            ));
        }
        Ok(())
    }

    /// A live update copies no page: options about moving pages would be silently ignored.
    fn check_local(&self) -> Result<()> {
        let moves_pages = [
            ("connections", self.connections != 1),
            ("max_bandwidth_mbps", self.max_bandwidth_mbps.is_some()),
            ("migration_threads", self.migration_threads.is_some()),
            ("compression", self.compression != Compression::Auto),
            ("delta_cache_mb", self.delta_cache_mb != 0),
        ];
        match moves_pages.iter().find(|(_, given)| *given) {
            Some((name, _)) => Err(Error::Param(format!(
                "{name} is about sending pages; a local live update passes the memory itself \
                 and sends none"
            ))),
            None => Ok(()),
        }
    }

    /// Threads that compress connection `lane`'s frames (1: its sender itself): the
    /// migration's threads shared out evenly, the first connections taking what is left over.
    pub fn packers_of(&self, lane: u32) -> usize {
        let connections = self.connections.max(1);
        let threads = self.compressing_threads();
        let extra = u32::from(lane < threads % connections);
        (threads / connections + extra) as usize
    }

    /// Threads that compress page data, on every connection together.
    fn compressing_threads(&self) -> u32 {
        let connections = self.connections.max(1);
        self.migration_threads
            .unwrap_or(connections)
            .max(connections)
    }

    /// The cores `auto` may count on to compress connection `lane`'s frames: its threads,
    /// each with a core of its own while the host has `host_cores` for all of them, a share
    /// of one where it has fewer (8 connections on 2 cores: a quarter each; counted as
    /// whole cores, each connection thought compressing cheaper than its share of the link,
    /// and moved 256 MiB in 1.7× plain's time).
    ///
    /// `auto` times a codec on the wall clock, so it sees the contention of the moment: while
    /// most connections send plain, a try has a core to itself. The share is what each gets
    /// once all compress, which is what choosing a codec for all of them would bring.
    pub fn compress_cores_of(&self, lane: u32, host_cores: usize) -> f64 {
        let share = host_cores.max(1) as f64 / f64::from(self.compressing_threads());
        self.packers_of(lane) as f64 * share.min(1.0)
    }
}

/// Most threads one migration may compress on.
pub const MAX_MIGRATION_THREADS: u32 = 64;

/// What `--compression` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    None,
    Fixed(Codec),
    /// Each connection picks what moves its pages soonest over this link: the default.
    #[default]
    Auto,
}

impl std::str::FromStr for Compression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Compression::None),
            "lz4" => Ok(Compression::Fixed(Codec::Lz4)),
            "zstd" => Ok(Compression::Fixed(Codec::Zstd)),
            "auto" => Ok(Compression::Auto),
            other => Err(Error::Param(format!(
                "unknown compression '{other}' (use none, lz4, zstd or auto)"
            ))),
        }
    }
}

impl Compression {
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Fixed(c) => c.name(),
            Compression::Auto => "auto",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By default `Go` goes with the state on a long path only, where the round trip it
    /// saves is most of the downtime; the flag decides either way wherever it is given.
    #[test]
    fn go_goes_with_the_state_on_a_long_path_unless_told() {
        let ms = |n| Some(Duration::from_millis(n));
        let by_path = MigrationParams::default();
        assert!(by_path.goes_with_state(ms(100)));
        assert!(by_path.goes_with_state(ms(2)));
        assert!(!by_path.goes_with_state(Some(Duration::from_micros(60))));
        assert!(!by_path.goes_with_state(None), "a Unix socket or a file");
        let told = |on| MigrationParams {
            go_with_state: Some(on),
            ..MigrationParams::default()
        };
        assert!(!told(false).goes_with_state(ms(100)));
        assert!(told(true).goes_with_state(None));
    }

    #[test]
    fn options_the_mode_would_ignore_are_refused() {
        let refused = |p: MigrationParams, why: &str| {
            let e = p.validate().expect_err(why).to_string();
            assert!(e.contains(why), "{e}");
        };
        let base = MigrationParams::default;
        refused(
            MigrationParams {
                mode: Mode::Warm,
                auto_postcopy: true,
                ..base()
            },
            "mode warm has no such pre-copy",
        );
        refused(
            MigrationParams {
                mode: Mode::Hybrid,
                auto_postcopy: true,
                ..base()
            },
            "mode hybrid has no such pre-copy",
        );
        refused(
            MigrationParams {
                prepaging: Strategy::Linear,
                ..base()
            },
            "mode precopy has no post-copy",
        );
        refused(
            MigrationParams {
                mode: Mode::Postcopy,
                auto_converge: AutoConverge::Early,
                ..base()
            },
            "mode postcopy has none",
        );
        // What each mode uses is taken.
        for ok in [
            MigrationParams {
                auto_postcopy: true,
                prepaging: Strategy::Linear,
                checkpoint_ms: Some(20),
                ..base()
            },
            MigrationParams {
                mode: Mode::Hybrid,
                auto_converge: AutoConverge::Early,
                prepaging: Strategy::Linear,
                ..base()
            },
        ] {
            ok.validate().expect("valid");
        }
    }

    #[test]
    fn compressing_threads_are_shared_out_and_weighed_by_the_host_cores() {
        let params = |connections, migration_threads| MigrationParams {
            connections,
            migration_threads,
            ..MigrationParams::default()
        };
        // 3 connections, 7 threads: the first connection takes the one left over.
        let p = params(3, Some(7));
        assert_eq!(
            (0..3).map(|l| p.packers_of(l)).collect::<Vec<_>>(),
            [3, 2, 2]
        );
        // Cores enough for every thread: each counts as a core of its own.
        assert_eq!(p.compress_cores_of(0, 16), 3.0);
        assert_eq!(p.compress_cores_of(1, 7), 2.0);
        // 8 connections on 2 cores: a quarter of a core each.
        let p = params(8, None);
        assert_eq!(p.packers_of(5), 1);
        assert_eq!(p.compress_cores_of(5, 2), 0.25);
        assert_eq!(p.compress_cores_of(5, 0), 0.125, "no core count: one core");
        assert_eq!(params(1, None).compress_cores_of(0, 2), 1.0);
    }
}
