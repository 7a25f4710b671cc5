//! The API edge of the migration engine: requests become engine parameters, engine status
//! and errors become the API's own types and HTTP codes. The engine runs the migrations.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use api::{ApiError, MigrationRequest, SnapshotRequest};
use migration::io::tls::Tls;
use migration::status::Role;
use migration::{Compression, Strategy};
use migration::{Endpoint, ErrorKind, Incoming, MigrationParams, Outgoing, Phase, StatusBoard};
use serde_json::Value;

/// A VM's migrations, both ways, and one status for them.
pub struct Migrations {
    pub board: StatusBoard,
    pub outgoing: Arc<Outgoing>,
    pub incoming: Arc<Incoming>,
    /// Set once a client has read a final status, so the source may exit.
    pub final_status_read: AtomicBool,
    pub security: Security,
}

/// How this VM's TCP migrations are protected.
#[derive(Clone, Debug, Default)]
pub struct Security {
    pub tls: Option<Tls>,
    /// The user asked for TCP without TLS (`--plain-tcp`).
    pub plain_tcp: bool,
}

impl Security {
    /// TCP needs TLS unless plain TCP was asked for; a Unix socket stays on this host.
    pub fn check(&self, endpoint: &Endpoint) -> Result<(), String> {
        if matches!(endpoint, Endpoint::Tcp(_)) && self.tls.is_none() && !self.plain_tcp {
            return Err(format!(
                "{endpoint}: a TCP migration needs TLS (start ferry run with --tls-cert, \
                 --tls-key and --tls-ca; `ferry certs` makes them) or, on a trusted network \
                 only, --plain-tcp"
            ));
        }
        Ok(())
    }
}

impl Migrations {
    pub fn new(security: Security) -> Self {
        let board = StatusBoard::default();
        Self {
            outgoing: Outgoing::new(board.clone(), security.tls.clone()),
            incoming: Incoming::new(board.clone(), security.tls.clone()),
            board,
            final_status_read: AtomicBool::new(false),
            security,
        }
    }
}

/// The HTTP answer for an engine error, chosen by its kind.
pub fn api_error(e: migration::Error) -> ApiError {
    let status = match e.kind() {
        ErrorKind::BadInput => 400,
        ErrorKind::Conflict => 409,
        ErrorKind::Peer => 502,
        ErrorKind::Internal => 500,
    };
    ApiError::new(status, e.report())
}

impl Migrations {
    pub fn running(&self) -> bool {
        self.outgoing.running()
    }

    pub fn status_json(&self) -> Value {
        let s = self.board.read();
        if !s.phase.is_running() && s.phase != Phase::None {
            self.final_status_read.store(true, Ordering::Release);
        }
        serde_json::to_value(to_api(&s)).unwrap_or_default()
    }
}

