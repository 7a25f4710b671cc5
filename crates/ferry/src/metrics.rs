//! The opt-in OpenMetrics endpoint (`ferry run --metrics`, `ferry ch --metrics`): the VM and
//! its migrations as a Prometheus server scrapes them. Every figure is read at the scrape from what the API
//! reads, so the two never disagree. Counters add up every migration of this process (the
//! status board keeps the totals of those that ended; the running one adds its progress),
//! so they only grow; gauges show the migration now. Served by a small reader of its own
//! that answers `GET /metrics` only, read by the API's HTTP reader (`api::scrape`) within a
//! whole-request deadline.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use api::scrape::{Scrape, read_scrape};
use migration::StatusBoard;
use migration::buckets::Buckets;
use migration::status::{Phase, Role, Status};
use migration::totals::{Totals, has_ended};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use sockets::deadline::{Timed, Within};

use crate::controller::Controller;

/// How long a scraper has to send its request (it sends it at once; its head is 16 KiB at
/// most, with no body), and to take the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// Scrapes served at once; past this a connection is closed unanswered.
const MAX_CONNECTIONS: usize = 8;
/// Of those, from one address (TCP): a client that opens connections and sends nothing
/// holds at most this many, so the others' scrapes still get in.
const MAX_PER_PEER: usize = 2;
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Where the endpoint listens: `tcp:HOST:PORT` (or `HOST:PORT`) or `unix:PATH`.
#[derive(Clone, Debug, PartialEq)]
pub enum MetricsAddr {
    Tcp(String),
    Unix(PathBuf),
}

impl FromStr for MetricsAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            return match path {
                "" => Err("unix: needs a path".into()),
                p => Ok(Self::Unix(p.into())),
            };
        }
        let hostport = s.strip_prefix("tcp:").unwrap_or(s);
        match hostport.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(Self::Tcp(hostport.into()))
            }
            _ => Err(format!(
                "{s}: expected tcp:HOST:PORT, HOST:PORT or unix:PATH"
            )),
        }
    }
}

/// The endpoint while it serves; a Unix socket it made is removed when it is dropped.
pub struct MetricsServer {
    path: Option<PathBuf>,
    final_scrapes: Arc<AtomicU64>,
}

impl MetricsServer {
    /// Scrapes answered with the figures of a VM that has moved away: its final counters.
    pub fn final_scrapes(&self) -> u64 {
        self.final_scrapes.load(Ordering::Acquire)
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// What a scrape reads: `ferry run`'s one VM, or the Cloud Hypervisor profile's VM of the
/// moment (none while its VMM is empty).
pub trait Scraped: Send + Sync {
    /// The VM's controller, while a VM is here or arriving.
    fn controller(&self) -> Option<Arc<Controller>>;
    /// The board of the latest VM's migrations: the controller's, or once its VM has gone
    /// (moved away, deleted) the last one's, so that its outcome can still be scraped.
    fn board(&self) -> Option<StatusBoard>;
}

impl Scraped for Controller {
    fn controller(&self) -> Option<Arc<Controller>> {
        Some(self.self_ref())
    }

    fn board(&self) -> Option<StatusBoard> {
        Some(self.migrations.board.clone())
    }
}

/// Who may scrape: anyone who reaches the endpoint, or only a request that carries the
/// operator's bearer token (`--metrics-token-file`, as Prometheus's
/// `authorization: credentials_file` sends it).
#[derive(Clone, Default)]
pub struct Access {
    token: Option<String>,
}

impl Access {
    /// The token in `path`: one line, readable by its owner only.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let what = || format!("--metrics-token-file {}", path.display());
        let mode = std::fs::metadata(path)
            .with_context(what)?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            anyhow::bail!(
                "{}: readable by other users (mode {:o}); chmod 600 it",
                what(),
                mode & 0o777
            );
        }
        let token = std::fs::read_to_string(path).with_context(what)?;
        let token = token.trim();
        if token.is_empty() || token.chars().any(|c| c.is_whitespace()) {
            anyhow::bail!("{}: holds no token (one word, on one line)", what());
        }
        Ok(Self {
            token: Some(token.into()),
        })
    }

    /// Whether `scrape` may be answered.
    fn allows(&self, scrape: &Scrape) -> bool {
        self.token.as_ref().is_none_or(|t| scrape.carries(t))
    }
}

