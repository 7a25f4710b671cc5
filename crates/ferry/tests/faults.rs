//! The fault matrix: for each migration mode, a fault injected at each point of the
//! conversation (by a relay that reads the framing, so it lands at the same protocol point
//! every run), then a look at both hosts. A VM must never run on both; it may be lost only
//! where the fault killed the host that held its only usable copy; the copy that runs must
//! verify its memory with zero errors, and the two sides' memory checksums at the switch must
//! agree. Post-copy cut mid-way is carried on (recovery) first. Operators' requests (cancel,
//! stop by API or SIGTERM, to either side) at each point must get the lifecycle's answer, and
//! strangers on the destination's migration port must not make a migration fail.
//!
//! `make test` runs the short form (one case of each fault); `FERRY_FAULTS=full` runs every
//! case (`make faults`) and writes the table to `target/faults.md` (the table in
//! docs/faults.md comes from there). `FERRY_FAULTS_ONLY` picks cases from every case; one that
//! picks none fails.

#[path = "faults/checksums.rs"]
mod checksums;
mod common;
#[path = "faults/requests.rs"]
mod requests;
#[path = "faults/sides.rs"]
mod sides;
#[path = "faults/strangers.rs"]
mod strangers;

use std::time::{Duration, Instant};

use api::{MigrationPhase, MigrationStatus};
use checksums::Checksums;
use common::relay::{Action, Point, Relay};
use common::*;
use requests::{Answer, Heard, How, Moment, Request, Side};
use sides::{Holds, holds, kill};
use strangers::Strangers;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    KillSource,
    KillDestination,
    Cut,
    /// A cut after which the link comes back at once: a pre-copy carries on over a new
    /// connection (the other faults' migrations are told not to: `--resume-window-s 0`).
    Blip,
    Stall,
    Corrupt,
    Cancel,
    /// A stop request to one side: `vm.shutdown`, or SIGTERM.
    Stop(Side, How),
    /// Idle connections and byte-tricklers on the destination's migration port.
    Strangers,
}

/// Tried at every point of every mode.
const FAULTS: [Fault; 6] = [
    Fault::KillSource,
    Fault::KillDestination,
    Fault::Cut,
    Fault::Stall,
    Fault::Corrupt,
    Fault::Cancel,
];

/// Tried at every point of `STOP_MODES`: pre-copy's and post-copy's points are every point
/// of a departure and of an arrival; go-with-state's `Go` comes early.
const STOPS: [Fault; 4] = [
    Fault::Stop(Side::Source, How::Api),
    Fault::Stop(Side::Source, How::Signal),
    Fault::Stop(Side::Destination, How::Api),
    Fault::Stop(Side::Destination, How::Signal),
];
const STOP_MODES: [&str; 3] = ["precopy", GO_WITH_STATE, "postcopy"];

/// Tried at every point of the modes whose rounds can be carried on after a broken link.
const BLIP_MODES: [&str; 4] = ["precopy", GO_WITH_STATE, "hybrid", COPY_STORAGE];

/// Strangers come at these points of these modes: before the source (setup: first in the
/// listener's queue, where two connections' extra one must still get in), during the rounds,
/// at the switch, and during post-copy.
const STRANGER_MODES: [&str; 3] = ["precopy", TWO_CONNECTIONS, "postcopy"];
const STRANGER_POINTS: [Point; 4] = [Point::Setup, Point::Round0, Point::Go, Point::Postcopy(50)];

const STALL: Duration = Duration::from_secs(10);

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::KillSource => "kill -9 source",
            Fault::KillDestination => "kill -9 destination",
            Fault::Cut => "link cut",
            Fault::Blip => "link blip",
            Fault::Stall => "link stall 10 s",
            Fault::Corrupt => "corrupted byte",
            Fault::Strangers => "strangers",
            Fault::Cancel | Fault::Stop(..) => self.request().map_or("", Request::name),
        }
    }

    fn action(self) -> Action {
        match self {
            Fault::Cut => Action::Cut,
            Fault::Blip => Action::Blip,
            Fault::Stall => Action::Stall(STALL),
            Fault::Corrupt => Action::Corrupt,
            _ => Action::Hold,
        }
    }

    /// The operator's request this fault is, if it is one.
    fn request(self) -> Option<Request> {
        match self {
            Fault::Cancel => Some(Request::Cancel),
            Fault::Stop(side, how) => Some(Request::Stop(side, how)),
            _ => None,
        }
    }

    /// The faults tried at `point` of `mode`.
    fn at(mode: &str, point: Point) -> Vec<Fault> {
        let mut faults = FAULTS.to_vec();
        if STOP_MODES.contains(&mode) {
            faults.extend(STOPS);
        }
        if BLIP_MODES.contains(&mode) {
            faults.push(Fault::Blip);
        }
        if STRANGER_MODES.contains(&mode) && STRANGER_POINTS.contains(&point) {
            faults.push(Fault::Strangers);
        }
        faults
    }
}