/// The engine's status in the API's terms.
/// A duration as the API gives every one: milliseconds.
fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn to_api(s: &migration::Status) -> api::MigrationStatus {
    use api::MigrationPhase as P;
    let (p, r) = (&s.progress, &s.report);
    api::MigrationStatus {
        phase: match s.phase {
            Phase::None => P::None,
            Phase::Setup => P::Setup,
            Phase::Active => P::Active,
            Phase::Switchover => P::Switchover,
            Phase::Postcopy => P::PostcopyActive,
            Phase::Completed => P::Completed,
            Phase::Failed => P::Failed,
            Phase::Cancelled => P::Cancelled,
            Phase::Unconfirmed => P::Unconfirmed,
            Phase::PostcopyPaused => P::PostcopyPaused,
        },
        role: match s.role {
            Role::Source => "source",
            Role::Destination => "destination",
        }
        .into(),
        mode: s.mode.map_or("", |m| m.name()).into(),
        peer: s.peer.clone(),
        round: p.round,
        pages_remaining: p.pages_remaining,
        dirty_pages_per_s: p.dirty_pages_per_s,
        throughput_mbps: p.throughput_mbps,
        expected_downtime_ms: p.expected_downtime.map(ms),
        converged: r.converged,
        note: s.note.clone(),
        memory_pages: s.memory_pages,
        connections: s.connections,
        migration_threads: s.migration_threads,
        zero_page_check: s.zero_page_check.clone(),
        pages_full: p.pages.full,
        pages_zero: p.pages.zero,
        pages_skipped_unpopulated: p.pages.skipped_unpopulated,
        pages_skipped_free: p.pages.skipped_free,
        pages_skipped_zero: p.pages.skipped_zero,
        pages_resent: p.pages.resent,
        resumes: r.resumes,
        pages_sent_again: r.pages_sent_again,
        bytes_on_wire: p.bytes_on_wire,
        compression: api::CompressionStats {
            asked: p.compression.asked.clone(),
            frames_plain: p.compression.frames_plain,
            frames_lz4: p.compression.frames_lz4,
            frames_zstd: p.compression.frames_zstd,
            samples_lz4: p.compression.samples_lz4,
            samples_zstd: p.compression.samples_zstd,
            bytes_in: p.compression.bytes_in,
            bytes_out: p.compression.bytes_out,
            delta_pages: p.compression.delta_pages,
            delta_bytes_saved: p.compression.delta_bytes_saved,
        },
        rounds: p
            .rounds
            .iter()
            .map(|x| api::RoundStats {
                round: x.round,
                pages: x.pages,
                zero_pages: x.zero_pages,
                bytes: x.bytes,
                duration_ms: ms(x.duration),
                dirty_pages_per_s: x.dirty_pages_per_s,
                throttle_percent: x.throttle_percent,
            })
            .collect(),
        setup_ms: ms(r.setup),
        downtime_ms: r.downtime.map(ms),
        destination_downtime_ms: r.destination_downtime.map(ms),
        guest_observed_downtime_ms: r.guest_observed_downtime.map(ms),
        total_ms: ms(r.total),
        average_throughput_mbps: r.average_throughput_mbps,
        guest_pages_per_s_before: r.guest_pages_per_s_before,
        guest_pages_per_s_during: r.guest_pages_per_s_during,
        vcpus_throttled_ms: r.vcpus_throttled.map(ms),
        guest_pages_per_s_after: r.guest_pages_per_s_after,
        guest_report_pending: r.guest_report_pending,
        destination_supports_postcopy: s.destination_supports_postcopy,
        postcopy: s.postcopy,
        stale_pages_dropped_before_pause: r.stale_pages_dropped_before_pause,
        throttle_percent_max: r.throttle_percent_max,
        cpu: r
            .cpu
            .iter()
            .map(|u| api::WorkCpu {
                work: u.work.clone(),
                threads: u.threads,
                cpu_s: u.cpu_s,
                wall_s: u.wall_s,
                busiest: u.busiest,
            })
            .collect(),
        breakdown: r
            .breakdown
            .iter()
            .map(|b| api::Stretch {
                name: b.name.clone(),
                ms: ms(b.took),
            })
            .collect(),
        resumed_at_unix_ns: r.resumed_at_unix_ns,
        completed_at_unix_ns: r.completed_at_unix_ns,
        pages_pushed: p.pages.pushed,
        pages_requested: p.pages.requested,
        pages_pushed_on_lanes: p.pages.pushed_on_lanes,
        postcopy_report: r.postcopy_report.as_ref().map(|c| api::PostcopyReport {
            network_faults: c.network_faults,
            zero_faults: c.zero_faults,
            pages_before_access: c.pages_before_access,
            duplicates: c.duplicates,
            fault_latency_p50_ms: c.fault_latency_p50_ms,
            fault_latency_p99_ms: c.fault_latency_p99_ms,
            fault_latency_max_ms: c.fault_latency_max_ms,
            resume_ms: c.resume_ms,
            memory_checksum: c.memory_checksum,
            timeline_10ms: c.timeline_10ms.clone(),
        }),
        checkpoints: s.checkpoints.as_ref().map(|c| api::CheckpointStats {
            every_ms: c.every_ms,
            count: c.count,
            last_seq: c.last_seq,
            last_at_ms: ms(c.last_at),
            pages: c.pages,
            bytes: c.bytes,
            pause_ms_total: ms(c.pause_total),
            pause_ms_max: ms(c.pause_max),
            rolled_back_to: c.rolled_back_to,
        }),
        storage: p.storage.as_ref().map(|c| api::StorageStats {
            disks: c.disks,
            disk_bytes: c.disk_bytes,
            data_bytes: c.data_bytes,
            data_wire_bytes: c.data_wire_bytes,
            zero_bytes: c.zero_bytes,
            blocks_resent: c.blocks_resent,
            blocks_in_pause: c.blocks_in_pause,
        }),
        memory_checksum_source: r.memory_checksum_source,
        memory_checksum_destination: r.memory_checksum_destination,
        error: s.error.clone(),
    }
}