/// Everyone, or with `token_file` only those who carry its token.
pub fn access(token_file: Option<&std::path::Path>) -> Result<Access> {
    token_file.map_or(Ok(Access::default()), Access::from_file)
}

/// Starts serving `source`'s metrics at `addr`, to whom `access` allows.
pub fn start(
    addr: &MetricsAddr,
    source: Arc<dyn Scraped>,
    access: Access,
) -> Result<MetricsServer> {
    let (listener, path) = match addr {
        MetricsAddr::Tcp(a) => (
            Listener::Tcp(TcpListener::bind(a).with_context(|| format!("--metrics {a}"))?),
            None,
        ),
        MetricsAddr::Unix(p) => {
            sockets::unix::remove_stale_socket(p)
                .with_context(|| format!("--metrics unix:{}", p.display()))?;
            let l = sockets::unix::bind_private(p)
                .with_context(|| format!("--metrics unix:{}", p.display()))?;
            (Listener::Unix(l), Some(p.clone()))
        }
    };
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Exposition {
        source: source.clone(),
    }));
    let final_scrapes = Arc::new(AtomicU64::new(0));
    let endpoint = Endpoint {
        registry: Arc::new(registry),
        access,
        source,
        final_scrapes: final_scrapes.clone(),
    };
    std::thread::Builder::new()
        .name("metrics-accept".into())
        .spawn(move || {
            // Past this point, the endpoint's threads open nothing (see vmm::sandbox).
            if let Err(e) = vmm::sandbox::enter_metrics_thread() {
                tracing::error!("the metrics endpoint does not serve: {e}");
                return;
            }
            accept(listener, &endpoint)
        })?;
    Ok(MetricsServer {
        path,
        final_scrapes,
    })
}

/// What a scrape is answered from, and who may scrape.
struct Endpoint {
    registry: Arc<Registry>,
    access: Access,
    source: Arc<dyn Scraped>,
    /// See `MetricsServer::final_scrapes`.
    final_scrapes: Arc<AtomicU64>,
}

/// The connections being served, in all and per TCP peer.
#[derive(Default)]
struct Open {
    all: AtomicUsize,
    by_peer: Mutex<HashMap<IpAddr, usize>>,
}

impl Open {
    /// Takes a place for a connection from `peer` (None: a Unix socket's), if one is free.
    fn take(&self, peer: Option<IpAddr>) -> bool {
        if let Some(ip) = peer {
            let mut by_peer = self.by_peer.lock().unwrap_or_else(|e| e.into_inner());
            let n = by_peer.entry(ip).or_default();
            if *n >= MAX_PER_PEER {
                return false;
            }
            *n += 1;
        }
        if self.all.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            self.give_back(peer);
            return false;
        }
        true
    }

    fn give_back(&self, peer: Option<IpAddr>) {
        self.all.fetch_sub(1, Ordering::AcqRel);
        if let Some(ip) = peer {
            let mut by_peer = self.by_peer.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = by_peer.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    by_peer.remove(&ip);
                }
            }
        }
    }
}

fn accept(listener: Listener, endpoint: &Endpoint) {
    let open = Arc::new(Open::default());
    std::thread::scope(|scope| {
        loop {
            let (conn, peer): (Box<dyn Conn>, Option<IpAddr>) = match &listener {
                Listener::Tcp(l) => match l.accept() {
                    Ok((c, at)) => (Box::new(c), Some(at.ip())),
                    Err(_) => continue,
                },
                Listener::Unix(l) => match l.accept() {
                    Ok((c, _)) => (Box::new(c), None),
                    Err(_) => continue,
                },
            };
            if !open.take(peer) {
                continue; // dropped: the scraper retries at its next interval
            }
            let mine = open.clone();
            let spawned = std::thread::Builder::new()
                .name("metrics-scrape".into())
                .spawn_scoped(scope, move || {
                    let answered = serve(conn, endpoint);
                    // The place is free before the client sees the connection end: a client
                    // that scrapes again at once finds it.
                    mine.give_back(peer);
                    drop(answered);
                });
            if spawned.is_err() {
                open.give_back(peer);
            }
        }
    });
}

