//! Command-line grammar.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use migration::MigrationParams;
use vmm::cpuid::CpuModel;
use vmm::devices::virtio::balloon::BalloonConfig;
use vmm::{DiskConfig, MemoryBackend, MemorySize, NetConfig};

/// `ferry --version`: the release, the commit it was built from, and the migration stream
/// versions it writes and reads (docs/protocol.md).
fn version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        format!(
            "{} (commit {}, migration stream {}, reads {} and later)",
            env!("CARGO_PKG_VERSION"),
            env!("FERRY_COMMIT"),
            migration::wire::frame::VERSION,
            migration::wire::frame::OLDEST_READ
        )
    })
}

/// The engine's defaults, shown by `--help` and sent as given.
const DEFAULTS: MigrationParams = MigrationParams::DEFAULT;

#[derive(Parser, Debug)]
#[command(
    name = "ferry",
    version = version(),
    about = "A VMM built to move running VMs between hosts"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Boot a guest (or wait for an incoming migration) and serve the control API.
    Run(Box<RunArgs>),
    /// Print the VM's state and guest progress (GET vm.info) as JSON.
    Status(ApiArgs),
    /// Pause every vCPU.
    Pause(ApiArgs),
    /// Resume a paused VM.
    Resume(ApiArgs),
    /// Stop the VM and its ferry process.
    Shutdown(ApiArgs),
    /// Live-migrate the VM to a ferry started with --incoming, showing progress.
    Migrate(MigrateArgs),
    /// Show the VM's migration on either side, running or ended (GET vm.migration); with
    /// --watch, follow it until it ends. Exits as `ferry migrate` does.
    Migration(WatchArgs),
    /// Cancel the running migration and follow it to its end: the VM runs on at the source
    /// (exit 3), unless it had already been handed over (exit 0).
    Cancel(CancelArgs),
    /// Switch the running pre-copy migration to post-copy (like QEMU's migrate-start-postcopy)
    /// at once: the round being sent stops where it is and its pages follow the switch.
    StartPostcopy(ApiArgs),
    /// Write the VM to a file and leave it paused here (cold migration); `ferry run --restore
    /// FILE` brings it back.
    Snapshot(SnapshotArgs),
    /// Run the VM here again, from the moment it paused for the switch, after a switch whose
    /// outcome the source cannot know (state `unconfirmed`, or `postcopy-paused` on the source).
    /// Only once you know the destination does not run it (its host is down or fenced): ferry
    /// cannot know, so it never does this by itself.
    MigrateReclaim(TakeBackArgs),
    /// After the destination died mid post-copy (state `postcopy-paused` on the source): run
    /// the VM here again from the newest checkpoint the destination sent back (`ferry migrate
    /// --checkpoint-ms`), or from the switch if none came. Only once you know the destination
    /// does not run it: ferry cannot know, so it never does this by itself.
    MigrateRollback(TakeBackArgs),
    /// Carry on a post-copy whose connection broke: on the destination `--listen URL`, then on
    /// the source `--to URL`. A pre-copy carries itself on (`--resume-window-s`); while it
    /// dials again, `--to URL` on the source points it at another address of its destination.
    MigrateResume(MigrateResumeArgs),
    /// Make a CA and a certificate for each named host, for TLS migrations (--tls-*).
    Certs(CertsArgs),
    /// Set the balloon's target (PUT vm.balloon): the memory the guest is asked to give back
    /// (`ferry run --balloon`).
    Balloon(BalloonArgs),
    /// Be driven as Cloud Hypervisor is: its flags (--api-socket path=…|fd=N, --kernel,
    /// --memory size=…, --event-monitor, …), its REST API and its events
    /// (docs/orchestrators.md). Started as `cloud-hypervisor` (a link), ferry does the same.
    Ch(ChArgs),
}