/// Where the VM is once things settle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// It runs on the source; the destination has none.
    Source,
    /// It runs on the destination; the source let go (or holds a paused copy it refuses to run).
    Destination,
    /// Post-copy was cut after the switch and carried on over a new connection.
    Recovered,
    /// The source held it paused after the switch (it cannot know whether the destination
    /// runs it); the operator, knowing the destination is down, took it back
    /// (`vm.migrate-reclaim`), as of the switch.
    Reclaimed,
    /// The destination died during a post-copy with checkpoints: the operator ran the VM on
    /// the source from the newest one (`vm.migrate-rollback`).
    RolledBack,
    /// As `Reclaimed`, but taking it back failed.
    Held,
    /// No usable copy is left: the fault killed the host that held the only one.
    Lost,
    /// A stop request stopped the VM where it ran (the source before its switch-over, or the
    /// destination once it had said the VM runs there): no copy runs, as asked.
    Stopped,
    /// A side's API did not say what it holds, or the sides never settled: never allowed.
    Unknown,
    /// Both run: never allowed.
    Twice,
}

fn modes() -> Vec<(&'static str, Vec<Point>)> {
    use Point::*;
    let postcopy = [Go, Postcopy(10), Postcopy(50), Postcopy(90), Completion];
    vec![
        (
            "precopy",
            vec![Setup, Round0, RoundK, Pause, State, Go, Completion],
        ),
        // Pre-copy with `--go-with-state`: `Go` follows the state without waiting for
        // `Loaded`, so the source gives the VM up at the end of the state.
        (
            GO_WITH_STATE,
            vec![Setup, Round0, RoundK, Pause, State, Go, Completion],
        ),
        // Pre-copy over two connections: the faults land on the main one, and cuts and
        // stalls take the extra one with it.
        (
            TWO_CONNECTIONS,
            vec![Setup, Round0, RoundK, Pause, State, Go, Completion],
        ),
        // Pre-copy whose disk moves with it (`--copy-storage`): the guest stamps its disk
        // throughout, and the running copy must read every sector back right.
        (
            COPY_STORAGE,
            vec![Setup, Round0, Disk, RoundK, Pause, State, Go, Completion],
        ),
        ("warm", vec![Setup, Round0, State, Go, Completion]),
        ("postcopy", [&[Setup, Pause, State][..], &postcopy].concat()),
        // Post-copy over two connections: the extra one pushes, the main one answers the
        // faults; a point after `Go` counts the pages on both (the fault lands on whichever
        // carries the page that reaches it), and cuts and stalls take both.
        (
            POSTCOPY_LANES,
            [&[Setup, Pause, State][..], &postcopy].concat(),
        ),
        (
            "hybrid",
            [&[Setup, Round0, Pause, State][..], &postcopy].concat(),
        ),
    ]
}

/// The matrix's name for `--mode precopy --go-with-state`.
const GO_WITH_STATE: &str = "precopy go-with-state";

/// The matrix's name for `--mode precopy --connections 2`.
const TWO_CONNECTIONS: &str = "precopy 2 connections";

/// The matrix's name for `--mode precopy --copy-storage`.
const COPY_STORAGE: &str = "precopy copy-storage";

/// The matrix's name for `--mode postcopy --connections 2`.
const POSTCOPY_LANES: &str = "postcopy 2 connections";

/// Whether the VM's pages follow it after the switch in `mode`.
fn is_postcopy(mode: &str) -> bool {
    matches!(mode, "postcopy" | "hybrid" | POSTCOPY_LANES)
}