fn compression(asked: Option<&str>, default: Compression) -> Result<Compression, ApiError> {
    asked.map_or(Ok(default), |c| c.parse().map_err(api_error))
}

fn migration_threads(asked: Option<i64>) -> Result<Option<u32>, ApiError> {
    match asked {
        Some(n) if n <= 0 || n > i64::from(u32::MAX) => Err(ApiError::bad_request(format!(
            "migration_threads must be a positive number of threads, not {n}"
        ))),
        n => Ok(n.map(|n| n as u32)),
    }
}

/// A snapshot's parameters: its writers (each a lane of the file, as a migration's
/// connections are), compressed as the body asks.
pub fn snapshot_params(req: &SnapshotRequest) -> Result<MigrationParams, ApiError> {
    let most = migration::wire::lanes::MAX_CONNECTIONS;
    let writers = match req.writers {
        None => 1,
        Some(n) if (1..=i64::from(most)).contains(&n) => n as u32,
        Some(n) => {
            return Err(ApiError::bad_request(format!(
                "writers must be 1..={most} threads, not {n}"
            )));
        }
    };
    let params = MigrationParams {
        connections: writers,
        // A file is written once, as fast as the disk takes it: plain unless asked.
        compression: compression(req.compression.as_deref(), Compression::None)?,
        migration_threads: migration_threads(req.migration_threads)?,
        delta_cache_mb: 0,
        ..MigrationParams::default()
    };
    if params.migration_threads.is_some_and(|t| t < writers) {
        return Err(ApiError::bad_request(format!(
            "migration_threads must be at least one per writer ({writers})"
        )));
    }
    params.validate().map_err(api_error)?;
    Ok(params)
}