#[derive(Args, Debug)]
pub struct ChArgs {
    /// Cloud Hypervisor's flags, as it takes them.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

#[derive(Args, Debug)]
pub struct MigrateResumeArgs {
    /// The Unix socket of this side's control API.
    #[arg(long)]
    pub api_socket: PathBuf,
    /// Destination side: where to wait for the source (tcp:HOST:PORT or unix:PATH).
    #[arg(long, conflicts_with = "to", required_unless_present = "to")]
    pub listen: Option<String>,
    /// Source side: the destination's new address.
    #[arg(long)]
    pub to: Option<String>,
    /// Destination side: how long to wait for the source, in seconds (default 300).
    #[arg(long, requires = "listen", value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub timeout_s: Option<u64>,
}

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// The Unix socket of the source VM's control API.
    #[arg(long)]
    pub api_socket: PathBuf,
    /// Destination: tcp:HOST:PORT or unix:PATH
    #[arg(long)]
    pub to: String,
    /// precopy (live), warm (pause, copy, resume there), postcopy (resume there at once,
    /// pages follow), hybrid (one pre-copy round, then post-copy) or local (--local)
    #[arg(long, default_value = "precopy")]
    pub mode: String,
    /// Live update (--mode local): hand the VM to a ferry on this host (--to unix:PATH, a
    /// `ferry run --incoming unix:PATH`, typically a newer binary) without copying its memory:
    /// memory, disks and taps pass as open files. The VM must run with
    /// --memory-backend memfd; any failure before the new process runs it leaves it here.
    #[arg(long, conflicts_with = "mode")]
    pub local: bool,
    /// When pre-copy will not converge, switch to post-copy instead of stop-and-copy.
    #[arg(long)]
    pub auto_postcopy: bool,
    /// When to slow the guest's vCPUs (20 %, then +10 % a round, or at once what the measured
    /// rates need for the guest to dirty half of what the link sends) until pre-copy
    /// converges: off (stop-and-copy after 3 rounds without progress), when-stalled (the
    /// default: once a round shows pre-copy cannot converge on its own) or early (from the
    /// round the guest dirties half of what the link sends; the flag alone means early).
    #[arg(
        long,
        value_name = "WHEN",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "early"
    )]
    pub auto_converge: Option<String>,
    /// Post-copy push order: bubble (pre-paging around the last fault) or linear (push only).
    #[arg(long)]
    pub prepaging: Option<String>,
    /// Connections the pages travel on, each with its own sender thread (1..=16). After a
    /// switch to post-copy the extra ones push and the main one answers the guest's faults.
    #[arg(long, allow_negative_numbers = true)]
    pub connections: Option<i64>,
    /// Page data compressed per frame: none, lz4, zstd, or auto (the default: each connection
    /// picks what moves its pages soonest over this link, and changes its mind).
    #[arg(long)]
    pub compression: Option<String>,
    /// Threads that compress page data, shared out among the connections (default: one per
    /// connection, its sender; more needs --compression).
    #[arg(long, allow_negative_numbers = true)]
    pub migration_threads: Option<i64>,
    /// Send re-sent pages as deltas of their last copy (XBZRLE-like), keeping this many MiB
    /// of last-sent copies, grown as pages are sent (0: off; default 256 in precopy and
    /// hybrid, whose rounds re-send pages, 0 in warm and postcopy).
    #[arg(long, allow_negative_numbers = true)]
    pub delta_cache_mb: Option<i64>,
    /// Send Go right behind the state: the destination starts as soon as it has loaded it, a
    /// round trip sooner (what a long path feels). Should the connection drop before the
    /// destination answers, the source stays paused (`unconfirmed`) instead of running on.
    /// Default: on where the round trip is 2 ms or more; `--go-with-state=false` never.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub go_with_state: Option<bool>,
    /// Post-copy checkpoints: every this many ms (5..=60000) the destination sends the VM's
    /// newest state back, so that `ferry migrate-rollback` can carry on from it on the source
    /// should the destination die. Off by default.
    #[arg(long, allow_negative_numbers = true)]
    pub checkpoint_ms: Option<i64>,
    /// Pre-copy over one connection: should the connection break while the VM still runs
    /// here, reconnect for up to this many seconds (0..=120, default 60; 0: fail at once) and
    /// carry on, sending only the pages whose last copy did not land and what was dirtied
    /// meanwhile.
    #[arg(long, allow_negative_numbers = true)]
    pub resume_window_s: Option<i64>,
    /// Move the VM's disks with it, for hosts that share no storage: their blocks travel in
    /// the migration's stream, pre-copied in rounds with the guest's writes, the last ones
    /// in the pause. The destination's `--disk` in each slot receives them (same size).
    /// Modes precopy and warm.
    #[arg(long)]
    pub copy_storage: bool,
    /// The pause the switch may take: pre-copy iterates until what is left would go in this
    /// many ms at the link's measured pace.
    #[arg(long, allow_negative_numbers = true, default_value_t = DEFAULTS.max_downtime_ms as i64)]
    pub max_downtime_ms: i64,
    /// Cap on the migration's bandwidth, all connections together, in Mbit/s (default: none).
    #[arg(long, allow_negative_numbers = true)]
    pub max_bandwidth_mbps: Option<i64>,
    /// Pre-copy rounds before the switch happens whatever is left.
    #[arg(long, allow_negative_numbers = true, default_value_t = i64::from(DEFAULTS.max_rounds))]
    pub max_rounds: i64,
    /// Give up (the VM runs on here) if the migration has not switched over by then, in
    /// seconds.
    #[arg(long, allow_negative_numbers = true, default_value_t = DEFAULTS.timeout_s as i64)]
    pub timeout_s: i64,
    /// Both VMMs checksum guest memory at the switch and compare (adds downtime).
    #[arg(long)]
    pub checksum: bool,
    /// Print the final report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct SnapshotArgs {
    /// The Unix socket of the VM's control API.
    #[arg(long)]
    pub api_socket: PathBuf,
    /// The snapshot file to write: a new file in the VM's `ferry run --snapshot-dir` (a bare
    /// name lands there; a path elsewhere, or a VM without --snapshot-dir, is refused).
    #[arg(long)]
    pub to: PathBuf,
    /// Page data compressed per frame: none (default), lz4, zstd or auto.
    #[arg(long)]
    pub compression: Option<String>,
    /// Threads that compress page data while the file is written (default: one per writer;
    /// more needs --compression).
    #[arg(long, allow_negative_numbers = true)]
    pub migration_threads: Option<i64>,
    /// Threads that write the file at once, each its own lane of it (default 1; at most 16).
    #[arg(long, allow_negative_numbers = true)]
    pub writers: Option<i64>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BalloonArgs {
    /// The Unix socket of the VM's control API.
    #[arg(long)]
    pub api_socket: PathBuf,
    /// The balloon's target: a size (512M, 1G) or a number of MiB; 0 gives the guest all its
    /// memory back.
    #[arg(value_name = "TARGET", value_parser = crate::balloon::parse_target)]
    pub target_mib: u64,
}