/// A scraper's connection, over TCP or a Unix socket.
trait Conn: Read + Write + Timed + Send {}

impl<S: Read + Write + Timed + Send> Conn for S {}

/// Answers one request; returns the connection, still open.
fn serve(mut conn: Box<dyn Conn>, endpoint: &Endpoint) -> Box<dyn Conn> {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    // Read before the figures are: a status only moves on, so these figures are final.
    let moved_away = endpoint
        .source
        .board()
        .is_some_and(|b| b.read().moved_away());
    let (status, content_type, body) = match read_scrape(&mut Within::new(&mut conn, deadline)) {
        Ok(scrape) if !endpoint.access.allows(&scrape) => (
            "401 Unauthorized".into(),
            PLAIN,
            "this endpoint wants Authorization: Bearer <the token of --metrics-token-file>\n"
                .into(),
        ),
        Ok(scrape) => answer(&scrape, &endpoint.registry),
        Err(e) => (
            format!("{} {}", e.status, reason(e.status)),
            PLAIN,
            format!("{}\n", e.message),
        ),
    };
    let challenge = match status.starts_with("401") {
        true => "WWW-Authenticate: Bearer\r\n",
        false => "",
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         {challenge}Connection: close\r\n\r\n",
        body.len()
    );
    let _ = conn.set_io_timeout(CLIENT_TIMEOUT);
    let sent = conn
        .write_all(head.as_bytes())
        .and_then(|()| conn.write_all(body.as_bytes()));
    if sent.is_ok() && status.starts_with("200") && moved_away {
        endpoint.final_scrapes.fetch_add(1, Ordering::AcqRel);
    }
    conn
}

/// The reason phrase of a status the endpoint answers with.
fn reason(status: u16) -> &'static str {
    match status {
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Payload Too Large",
        _ => "Bad Request",
    }
}

const PLAIN: &str = "text/plain; charset=utf-8";
/// Bytes of a guest page, the unit the engine counts memory in.
const PAGE_BYTES: u64 = 4096;

/// The exposition `scrape` asks for: OpenMetrics, or Prometheus's text format.
fn answer(scrape: &Scrape, registry: &Registry) -> (String, &'static str, String) {
    let mut body = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut body, registry) {
        return ("500 Internal Server Error".into(), PLAIN, format!("{e}\n"));
    }
    match scrape.openmetrics {
        true => ("200 OK".into(), OPENMETRICS, body),
        false => ("200 OK".into(), PROMETHEUS_TEXT, to_prometheus_text(&body)),
    }
}

/// The same exposition in Prometheus's text format (0.0.4), for scrapers that do not ask
/// for OpenMetrics: a counter's family is named as its sample (`…_total`), and no `# EOF`.
fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: Vec<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines().filter(|&l| l != "# EOF") {
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let (name, rest) = line.strip_prefix(prefix)?.split_once(' ')?;
            counters
                .contains(&name)
                .then(|| format!("{prefix}{name}_total {rest}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// What a scrape reads: the source's VM and migrations.
struct Exposition {
    source: Arc<dyn Scraped>,
}

impl std::fmt::Debug for Exposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exposition")
    }
}

impl Collector for Exposition {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode_build(&mut enc)?;
        if let Some(controller) = self.source.controller() {
            encode_vm(&controller, &mut enc)?;
        }
        let Some(board) = self.source.board() else {
            return Ok(());
        };
        let (status, totals) = board.read_with_totals();
        encode_counters(&status, &totals, &mut enc)?;
        encode_gauges(&status, &mut enc)?;
        histogram(
            &mut enc,
            "ferry_migration_downtime_seconds",
            "Downtime of each completed migration, on this host's clock.",
            &totals.downtime,
        )?;
        histogram(
            &mut enc,
            "ferry_migration_postcopy_fault_latency_seconds",
            "How long each post-copy fault waited for its page from the source (destination).",
            &totals.fault_latency,
        )
    }
}

/// Which ferry answers: `ferry --version` as labels.
fn encode_build(enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let stream = migration::wire::frame::VERSION.to_string();
    enc.encode_descriptor(
        "ferry_build_info",
        "The ferry that answers: 1, with its version, commit and migration stream version.",
        None,
        MetricType::Gauge,
    )?
    .encode_family(&[
        ("version", env!("CARGO_PKG_VERSION")),
        ("commit", env!("FERRY_COMMIT")),
        ("migration_stream", stream.as_str()),
    ])?
    .encode_gauge(&1i64)
}