/// Turns the API body into engine parameters, naming any bad field.
pub fn params_from_request(
    req: &MigrationRequest,
) -> Result<(Endpoint, MigrationParams), ApiError> {
    let endpoint: Endpoint = req.destination.parse().map_err(api_error)?;
    let positive = |name: &str, v: Option<i64>| -> Result<Option<u64>, ApiError> {
        match v {
            Some(n) if n <= 0 => Err(ApiError::bad_request(format!(
                "{name} must be positive, not {n}"
            ))),
            other => Ok(other.map(|n| n as u64)),
        }
    };
    // A VM running on while its migration waits minutes for a link is better started again.
    const MAX_RESUME_WINDOW_S: u32 = 120;
    // A cache larger than most guests' memory would only hold host memory hostage.
    const MAX_DELTA_CACHE_MB: i64 = 64 * 1024;
    let defaults = MigrationParams::default();
    let mode = match &req.mode {
        Some(m) => m.parse().map_err(api_error)?,
        None => defaults.mode,
    };
    let params = MigrationParams {
        mode,
        max_downtime_ms: positive("max_downtime_ms", req.max_downtime_ms)?
            .unwrap_or(defaults.max_downtime_ms),
        max_bandwidth_mbps: positive("max_bandwidth_mbps", req.max_bandwidth_mbps)?,
        max_rounds: positive("max_rounds", req.max_rounds)?
            .map(|n| n.min(u64::from(u32::MAX)) as u32)
            .unwrap_or(defaults.max_rounds),
        timeout_s: positive("timeout_s", req.timeout_s)?.unwrap_or(defaults.timeout_s),
        checksum: req.checksum.unwrap_or(false),
        auto_postcopy: req.auto_postcopy.unwrap_or(false),
        auto_converge: match &req.auto_converge {
            Some(a) => a.name().parse().map_err(api_error)?,
            None => defaults.auto_converge,
        },
        go_with_state: req.go_with_state,
        prepaging: match req.prepaging.as_deref() {
            None | Some("bubble") => Strategy::Bubble,
            Some("linear") => Strategy::Linear,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "unknown prepaging '{other}' (use bubble or linear)"
                )));
            }
        },
        connections: positive("connections", req.connections)?
            .map(|n| n.min(u64::from(u32::MAX)) as u32)
            .unwrap_or(defaults.connections),
        delta_cache_mb: match req.delta_cache_mb {
            Some(n) if !(0..=MAX_DELTA_CACHE_MB).contains(&n) => {
                return Err(ApiError::bad_request(format!(
                    "delta_cache_mb must be 0..={MAX_DELTA_CACHE_MB}, not {n}"
                )));
            }
            n => n.map_or_else(|| mode.default_delta_cache_mb(), |n| n as u64),
        },
        compression: compression(req.compression.as_deref(), defaults.compression)?,
        migration_threads: migration_threads(req.migration_threads)?,
        checkpoint_ms: match req.checkpoint_ms {
            Some(n) if n < 0 || n > i64::from(u32::MAX) => {
                return Err(ApiError::bad_request(format!(
                    "checkpoint_ms must be a number of milliseconds, not {n}"
                )));
            }
            n => n.map(|n| n as u32),
        },
        resume_window_s: match req.resume_window_s {
            Some(n) if !(0..=i64::from(MAX_RESUME_WINDOW_S)).contains(&n) => {
                return Err(ApiError::bad_request(format!(
                    "resume_window_s must be 0..={MAX_RESUME_WINDOW_S} seconds, not {n}"
                )));
            }
            n => n.map_or(defaults.resume_window_s, |n| n as u64),
        },
        copy_storage: req.copy_storage.unwrap_or(defaults.copy_storage),
    };
    params.validate().map_err(api_error)?;
    Ok((endpoint, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use migration::AutoConverge;

    fn auto_converge(body: serde_json::Value) -> Result<AutoConverge, String> {
        let mut req = serde_json::json!({"destination": "tcp:127.0.0.1:1"});
        if !body.is_null() {
            req["auto_converge"] = body;
        }
        let req: MigrationRequest = serde_json::from_value(req).map_err(|e| e.to_string())?;
        params_from_request(&req)
            .map(|(_, p)| p.auto_converge)
            .map_err(|e| e.message)
    }

    #[test]
    fn auto_converge_takes_a_name_or_a_switch() {
        use serde_json::json;
        assert_eq!(auto_converge(json!(null)), Ok(AutoConverge::WhenStalled));
        assert_eq!(auto_converge(json!(true)), Ok(AutoConverge::Early));
        assert_eq!(auto_converge(json!(false)), Ok(AutoConverge::Off));
        assert_eq!(auto_converge(json!("off")), Ok(AutoConverge::Off));
        assert_eq!(
            auto_converge(json!("when-stalled")),
            Ok(AutoConverge::WhenStalled)
        );
        assert_eq!(auto_converge(json!("early")), Ok(AutoConverge::Early));
        let e = auto_converge(json!("sometimes")).unwrap_err();
        assert!(e.contains("unknown auto_converge 'sometimes'"), "{e}");
        let e = auto_converge(json!(3)).unwrap_err();
        assert!(e.contains("\"when-stalled\""), "{e}");
    }
}