#[derive(Args, Debug)]
pub struct TakeBackArgs {
    /// The Unix socket of the VM's control API.
    #[arg(long)]
    pub api_socket: PathBuf,
    /// Take the VM back although it has a writable disk the destination may have written
    /// since the switch (the guest then finds writes on it that it does not remember).
    #[arg(long)]
    pub force: bool,
}

#[derive(Args, Debug)]
pub struct WatchArgs {
    /// The Unix socket of the VM's control API.
    #[arg(long)]
    pub api_socket: PathBuf,
    /// Follow the migration until it ends (and the guest's own figures are in); Ctrl-C stops
    /// watching, the migration goes on.
    #[arg(long)]
    pub watch: bool,
    /// Print the status as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CancelArgs {
    /// The Unix socket of the VM's control API.
    #[arg(long)]
    pub api_socket: PathBuf,
    /// Print the final status as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ApiArgs {
    /// The Unix socket of the VM's control API.
    #[arg(long)]
    pub api_socket: PathBuf,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The guest: an ELF with a PVH entry note (e.g. guest/build/guest.elf, or any PVH
    /// kernel), entered in 32-bit protected mode with %ebx = hvm_start_info.
    #[arg(long, conflicts_with = "kernel")]
    pub guest: Option<PathBuf>,
    /// A Linux kernel (bzImage or vmlinux), booted by the Linux boot protocol (zero page
    /// with the E820 map; --cmdline is the kernel's command line).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// An initrd for --kernel.
    #[arg(long, requires = "kernel", conflicts_with = "guest")]
    pub initrd: Option<PathBuf>,
    /// Guest memory: 512M, 4G, ... (default 1G). With --incoming: the VM expected, built
    /// before it arrives (as QEMU's destination is), so that building it is not part of the
    /// move; a VM of another size is refused. Without it, the VM is built when the source
    /// says what it is.
    #[arg(long, conflicts_with = "restore")]
    pub memory: Option<MemorySize>,
    /// How guest memory is backed: anonymous or memfd.
    #[arg(long, default_value = "anonymous")]
    pub memory_backend: MemoryBackend,
    /// The CPU model a booted guest sees: host (all KVM supports) or baseline (what every KVM
    /// runs, one that emulates guest kernels too). Default: baseline where KVM emulates guest
    /// kernels (PVM), host elsewhere. An arriving VM keeps its source's.
    #[arg(long, conflicts_with_all = ["incoming", "restore"])]
    pub cpu_model: Option<CpuModel>,
    /// vCPUs (default 1). With --incoming, as --memory: the VM expected, built ahead.
    #[arg(long, conflicts_with = "restore")]
    pub vcpus: Option<usize>,
    /// The guest's command line (its workload), e.g. "write ws=256M seq verify".
    #[arg(long, default_value = "")]
    pub cmdline: String,
    /// A virtio-blk disk on a file or block device: path=FILE[,readonly] (repeat for more, at
    /// most 8). The file is locked while the VM runs: a second ferry cannot write it. A VM
    /// arriving by migration opens the same path (shared storage) and takes the lock when it
    /// first runs, after the source let go of it.
    #[arg(long = "disk", value_name = "path=FILE[,readonly]")]
    pub disks: Vec<DiskConfig>,
    /// A virtio-net NIC on an existing tap device: tap=NAME[,mac=MAC] (repeat for more). A VM
    /// arriving by migration is given its destination's tap; it keeps its MAC and announces
    /// it there (RARP) so that the network learns where it went.
    #[arg(long = "net", value_name = "tap=NAME[,mac=MAC]")]
    pub nets: Vec<NetConfig>,
    /// A virtio-balloon: the guest gives memory back (inflating to the target `ferry
    /// balloon` sets, and on its own), reports the pages it frees and its memory statistics;
    /// pages given back never cross the wire in a migration. Options: size=SIZE (the target
    /// at boot, default 0), deflate_on_oom=on|off, free_page_reporting=on|off (both on),
    /// stats_s=N (how often fresh statistics are asked for, default 1; 0: once). A VM
    /// arriving by migration is given --balloon too.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "")]
    pub balloon: Option<BalloonConfig>,
    /// Where the guest's serial console goes: a file path, or "stdout".
    #[arg(long, default_value = "stdout")]
    pub serial: String,
    /// Serve the control API on this Unix socket.
    #[arg(long)]
    pub api_socket: Option<PathBuf>,
    /// Serve OpenMetrics (Prometheus) figures of the VM and its migrations at GET /metrics
    /// on tcp:HOST:PORT (or HOST:PORT) or unix:PATH (see docs/metrics.md).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<crate::metrics::MetricsAddr>,
    /// Answer a scrape only with `Authorization: Bearer TOKEN`, TOKEN the one word in FILE
    /// (mode 0600; Prometheus's `authorization: credentials_file` sends it).
    #[arg(long, value_name = "FILE", requires = "metrics")]
    pub metrics_token_file: Option<PathBuf>,
    /// Wait for one incoming migration (tcp:HOST:PORT or unix:PATH) instead of booting.
    #[arg(long, conflicts_with_all = ["guest", "kernel", "cmdline", "restore"])]
    pub incoming: Option<String>,
    /// Bring back a VM from a snapshot file instead of booting.
    #[arg(long, conflicts_with_all = ["guest", "kernel", "cmdline"])]
    pub restore: Option<PathBuf>,
    /// This host's certificate (PEM) for TLS migrations; with --tls-key and --tls-ca, every
    /// TCP migration to or from this VM is TLS 1.3 with both hosts' certificates checked.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) whose certificates the other host must present.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// Allow TCP migrations without TLS: anyone on the path reads the guest's memory, and
    /// anyone who reaches the port can send a VM. For trusted, isolated networks only.
    #[arg(long, conflicts_with = "tls_cert")]
    pub plain_tcp: bool,
    /// The sandbox (docs/security.md): seccomp filters (vCPU and device threads may ask the
    /// kernel only for what they need, no thread may run a program, mount, trace or load a
    /// module) and Landlock (the process reaches only the files its command line names).
    /// `off` for debugging only.
    #[arg(long, value_enum, default_value = "on")]
    pub sandbox: Sandbox,
    /// A host path the sandbox lets this ferry reach besides those its command line names:
    /// path=PATH,access=r|rw (Cloud Hypervisor's spelling; repeat for more).
    #[arg(long = "landlock-rules", value_name = "path=PATH,access=r|rw")]
    pub landlock_rules: Vec<vmm::landlock::Rule>,
    /// Become this user (and group: the user's own unless given) once the VM runs — booted,
    /// or arrived with every page — giving up root and every capability: USER[:GROUP], names
    /// or numbers. Snapshots then need a --snapshot-dir the user may write.
    #[arg(long, value_name = "USER[:GROUP]")]
    pub user: Option<vmm::privileges::RunAs>,
    /// Serve the test and benchmark hooks (vm.debug-corrupt-page, vm.debug-dirty-logging);
    /// without it they answer 403.
    #[arg(long)]
    pub enable_debug_api: bool,
    /// Where vm.snapshot may write: snapshots are new files (never an existing one) of mode
    /// 0600 in this directory; without it, snapshots are refused.
    #[arg(long)]
    pub snapshot_dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Where to write ca.pem, ca.key and NAME.pem/NAME.key for each --name.
    #[arg(long)]
    pub out: PathBuf,
    /// A host name or IP address to issue a certificate for (repeat for each host).
    #[arg(long = "name", required = true)]
    pub names: Vec<String>,
}

/// `--sandbox`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Sandbox {
    On,
    Off,
}