/// `ferry migrate` arguments for a mode of the matrix.
fn mode_args(mode: &str) -> Vec<&str> {
    match mode {
        GO_WITH_STATE => vec!["--mode", "precopy", "--go-with-state"],
        TWO_CONNECTIONS => vec!["--mode", "precopy", "--connections", "2"],
        COPY_STORAGE => vec!["--mode", "precopy", "--copy-storage"],
        POSTCOPY_LANES => vec!["--mode", "postcopy", "--connections", "2"],
        m => vec!["--mode", m],
    }
}

/// Where the switch stands when the frame at `point` is held.
fn moment(mode: &str, point: Point) -> Moment {
    match point {
        Point::Setup
        | Point::Round0
        | Point::Round0Share(_)
        | Point::RoundK
        | Point::Disk
        | Point::DiskFrame(_) => Moment::Live,
        Point::Pause | Point::State if mode == GO_WITH_STATE => Moment::AroundGo,
        Point::Pause | Point::State => Moment::Paused,
        Point::Go => Moment::GoHeld,
        Point::Postcopy(_) => Moment::Runs,
        Point::Completion => Moment::Said,
    }
}

/// What the design promises for a fault at a point.
fn promised(mode: &str, point: Point, fault: Fault) -> &'static [Outcome] {
    use Outcome::*;
    let postcopy = is_postcopy(mode);
    // A blip while rounds run is carried on; anywhere else it is a cut.
    let fault = match (point, fault) {
        (
            Point::Round0
            | Point::Round0Share(_)
            | Point::RoundK
            | Point::Disk
            | Point::DiskFrame(_),
            Fault::Blip,
        ) => {
            return &[Destination];
        }
        (_, Fault::Blip) => Fault::Cut,
        (_, f) => f,
    };
    match (point, fault) {
        // Strangers change nothing.
        (_, Fault::Strangers) => &[Destination],
        (_, Fault::Stop(side, _)) => promised_of_stop(moment(mode, point), side),
        // With `--go-with-state`, `Go` may already be written behind the frame that is held:
        // the state, or at the pause the first frame after the rounds (the source writes on
        // into the socket buffers while the relay holds it; seen at 571b1f6, a cancel there
        // refused). A dead source's `Go` may still arrive, or not; with the destination gone
        // or the link cut the source cannot know whether it runs the VM (unconfirmed: the
        // operator takes it back); a destination that cannot load what it got says so (the
        // source runs on); a cancel before `Go` was written keeps the VM, one after it is
        // refused.
        (Point::Pause | Point::State, f) if mode == GO_WITH_STATE && f != Fault::Stall => match f {
            Fault::KillSource => &[Lost, Destination],
            Fault::KillDestination | Fault::Cut => &[Source, Reclaimed],
            Fault::Corrupt => &[Source],
            _ => &[Source, Destination],
        },
        // The destination gives a new connection 10 s to open a migration: a 10 s stall of the
        // `Hello` may end just after that, and the source runs on.
        (Point::Setup, Fault::Stall) => &[Destination, Source],
        (_, Fault::Stall) => &[Destination],
        // Before the source gives the VM up, it stays there; killing it kills the VM.
        (
            Point::Setup
            | Point::Round0
            | Point::Round0Share(_)
            | Point::RoundK
            | Point::Disk
            | Point::DiskFrame(_)
            | Point::Pause
            | Point::State,
            f,
        ) => {
            match f {
                Fault::KillSource => &[Lost],
                // A page corrupted while the guest runs is caught by its CRC; a later copy
                // (the writer rewrites its pages) mends it, or the destination refuses the
                // migration. `--checksum` proves memory equal at the switch either way.
                Fault::Corrupt
                    if matches!(point, Point::Round0 | Point::Round0Share(_) | Point::RoundK) =>
                {
                    &[Source, Destination]
                }
                _ => &[Source],
            }
        }
        // `Go` in flight: a dead source's `Go` still arrives. In post-copy the destination then
        // needs pages from the dead source.
        (Point::Go, Fault::KillSource) if postcopy => &[Lost],
        (Point::Go, Fault::KillSource) => &[Destination],
        // `Go` never arrived: the source holds the VM, and the operator takes it back.
        (Point::Go, Fault::KillDestination | Fault::Cut | Fault::Blip) => &[Reclaimed],
        // A destination that refuses a corrupt `Go` says so: the source may run on.
        (Point::Go, Fault::Corrupt) => &[Source, Reclaimed],
        (Point::Go, Fault::Cancel) => &[Destination],
        // Pages still on a dead source are gone; a dead destination's VM runs on the source
        // from its last checkpoint (post-copy sends one back every 20 ms here), or from the
        // switch if none had come yet.
        (Point::Postcopy(_), Fault::KillSource) => &[Lost],
        (Point::Postcopy(_), Fault::KillDestination) => &[RolledBack, Reclaimed],
        (Point::Postcopy(_), Fault::Cut | Fault::Blip | Fault::Corrupt) => &[Recovered],
        (Point::Postcopy(_), Fault::Cancel) => &[Destination],
        // The destination ran the VM, said so, and died. Its last word on its way lets the
        // source go: the move was complete, and the host that then died held the only copy.
        // A dying host's reset may discard that word in flight: then the source still holds
        // the VM (post-copy: its pages, and the checkpoints) and the operator takes it back.
        (Point::Completion, Fault::KillDestination) if postcopy => &[Lost, RolledBack],
        (Point::Completion, Fault::KillDestination) => &[Lost, Reclaimed],
        (Point::Completion, _) => &[Destination],
    }
}

