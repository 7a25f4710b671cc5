//! The migration report for people: a live progress line and a final table.

use std::fmt::Write;

use api::MigrationStatus;

pub fn progress_line(s: &MigrationStatus) -> String {
    format!(
        "{} round {} | {} pages left | dirty {:.0} pages/s | {:.0} Mbit/s | expected downtime {}{}",
        s.phase.name(),
        s.round,
        s.pages_remaining,
        s.dirty_pages_per_s,
        s.throughput_mbps,
        s.expected_downtime_ms
            .map_or("not known yet".into(), |ms| format!("{ms:.1} ms")),
        s.note
            .as_deref()
            .map(|n| format!(" | {n}"))
            .unwrap_or_default()
    )
}

fn opt_ms(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2} ms"))
        .unwrap_or_else(|| "-".into())
}

fn opt_rate(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.0} pages/s"))
        .unwrap_or_else(|| "-".into())
}

/// A figure the destination measures a moment after the VM resumed there.
fn guest_figure(s: &MigrationStatus, figure: String) -> String {
    if s.guest_report_pending {
        "follows (the destination's `ferry migration` shows it)".into()
    } else {
        figure
    }
}

/// The final table: what happened, then compression, post-copy, auto-converge, CPU, where the
/// time went, and the rounds.
pub fn render(s: &MigrationStatus) -> String {
    let mut o = String::new();
    let _ = match s.role.as_str() {
        "destination" => writeln!(o, "arrival {} ({}, {})", s.phase.name(), s.mode, s.peer),
        _ => writeln!(o, "migration {} ({} to {})", s.phase.name(), s.mode, s.peer),
    };
    if let Some(e) = &s.error {
        let _ = writeln!(o, "  error: {e}");
    }
    if let Some(n) = &s.note {
        let _ = writeln!(o, "  note: {n}");
    }
    for (k, v) in summary(s) {
        let _ = writeln!(o, "  {k:<33} {v}");
    }
    compression_lines(&mut o, s);
    if let Some(d) = &s.storage {
        let _ = writeln!(
            o,
            "  disks moved: {} of {} bytes; data {} bytes ({} on the wire), zeros {} bytes; \
             blocks resent {}, in the pause {}",
            d.disks,
            d.disk_bytes,
            d.data_bytes,
            d.data_wire_bytes,
            d.zero_bytes,
            d.blocks_resent,
            d.blocks_in_pause
        );
    }
    if s.postcopy {
        postcopy_lines(&mut o, s);
    }
    if s.throttle_percent_max > 0 {
        let held = s
            .vcpus_throttled_ms
            .map_or(String::new(), |ms| format!(", {ms:.0} ms in all"));
        let _ = writeln!(
            o,
            "  auto-converge: the guest's vCPUs slept up to {} % of the time{held} (released at \
             the end)",
            s.throttle_percent_max
        );
    }
    if !s.cpu.is_empty() {
        let _ = writeln!(o, "  {}", cpu_line(s));
    }
    if !s.breakdown.is_empty() {
        let _ = writeln!(o, "  {}", breakdown_line(s));
    }
    rounds_table(&mut o, s);
    o
}

/// A figure only the sending side measures: the source's report (or `ferry migrate`'s) has
/// it, a destination's shows a dash.
fn sent(s: &MigrationStatus, figure: String) -> String {
    match s.role.as_str() {
        "destination" => "- (the source's report has it)".into(),
        _ => figure,
    }
}