fn encode_vm(c: &Controller, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let info = c.info();
    let mut m = enc.encode_descriptor(
        "ferry_vm_state",
        "The VM's state: 1 for the state it is in.",
        None,
        MetricType::Gauge,
    )?;
    m.encode_family(&[("state", info.state.as_str())])?
        .encode_gauge(&1i64)?;
    gauge(enc, "ferry_vm_vcpus", "vCPUs of the VM.", info.vcpus as i64)?;
    gauge(
        enc,
        "ferry_vm_memory_bytes",
        "Guest memory of the VM.",
        info.memory_bytes as i64,
    )?;
    match &info.balloon {
        Some(b) => encode_balloon(b, enc),
        None => Ok(()),
    }
}

/// The balloon, for a VM that has one (`ferry run --balloon`).
fn encode_balloon(b: &api::BalloonStatus, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let bytes = |pages: u64| (pages * 4096) as i64;
    gauge(
        enc,
        "ferry_balloon_target_bytes",
        "The balloon's target: memory the guest is asked to give back.",
        bytes(b.target_pages),
    )?;
    gauge(
        enc,
        "ferry_balloon_actual_bytes",
        "Memory the guest says its balloon holds.",
        bytes(b.actual_pages),
    )?;
    counter(
        enc,
        "ferry_balloon_freed_bytes",
        "Memory the guest gave back (inflated or reported free) that held data.",
        b.freed_bytes,
    )?;
    match b.guest_free_bytes {
        Some(free) => gauge(
            enc,
            "ferry_balloon_guest_free_bytes",
            "Free memory, as the guest's last statistics said.",
            free as i64,
        ),
        None => Ok(()),
    }
}

/// Counters: the ended migrations' totals, plus the running one's progress.
fn encode_counters(
    s: &Status,
    t: &Totals,
    enc: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let running = !has_ended(s.phase);
    let now = |v: u64| if running { v } else { 0 };
    let p = &s.progress;
    let mut m = enc.encode_descriptor(
        "ferry_migration_pages",
        "Pages moved, by kind: full (data), zero (markers), skipped (never populated), \
         skipped_zero (zeros when round 0 began).",
        None,
        MetricType::Counter,
    )?;
    for (kind, total, current) in [
        ("full", t.pages_full, p.pages.full),
        ("zero", t.pages_zero, p.pages.zero),
        ("skipped", t.pages_skipped, p.pages.skipped_unpopulated),
        ("skipped_zero", t.pages_skipped_zero, p.pages.skipped_zero),
    ] {
        m.encode_family(&[("kind", kind)])?
            .encode_counter::<NoLabelSet, _, u64>(&(total + now(current)), None)?;
    }
    counter(
        enc,
        "ferry_migration_pages_skipped_free",
        "Of the skipped pages, those the guest gave back (balloon, free page reporting or hints).",
        t.pages_skipped_free + now(p.pages.skipped_free),
    )?;
    counter(
        enc,
        "ferry_migration_bytes",
        "Bytes this host put on the wire for migrations.",
        t.bytes_on_wire + now(p.bytes_on_wire),
    )?;
    counter(
        enc,
        "ferry_migration_rounds",
        "Pre-copy rounds.",
        t.rounds + now(p.rounds.len() as u64),
    )?;
    let mut m = enc.encode_descriptor(
        "ferry_migrations",
        "Migrations that ended, by role and outcome.",
        None,
        MetricType::Counter,
    )?;
    // Every outcome is there from the start, at 0: `increase()` then sees the first one.
    for role in [Role::Source, Role::Destination] {
        for outcome in OUTCOMES {
            let n = t
                .ended
                .iter()
                .find(|(k, _)| *k == (role, outcome))
                .map_or(0, |(_, n)| *n);
            m.encode_family(&[("role", role_name(role)), ("outcome", outcome.name())])?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
    }
    Ok(())
}

/// How a migration can end (`totals::has_ended`).
const OUTCOMES: [Phase; 3] = [Phase::Completed, Phase::Failed, Phase::Cancelled];

/// Gauges: the migration as it stands now.
fn encode_gauges(s: &Status, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(
        "ferry_migration_phase",
        "The last migration's phase: 1 for the phase it is in.",
        None,
        MetricType::Gauge,
    )?;
    m.encode_family(&[("role", role_name(s.role)), ("phase", s.phase.name())])?
        .encode_gauge(&1i64)?;
    let p = &s.progress;
    let active = s.phase.is_running() || s.phase == Phase::PostcopyPaused;
    let live = |v: f64| if active { v } else { 0.0 };
    gauge(
        enc,
        "ferry_migration_round",
        "The round now.",
        i64::from(p.round),
    )?;
    gauge(
        enc,
        "ferry_migration_remaining_bytes",
        "Guest memory left to send in this round.",
        (p.pages_remaining * PAGE_BYTES) as i64,
    )?;
    gauge_f(
        enc,
        "ferry_migration_dirty_rate_bytes_per_second",
        "The guest's dirty rate, as the last round measured it.",
        live(p.dirty_pages_per_s * PAGE_BYTES as f64),
    )?;
    gauge_f(
        enc,
        "ferry_migration_throughput_bytes_per_second",
        "What the pages move at now.",
        live(p.throughput_mbps * 1e6 / 8.0),
    )?;
    gauge_f(
        enc,
        "ferry_migration_expected_downtime_seconds",
        "The downtime a switch now would cost, as the policy expects it.",
        live(p.expected_downtime.map_or(0.0, |d| d.as_secs_f64())),
    )
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Source => "source",
        Role::Destination => "destination",
    }
}

fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> std::fmt::Result {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&v)
}

fn gauge_f(enc: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> std::fmt::Result {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&v)
}

fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    enc.encode_descriptor(name, help, None, MetricType::Counter)?
        .encode_counter::<NoLabelSet, _, u64>(&v, None)
}

fn histogram(enc: &mut DescriptorEncoder, name: &str, help: &str, b: &Buckets) -> std::fmt::Result {
    enc.encode_descriptor(name, help, None, MetricType::Histogram)?
        .encode_histogram::<NoLabelSet>(b.sum, b.count, &b.per_bucket(), None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_name_tcp_or_unix() {
        assert_eq!(
            "tcp:127.0.0.1:9400".parse(),
            Ok(MetricsAddr::Tcp("127.0.0.1:9400".into()))
        );
        assert_eq!(
            "[::1]:9400".parse(),
            Ok(MetricsAddr::Tcp("[::1]:9400".into()))
        );
        assert_eq!(
            "unix:/run/ferry/m.sock".parse(),
            Ok(MetricsAddr::Unix("/run/ferry/m.sock".into()))
        );
        for bad in ["", "9400", "unix:", "tcp:host", "host:port", ":9400"] {
            let e = bad.parse::<MetricsAddr>().unwrap_err();
            assert!(
                e.contains("expected") || e.contains("needs a path"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn prometheus_text_names_counter_families_by_their_samples() {
        let om = "# HELP a_bytes Bytes.\n# TYPE a_bytes counter\na_bytes_total 3\n\
                  # HELP g A gauge.\n# TYPE g gauge\ng 1\n# EOF\n";
        assert_eq!(
            to_prometheus_text(om),
            "# HELP a_bytes_total Bytes.\n# TYPE a_bytes_total counter\na_bytes_total 3\n\
             # HELP g A gauge.\n# TYPE g gauge\ng 1\n"
        );
    }

    #[test]
    fn a_scrape_gets_the_format_it_asks_for() {
        let registry = Registry::default();
        let scrape = |raw: &str| api::scrape::read_scrape(&mut raw.as_bytes()).unwrap();
        let (status, kind, body) = answer(&scrape("GET /metrics HTTP/1.1\r\n\r\n"), &registry);
        assert_eq!((status.as_str(), kind), ("200 OK", PROMETHEUS_TEXT));
        assert!(!body.contains("# EOF"));
        let asked =
            "GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0\r\n\r\n";
        let (status, kind, body) = answer(&scrape(asked), &registry);
        assert_eq!((status.as_str(), kind), ("200 OK", OPENMETRICS));
        assert!(body.ends_with("# EOF\n"));
    }
}