/// A stop asked of the destination before it runs the VM ends the arrival, and the source,
/// told, runs on; while post-copy pages arrive it is refused or dropped; once the destination
/// has said the VM runs there, the stop is the VM's own: taken (Stopped) or refused. A stop
/// asked of the source while the VM runs there stops it, as asked; from its switch-over on it
/// is refused or deferred until the switch resolves.
fn promised_of_stop(at: Moment, side: Side) -> &'static [Outcome] {
    use Outcome::*;
    match (side, at) {
        (Side::Destination, Moment::Said) => &[Destination, Stopped],
        (Side::Destination, Moment::Runs) => &[Destination],
        (Side::Destination, _) => &[Source],
        (Side::Source, Moment::Live) => &[Stopped],
        (Side::Source, _) => &[Destination],
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Case {
    mode: &'static str,
    point: Point,
    fault: Fault,
}

impl Case {
    /// `mode/point/fault`: what `FERRY_FAULTS_ONLY` matches.
    fn row(&self) -> String {
        format!("{}/{}/{}", self.mode, self.point.name(), self.fault.name())
    }
}

struct Result {
    outcome: Outcome,
    /// The running copy's verify errors (memory, and disk sectors where it has a disk) after
    /// one more pass (0 when none runs); `None` when no pass ended.
    verify_errors: Option<u64>,
    checksums: Checksums,
    /// What the operator's request got, for a fault that is one.
    answer: Option<Answer>,
    reached: bool,
    /// Both sides' state and migration phase once settled (recovered), before the look.
    sides: String,
    secs: f64,
}

/// The source's disk and the destination's own, for a mode that moves the disk.
struct Disks {
    _dir: tempfile::TempDir,
    source: String,
    target: String,
}

impl Disks {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let make = |name: &str| {
            let path = dir.path().join(name);
            std::fs::File::create(&path)
                .and_then(|f| f.set_len(8 << 20))
                .unwrap();
            format!("path={}", path.display())
        };
        let (source, target) = (make("source.img"), make("target.img"));
        Disks {
            _dir: dir,
            source,
            target,
        }
    }
}

/// The source (a writer, with a disk it stamps when `disks`) and the destination, listening
/// on `port` (with its own disk).
fn sides_of_case(disks: Option<&Disks>, port: u16) -> (Ferry, Ferry) {
    let url = format!("tcp:127.0.0.1:{port}");
    let Some(disks) = disks else {
        let src = Ferry::boot(VmSpec {
            memory: "256M",
            cmdline: "write ws=32M seq verify",
            ..Default::default()
        });
        src.wait_info("a first pass", Duration::from_secs(60), |i| i.passes >= 1);
        return (src, Ferry::incoming(&url));
    };
    let cmdline = format!(
        "write ws=32M seq verify blk blk_sectors={}",
        sides::DISK_SECTORS
    );
    let src = Ferry::disk_writer(&cmdline, &disks.source, sides::DISK_SECTORS);
    src.wait_info("a first pass", Duration::from_secs(60), |i| i.passes >= 1);
    let dst = Ferry::start(&["--incoming", &url, "--disk", &disks.target]);
    (src, dst)
}