/// The figures every migration has, one per row.
fn summary(s: &MigrationStatus) -> [(&'static str, String); 22] {
    [
        ("setup", format!("{:.2} ms", s.setup_ms)),
        ("downtime (source's clock)", opt_ms(s.downtime_ms)),
        (
            "downtime (destination's clock)",
            opt_ms(s.destination_downtime_ms),
        ),
        (
            "downtime (guest-observed)",
            guest_figure(s, opt_ms(s.guest_observed_downtime_ms)),
        ),
        ("total time", format!("{:.2} ms", s.total_ms)),
        ("memory pages", s.memory_pages.to_string()),
        ("pages sent full", s.pages_full.to_string()),
        (
            "pages sent as zero markers",
            format!("{} (zero check: {})", s.pages_zero, s.zero_page_check),
        ),
        (
            "pages skipped (never populated)",
            sent(s, s.pages_skipped_unpopulated.to_string()),
        ),
        (
            "  of which given back by the guest",
            sent(s, s.pages_skipped_free.to_string()),
        ),
        (
            "pages skipped (zeros when round 0 began)",
            sent(s, s.pages_skipped_zero.to_string()),
        ),
        (
            "pages resent (dirtied again)",
            sent(s, s.pages_resent.to_string()),
        ),
        (
            "connection breaks carried on",
            format!("{} ({} pages sent again)", s.resumes, s.pages_sent_again),
        ),
        ("bytes on the wire", sent(s, s.bytes_on_wire.to_string())),
        (
            // A snapshot's lanes are its writers.
            if s.mode == "snapshot" {
                "writers"
            } else {
                "connections"
            },
            s.connections.to_string(),
        ),
        ("migration threads", s.migration_threads.to_string()),
        (
            "average throughput",
            sent(s, format!("{:.1} Mbit/s", s.average_throughput_mbps)),
        ),
        (
            "converged",
            s.converged.map(|c| c.to_string()).unwrap_or("-".into()),
        ),
        (
            "guest rate before",
            sent(s, opt_rate(s.guest_pages_per_s_before)),
        ),
        (
            "guest rate during",
            sent(s, opt_rate(s.guest_pages_per_s_during)),
        ),
        (
            "guest rate after",
            guest_figure(s, opt_rate(s.guest_pages_per_s_after)),
        ),
        (
            "memory checksum src/dst",
            match (s.memory_checksum_source, s.memory_checksum_destination) {
                (Some(a), Some(b)) => format!("{a:#010x} / {b:#010x}"),
                _ => "-".into(),
            },
        ),
    ]
}

/// What compression and delta encoding did, when they did anything.
fn compression_lines(o: &mut String, s: &MigrationStatus) {
    let c = &s.compression;
    if c.frames_lz4 + c.frames_zstd > 0 || !matches!(c.asked.as_str(), "" | "none") {
        let _ = writeln!(
            o,
            "  compression {}: frames plain {} | lz4 {} | zstd {}; page data {} -> {} bytes",
            c.asked, c.frames_plain, c.frames_lz4, c.frames_zstd, c.bytes_in, c.bytes_out
        );
    }
    if c.samples_lz4 + c.samples_zstd > 0 {
        let _ = writeln!(
            o,
            "  codecs measured on samples: lz4 {} | zstd {}",
            c.samples_lz4, c.samples_zstd
        );
    }
    if c.delta_pages > 0 {
        let _ = writeln!(
            o,
            "  delta encoding: {} pages re-sent as deltas, {} bytes saved",
            c.delta_pages, c.delta_bytes_saved
        );
    }
}

/// Post-copy's pages and faults.
fn postcopy_lines(o: &mut String, s: &MigrationStatus) {
    let lanes = match s.pages_pushed_on_lanes {
        0 => String::new(),
        n => format!(" ({n} on the extra connections)"),
    };
    let _ = writeln!(
        o,
        "  post-copy: {} pages pushed{lanes}, {} requested",
        s.pages_pushed, s.pages_requested
    );
    if let Some(n) = s.stale_pages_dropped_before_pause {
        let _ = writeln!(
            o,
            "  stale copies dropped on the destination before the pause: {n}"
        );
    }
    if let Some(r) = &s.postcopy_report {
        let _ = writeln!(
            o,
            "  network faults {} | zero-page faults {} | pages there before first access {} | duplicates {}",
            r.network_faults, r.zero_faults, r.pages_before_access, r.duplicates
        );
        let _ = writeln!(
            o,
            "  fault latency p50 {} p99 {} max {} | resume time (resume to last page) {:.2} ms",
            opt_ms(r.fault_latency_p50_ms),
            opt_ms(r.fault_latency_p99_ms),
            opt_ms(r.fault_latency_max_ms),
            r.resume_ms
        );
    }
}

/// One row per round.
fn rounds_table(o: &mut String, s: &MigrationStatus) {
    if s.rounds.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "  {:>5} {:>10} {:>10} {:>12} {:>10} {:>14} {:>9}",
        "round", "pages", "zero", "bytes", "ms", "dirty pages/s", "throttle"
    );
    for r in &s.rounds {
        let _ = writeln!(
            o,
            "  {:>5} {:>10} {:>10} {:>12} {:>10.2} {:>14.0} {:>8}%",
            r.round,
            r.pages,
            r.zero_pages,
            r.bytes,
            r.duration_ms,
            r.dirty_pages_per_s,
            r.throttle_percent
        );
    }
}