fn run_case(c: &Case) -> Result {
    let started = Instant::now();
    let disks = (c.mode == COPY_STORAGE).then(Disks::new);
    let port = free_port();
    let (mut src, mut dst) = sides_of_case(disks.as_ref(), port);
    let relay = Relay::start(&format!("127.0.0.1:{port}"), c.point, c.fault.action());
    // At setup the strangers come first, queued before the source's connection.
    let early = c.fault == Fault::Strangers && c.point == Point::Setup;
    let mut strangers = early.then(|| Strangers::start(port));
    let migrating = start_migration(&src, &relay.url, c.mode, c.fault);
    let reached = relay.wait_reached(Duration::from_secs(60));
    let heard = reached
        .then(|| inject(c.fault, &mut src, &mut dst))
        .flatten();
    if reached && c.fault == Fault::Strangers && strangers.is_none() {
        strangers = Some(Strangers::start(port));
    }
    relay.release();
    // The report, unless `ferry migrate` died with its source or ran past its 30 s.
    let report = migrating
        .join()
        .ok()
        .and_then(|out| serde_json::from_slice::<MigrationStatus>(&out.stdout).ok());
    drop(relay);
    drop(strangers);

    // Both sides settle first: a destination may hear of a cut after its source did.
    let mut settled = sides::settle(&mut src, &mut dst);
    let recovered = settled && recover_if_cut(&mut src, &mut dst);
    if recovered {
        settled = sides::settle(&mut src, &mut dst);
    }
    // For the log of a case that goes wrong.
    let seen = format!(
        "source {}; destination {}",
        sides::describe(&mut src),
        sides::describe(&mut dst)
    );
    if std::env::var("FERRY_FAULTS_DEBUG").is_ok() {
        eprintln!(
            "SRC STDERR:\n{}\nDST STDERR:\n{}",
            src.stderr_text(),
            dst.stderr_text()
        );
    }
    let outcome = if settled {
        outcome(c.fault, &mut src, &mut dst, recovered)
    } else {
        Outcome::Unknown
    };
    let verify_errors = runner(outcome, &src, &dst).map_or(Some(0), sides::one_more_pass);
    let statuses = [report, status(&src), status(&dst)];
    let answer = heard.map(|heard| {
        let expect = c.fault.request().unwrap().expect(moment(c.mode, c.point));
        let target = side(c.fault.request().unwrap().side(), &mut src, &mut dst);
        Answer {
            heard,
            exited: requests::exited(target, &expect),
        }
    });
    Result {
        outcome,
        verify_errors,
        checksums: checksums::compare(&statuses.into_iter().flatten().collect::<Vec<_>>()),
        answer,
        reached,
        sides: seen,
        secs: started.elapsed().as_secs_f64(),
    }
}

/// `ferry migrate` of `src` to `url` in `mode`, on a thread; its output once it ends.
fn start_migration(
    src: &Ferry,
    url: &str,
    mode: &'static str,
    fault: Fault,
) -> std::thread::JoinHandle<std::process::Output> {
    let socket = src.socket.to_str().unwrap().to_string();
    let url = url.to_string();
    std::thread::spawn(move || {
        let mut args = vec!["migrate", "--api-socket", &socket, "--to", &url, "--json"];
        args.extend(mode_args(mode));
        // Only a blip's link comes back: the others' migrations fail as they break.
        if fault != Fault::Blip {
            args.extend(["--resume-window-s", "0"]);
        }
        args.extend([
            "--max-downtime-ms",
            "1",
            "--max-rounds",
            "4",
            // With a 1 Gbit/s cap, a 1 ms budget and pages plain and whole (compressed or
            // as deltas, the writer's stamped pages converge sooner) a writer's pre-copy runs
            // all 4 rounds, so every point of the conversation comes, whatever this machine's
            // speed.
            "--max-bandwidth-mbps",
            "1000",
            "--compression",
            "none",
            "--delta-cache-mb",
            "0",
            // Both sides checksum memory at the switch: a corrupt page cannot pass unseen.
            "--checksum",
        ]);
        if is_postcopy(mode) {
            // Post-copy sends the VM back every 20 ms: a dead destination costs less.
            args.extend(["--checkpoint-ms", "20"]);
        }
        ferry_output(&args)
    })
}

/// The fault, while the frame is held; what the side asked said, for a request.
fn inject(fault: Fault, src: &mut Ferry, dst: &mut Ferry) -> Option<Heard> {
    match fault {
        Fault::KillSource => kill(src),
        Fault::KillDestination => kill(dst),
        _ => {}
    }
    let request = fault.request()?;
    Some(request.make(side(request.side(), src, dst)))
}

fn side<'a>(side: Side, src: &'a mut Ferry, dst: &'a mut Ferry) -> &'a mut Ferry {
    match side {
        Side::Source => src,
        Side::Destination => dst,
    }
}

/// A side's migration status, if it is there to ask.
fn status(f: &Ferry) -> Option<MigrationStatus> {
    serde_json::from_value(f.api().get("vm.migration").ok()?).ok()
}

/// Post-copy cut after the switch: carried on over a new connection; whether it was.
fn recover_if_cut(src: &mut Ferry, dst: &mut Ferry) -> bool {
    let cut = holds(src) == Holds::Paused(MigrationPhase::PostcopyPaused)
        && holds(dst) == Holds::Stranded;
    cut && recover(src, dst)
}

/// `vm.migrate-resume` on both sides; true once the destination has every page.
fn recover(src: &Ferry, dst: &Ferry) -> bool {
    carry_on_postcopy(src, dst).is_ok()
        && wait_for("the resumed post-copy", Duration::from_secs(60), || {
            let p = dst.migration_status().phase;
            (p != MigrationPhase::PostcopyActive && p != MigrationPhase::PostcopyPaused)
                .then_some(p == MigrationPhase::Completed)
        })
}

/// Where the VM is once both sides have settled.
fn outcome(fault: Fault, src: &mut Ferry, dst: &mut Ferry, recovered: bool) -> Outcome {
    match (holds(src), holds(dst)) {
        (Holds::Unknown, _) | (_, Holds::Unknown) => Outcome::Unknown,
        (Holds::Runs, Holds::Runs | Holds::Stranded) => Outcome::Twice,
        (Holds::Runs, _) => Outcome::Source,
        (_, Holds::Runs) if recovered => Outcome::Recovered,
        (_, Holds::Runs) => Outcome::Destination,
        // The destination is gone: as its operator, take the VM back.
        (Holds::Paused(phase), Holds::Nothing) => take_back(src, phase),
        (Holds::Nothing, Holds::Nothing) if matches!(fault, Fault::Stop(..)) => Outcome::Stopped,
        _ => Outcome::Lost,
    }
}