/// Where this side's time went, stretch by stretch (ms on its clock); stretches of a few
/// µs are left out of the line (the JSON has them all).
fn breakdown_line(s: &MigrationStatus) -> String {
    let shown: Vec<String> = s
        .breakdown
        .iter()
        .filter(|b| b.ms >= 0.05)
        .map(|b| format!("{} {:.2}", b.name, b.ms))
        .collect();
    let all: f64 = s.breakdown.iter().map(|b| b.ms).sum();
    format!(
        "time ({}, ms, {all:.2} in all): {}",
        s.role,
        shown.join(" | ")
    )
}

/// Where this side's CPU went: per kind of work, its CPU seconds, its threads, and how busy
/// the busiest of them was (near 100 %: that work is what the migration waits for).
fn cpu_line(s: &MigrationStatus) -> String {
    let works: Vec<String> = s
        .cpu
        .iter()
        .map(|u| {
            format!(
                "{} {:.3} s on {} thread{} (busiest {:.0} %)",
                u.work,
                u.cpu_s,
                u.threads,
                if u.threads == 1 { "" } else { "s" },
                u.busiest * 100.0
            )
        })
        .collect();
    format!("CPU ({}): {}", s.role, works.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first word of each line of the report.
    fn labels(mode: &str) -> Vec<String> {
        let s = MigrationStatus {
            mode: mode.into(),
            connections: 2,
            ..Default::default()
        };
        render(&s)
            .lines()
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect()
    }

    #[test]
    fn a_snapshot_counts_writers_and_a_migration_connections() {
        let (snapshot, migration) = (labels("snapshot"), labels("precopy"));
        assert!(snapshot.contains(&"writers".into()), "{snapshot:?}");
        assert!(!snapshot.contains(&"connections".into()), "{snapshot:?}");
        assert!(migration.contains(&"connections".into()), "{migration:?}");
        assert!(!migration.contains(&"writers".into()), "{migration:?}");
    }

    #[test]
    fn the_cpu_line_names_each_work_and_its_busiest_thread() {
        let mut s = MigrationStatus {
            role: "source".into(),
            ..Default::default()
        };
        assert!(!render(&s).contains("CPU ("), "no line without figures");
        s.cpu = vec![
            api::WorkCpu {
                work: "send".into(),
                threads: 2,
                cpu_s: 0.5,
                wall_s: 0.8,
                busiest: 0.97,
            },
            api::WorkCpu {
                work: "pack".into(),
                threads: 1,
                cpu_s: 0.25,
                wall_s: 0.4,
                busiest: 0.6,
            },
        ];
        let line = render(&s)
            .lines()
            .find(|l| l.trim_start().starts_with("CPU"))
            .map(str::to_string)
            .unwrap();
        assert_eq!(
            line.trim(),
            "CPU (source): send 0.500 s on 2 threads (busiest 97 %) | \
             pack 0.250 s on 1 thread (busiest 60 %)"
        );
    }
}