/// `vm.migrate-rollback` mid post-copy (from its last checkpoint), `vm.migrate-reclaim`
/// otherwise (from the switch).
fn take_back(src: &mut Ferry, phase: MigrationPhase) -> Outcome {
    let call = if phase == MigrationPhase::PostcopyPaused {
        "migrate-rollback"
    } else {
        "migrate-reclaim"
    };
    let out = ferry_output(&[call, "--api-socket", src.socket.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&out.stdout);
    match (
        out.status.success() && holds(src) == Holds::Runs,
        said.contains("from post-copy checkpoint"),
    ) {
        (true, true) => Outcome::RolledBack,
        (true, false) => Outcome::Reclaimed,
        (false, _) => Outcome::Held,
    }
}

/// The side whose copy runs after `outcome`.
fn runner<'a>(outcome: Outcome, src: &'a Ferry, dst: &'a Ferry) -> Option<&'a Ferry> {
    match outcome {
        Outcome::Source | Outcome::Reclaimed | Outcome::RolledBack => Some(src),
        Outcome::Destination | Outcome::Recovered => Some(dst),
        _ => None,
    }
}

/// What is wrong with a case's result; empty when it is as promised.
fn problems(c: &Case, r: &Result) -> Vec<String> {
    let mut found = Vec::new();
    if !r.reached {
        found.push("NOT REACHED".to_string());
    }
    let promise = promised(c.mode, c.point, c.fault);
    if !promise.contains(&r.outcome) {
        found.push(format!("promised {promise:?}"));
    }
    match r.verify_errors {
        Some(0) => {}
        Some(n) => found.push(format!("{n} verify errors")),
        None => found.push("no pass ended on the running copy".into()),
    }
    match (r.checksums, r.outcome) {
        (Checksums::Differ, _) => found.push("memory checksums differ".into()),
        (Checksums::Missing, Outcome::Destination | Outcome::Recovered) => {
            found.push("the moved VM's checksums were never compared".into())
        }
        _ => {}
    }
    if let (Some(request), Some(answer)) = (c.fault.request(), r.answer) {
        found.extend(request.expect(moment(c.mode, c.point)).problem(answer));
    }
    found
}

fn all_cases() -> Vec<Case> {
    modes()
        .into_iter()
        .flat_map(|(mode, points)| {
            points.into_iter().flat_map(move |point| {
                Fault::at(mode, point)
                    .into_iter()
                    .map(move |fault| Case { mode, point, fault })
            })
        })
        .collect()
}

/// One case of each host and link fault (two of killing the destination: before the switch,
/// and during post-copy, where the operator takes the VM back), spread over the modes and
/// points, two stop requests: a SIGTERM the source must defer (at `Go`), and a stop that
/// ends an arrival (at the state); strangers at the door of a two-connection migration; and
/// a move that copies its disk, its destination killed as the disk crosses and its link cut
/// at the pause and at `Go` (taken back without `force`: the disk there was its own).
const SHORT: [(&str, Point, Fault); 20] = [
    ("precopy", Point::Go, Fault::Stop(Side::Source, How::Signal)),
    (TWO_CONNECTIONS, Point::Setup, Fault::Strangers),
    (
        "postcopy",
        Point::State,
        Fault::Stop(Side::Destination, How::Api),
    ),
    ("precopy", Point::RoundK, Fault::KillDestination),
    ("precopy", Point::Go, Fault::Cut),
    ("warm", Point::State, Fault::Corrupt),
    (GO_WITH_STATE, Point::State, Fault::KillDestination),
    (TWO_CONNECTIONS, Point::RoundK, Fault::Cut),
    ("hybrid", Point::Pause, Fault::Cancel),
    ("postcopy", Point::Postcopy(50), Fault::Cut),
    ("postcopy", Point::Postcopy(10), Fault::KillSource),
    ("hybrid", Point::Postcopy(50), Fault::KillDestination),
    ("hybrid", Point::Postcopy(90), Fault::Stall),
    ("precopy", Point::RoundK, Fault::Blip),
    (COPY_STORAGE, Point::Disk, Fault::KillDestination),
    (COPY_STORAGE, Point::Pause, Fault::Cut),
    (COPY_STORAGE, Point::Go, Fault::Cut),
    (POSTCOPY_LANES, Point::Postcopy(50), Fault::Corrupt),
    (POSTCOPY_LANES, Point::Postcopy(90), Fault::Cut),
    // Lost to a reply the source could not write before 9a2ed35 (2 runs in 9).
    (
        "postcopy",
        Point::Completion,
        Fault::Stop(Side::Destination, How::Api),
    ),
];

fn short_cases() -> Vec<Case> {
    let short: Vec<Case> = all_cases()
        .into_iter()
        .filter(|c| SHORT.contains(&(c.mode, c.point, c.fault)))
        .collect();
    assert_eq!(
        short.len(),
        SHORT.len(),
        "a short case is not in the matrix"
    );
    short
}

/// The cases to run: the short list, or every case when `full`. A filter (`FERRY_FAULTS_ONLY`,
/// `/`-separated parts of `mode/point/fault`) picks from every case; one that picks none is
/// an error naming it.
fn select(full: bool, only: Option<&str>) -> std::result::Result<Vec<Case>, String> {
    let Some(only) = only else {
        return Ok(if full { all_cases() } else { short_cases() });
    };
    let picked: Vec<Case> = all_cases()
        .into_iter()
        .filter(|c| only.split('/').all(|part| c.row().contains(part)))
        .collect();
    if picked.is_empty() {
        return Err(format!(
            "FERRY_FAULTS_ONLY={only:?} picks no case of the matrix (a row reads \
             mode/point/fault, e.g. \"precopy/go/link cut\")"
        ));
    }
    Ok(picked)
}

/// A row of the table, and what is wrong with it.
fn row(c: &Case, r: &Result) -> (String, Vec<String>) {
    let wrong = problems(c, r);
    let verdict = if wrong.is_empty() {
        "yes".to_string()
    } else {
        format!("NO ({})", wrong.join("; "))
    };
    let line = format!(
        "| {} | {} | {} | {:?} | {} | {} | {} | {verdict} | {:.1} |",
        c.mode,
        c.point.name(),
        c.fault.name(),
        r.outcome,
        r.verify_errors.map_or("-".into(), |n| n.to_string()),
        r.checksums.name(),
        r.answer.map_or("-".into(), Answer::name),
        r.secs
    );
    (line, wrong)
}

fn table(rows: &[(String, Outcome)]) -> String {
    let count = |o: Outcome| rows.iter().filter(|(_, x)| *x == o).count();
    let mut table = String::from(
        "| mode | point | fault | outcome | verify errors | checksums | answer | as promised | s |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for (line, _) in rows {
        table.push_str(line);
        table.push('\n');
    }
    table.push_str(&format!(
        "\n{} faults injected: {} source, {} destination, {} recovered, {} rolled back, {} reclaimed, \
         {} held, {} stopped, {} lost, {} unknown, {} twice.\n",
        rows.len(),
        count(Outcome::Source),
        count(Outcome::Destination),
        count(Outcome::Recovered),
        count(Outcome::RolledBack),
        count(Outcome::Reclaimed),
        count(Outcome::Held),
        count(Outcome::Stopped),
        count(Outcome::Lost),
        count(Outcome::Unknown),
        count(Outcome::Twice),
    ));
    table
}

#[test]
fn fault_matrix() {
    let full = std::env::var("FERRY_FAULTS").is_ok_and(|v| v == "full");
    let only = std::env::var("FERRY_FAULTS_ONLY").ok();
    let cases = select(full, only.as_deref()).unwrap_or_else(|e| panic!("{e}"));
    if !kvm_available() {
        return;
    }
    let mut rows = Vec::new();
    let mut broken = Vec::new();
    for c in &cases {
        let r = run_case(c);
        let (line, wrong) = row(c, &r);
        eprintln!("{line}");
        if !wrong.is_empty() {
            eprintln!("  {}: {}", c.row(), r.sides);
            broken.push(line.clone());
        }
        rows.push((line, r.outcome));
    }
    let table = table(&rows);
    let name = match (full, &only) {
        (_, Some(_)) => "faults-only.md",
        (true, None) => "faults.md",
        (false, None) => "faults-short.md",
    };
    let _ = std::fs::write(repo_root().join("target").join(name), &table);
    eprintln!("{table}");
    assert!(
        rows.iter().all(|(_, o)| *o != Outcome::Twice),
        "a VM ran twice:\n{table}"
    );
    assert!(
        broken.is_empty(),
        "faults with other outcomes than promised:\n{}",
        broken.join("\n")
    );
}

#[test]
fn a_filter_picks_from_every_case_and_one_that_picks_none_fails() {
    let stops = select(false, Some("stop destination (SIGTERM)")).unwrap();
    assert_eq!(stops.len(), 22, "every point of 3 modes");
    assert!(
        stops
            .iter()
            .all(|c| !SHORT.contains(&(c.mode, c.point, c.fault)))
    );
    let e = select(false, Some("precopy/no such fault")).unwrap_err();
    assert!(e.contains("precopy/no such fault"), "{e}");
    assert_eq!(select(false, None).unwrap().len(), SHORT.len());
    assert_eq!(select(true, None).unwrap().len(), all_cases().len());
}

#[test]
fn stop_requests_come_at_every_point_of_a_departure_and_an_arrival() {
    use Point::*;
    let every = [Setup, Round0, RoundK, Pause, State, Go, Completion];
    let postcopy = [Postcopy(10), Postcopy(50), Postcopy(90)];
    for fault in STOPS {
        let points: Vec<Point> = all_cases()
            .iter()
            .filter(|c| c.fault == fault)
            .map(|c| c.point)
            .collect();
        for p in every.iter().chain(&postcopy) {
            assert!(points.contains(p), "{} never at {}", fault.name(), p.name());
        }
    }
}
