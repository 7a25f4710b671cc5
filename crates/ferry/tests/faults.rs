//! The fault matrix: for each migration mode, a fault injected at each point of the
//! conversation (by a relay that reads the framing, so it lands at the same protocol point
//! every run), then a look at both hosts. A VM must never run on both; it may be lost only
//! where the fault killed the host that held its only usable copy; the copy that runs must
//! verify its memory with zero errors. Post-copy cut mid-way is carried on (recovery) first.
//!
//! `make test` runs the short form (one case of each fault); `FERRY_FAULTS=full` runs every
//! case (258 faults, about 14 minutes here; `make faults`) and writes the table to
//! `target/faults.md` (the table in docs/faults.md comes from there).

mod common;

use std::time::{Duration, Instant};

use api::MigrationPhase;
use common::relay::{Action, Point, Relay};
use common::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    KillSource,
    KillDestination,
    Cut,
    Stall,
    Corrupt,
    Cancel,
}

const FAULTS: [Fault; 6] = [
    Fault::KillSource,
    Fault::KillDestination,
    Fault::Cut,
    Fault::Stall,
    Fault::Corrupt,
    Fault::Cancel,
];

const STALL: Duration = Duration::from_secs(10);

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::KillSource => "kill -9 source",
            Fault::KillDestination => "kill -9 destination",
            Fault::Cut => "link cut",
            Fault::Stall => "link stall 10 s",
            Fault::Corrupt => "corrupted byte",
            Fault::Cancel => "API cancel",
        }
    }

    fn action(self) -> Action {
        match self {
            Fault::Cut => Action::Cut,
            Fault::Stall => Action::Stall(STALL),
            Fault::Corrupt => Action::Corrupt,
            Fault::KillSource | Fault::KillDestination | Fault::Cancel => Action::Hold,
        }
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
        ("warm", vec![Setup, Round0, State, Go, Completion]),
        ("postcopy", [&[Setup, Pause, State][..], &postcopy].concat()),
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

/// `ferry migrate` arguments for a mode of the matrix.
fn mode_args(mode: &str) -> Vec<&str> {
    match mode {
        GO_WITH_STATE => vec!["--mode", "precopy", "--go-with-state"],
        TWO_CONNECTIONS => vec!["--mode", "precopy", "--connections", "2"],
        m => vec!["--mode", m],
    }
}

/// What the design promises for a fault at a point.
fn promised(mode: &str, point: Point, fault: Fault) -> &'static [Outcome] {
    use Outcome::*;
    let postcopy = matches!(mode, "postcopy" | "hybrid");
    match (point, fault) {
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
        (Point::Setup | Point::Round0 | Point::RoundK | Point::Pause | Point::State, f) => {
            match f {
                Fault::KillSource => &[Lost],
                // A page corrupted while the guest runs is caught by its CRC; a later copy
                // (the writer rewrites its pages) mends it, or the destination refuses the
                // migration. `--checksum` proves memory equal at the switch either way.
                Fault::Corrupt if matches!(point, Point::Round0 | Point::RoundK) => {
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
        (Point::Go, Fault::KillDestination | Fault::Cut) => &[Reclaimed],
        // A destination that refuses a corrupt `Go` says so: the source may run on.
        (Point::Go, Fault::Corrupt) => &[Source, Reclaimed],
        (Point::Go, Fault::Cancel) => &[Destination],
        // Pages still on a dead source are gone; a dead destination's VM runs on the source
        // from its last checkpoint (post-copy sends one back every 20 ms here), or from the
        // switch if none had come yet.
        (Point::Postcopy(_), Fault::KillSource) => &[Lost],
        (Point::Postcopy(_), Fault::KillDestination) => &[RolledBack, Reclaimed],
        (Point::Postcopy(_), Fault::Cut | Fault::Corrupt) => &[Recovered],
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

struct Case {
    mode: &'static str,
    point: Point,
    fault: Fault,
}

struct Result {
    outcome: Outcome,
    /// The running copy's verify errors after one more pass.
    verify_errors: u64,
    reached: bool,
    secs: f64,
}

/// How a live ferry process holds the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holds {
    Nothing,
    Runs,
    /// Paused after `Go` (unconfirmed, or post-copy whose destination is gone).
    Paused(MigrationPhase),
    /// A destination in post-copy whose source is gone: it waits for pages forever.
    Stranded,
}

fn holds(f: &mut Ferry) -> Holds {
    if !f.is_running() {
        return Holds::Nothing;
    }
    let (Ok(info), Ok(status)) = (f.api().get("vm.info"), f.api().get("vm.migration")) else {
        return Holds::Nothing;
    };
    let state = info["state"].as_str().unwrap_or_default().to_string();
    let phase: MigrationPhase = serde_json::from_value(status["phase"].clone()).unwrap_or_default();
    match (state.as_str(), phase) {
        ("running", MigrationPhase::PostcopyPaused) => Holds::Stranded,
        ("running", _) => Holds::Runs,
        ("paused", MigrationPhase::Unconfirmed | MigrationPhase::PostcopyPaused) => {
            Holds::Paused(phase)
        }
        ("paused", _) => Holds::Runs,
        _ => Holds::Nothing,
    }
}

/// Whether a side is still between states (a migration running, a source about to exit).
fn settling(f: &mut Ferry) -> bool {
    if !f.is_running() {
        return false;
    }
    // A process may exit between two questions (a source that let go): then it has settled.
    let (Ok(status), Ok(info)) = (f.api().get("vm.migration"), f.api().get("vm.info")) else {
        return false;
    };
    let phase: MigrationPhase = serde_json::from_value(status["phase"].clone()).unwrap_or_default();
    let state = info["state"].as_str().unwrap_or_default();
    state == "migrating"
        || state == "migrated"
        || matches!(
            phase,
            MigrationPhase::Setup
                | MigrationPhase::Active
                | MigrationPhase::Switchover
                | MigrationPhase::PostcopyActive
        )
}

fn run_case(c: &Case) -> Result {
    let started = Instant::now();
    let mut src = Ferry::boot(VmSpec {
        memory: "256M",
        cmdline: "write ws=32M seq verify",
        ..Default::default()
    });
    src.wait_info("a first pass", Duration::from_secs(60), |i| i.passes >= 1);
    let port = free_port();
    let mut dst = Ferry::incoming(&format!("tcp:127.0.0.1:{port}"));
    let relay = Relay::start(&format!("127.0.0.1:{port}"), c.point, c.fault.action());

    let socket = src.socket.to_str().unwrap().to_string();
    let url = relay.url.clone();
    let mode = c.mode;
    let migrating = std::thread::spawn(move || {
        let mut args = vec!["migrate", "--api-socket", &socket, "--to", &url, "--json"];
        args.extend(mode_args(mode));
        args.extend([
            "--max-downtime-ms",
            "1",
            "--max-rounds",
            "4",
            // With a 1 Gbit/s cap and a 1 ms budget a writer's pre-copy runs all 4 rounds,
            // so every point of the conversation comes, whatever this machine's speed.
            "--max-bandwidth-mbps",
            "1000",
            // Both sides checksum memory at the switch: a corrupt page cannot pass unseen.
            "--checksum",
        ]);
        if matches!(mode, "postcopy" | "hybrid") {
            // Post-copy sends the VM back every 20 ms: a dead destination costs less.
            args.extend(["--checkpoint-ms", "20"]);
        }
        ferry_output(&args)
    });
    let reached = relay.wait_reached(Duration::from_secs(60));
    if reached {
        match c.fault {
            Fault::KillSource => kill(&mut src),
            Fault::KillDestination => kill(&mut dst),
            Fault::Cancel => {
                // Refused once the source has given the VM up (409): that is the point.
                let _ = src.api().put("vm.cancel-migration", None);
            }
            _ => {}
        }
    }
    relay.release();
    let _ = migrating.join();
    drop(relay);

    // Post-copy cut after the switch: carry on over a new connection.
    let (s, d) = (holds(&mut src), holds(&mut dst));
    let mut recovered = false;
    if s == Holds::Paused(MigrationPhase::PostcopyPaused) && d == Holds::Stranded {
        recovered = recover(&src, &dst);
    }
    wait_for("both sides to settle", Duration::from_secs(60), || {
        (!settling(&mut src) && !settling(&mut dst)).then_some(())
    });

    let (s, d) = (holds(&mut src), holds(&mut dst));
    let outcome = match (s, d) {
        (Holds::Runs, Holds::Runs | Holds::Stranded) => Outcome::Twice,
        (Holds::Runs, _) => Outcome::Source,
        (_, Holds::Runs) if recovered => Outcome::Recovered,
        (_, Holds::Runs) => Outcome::Destination,
        // The destination is gone: as its operator, take the VM back (mid post-copy, from
        // its last checkpoint).
        (Holds::Paused(phase), Holds::Nothing) => {
            let call = if phase == MigrationPhase::PostcopyPaused {
                "migrate-rollback"
            } else {
                "migrate-reclaim"
            };
            let out = ferry_output(&[call, "--api-socket", src.socket.to_str().unwrap()]);
            let said = String::from_utf8_lossy(&out.stdout);
            match (
                out.status.success() && holds(&mut src) == Holds::Runs,
                said.contains("from post-copy checkpoint"),
            ) {
                (true, true) => Outcome::RolledBack,
                (true, false) => Outcome::Reclaimed,
                (false, _) => Outcome::Held,
            }
        }
        _ => Outcome::Lost,
    };
    let runner = match outcome {
        Outcome::Source | Outcome::Reclaimed | Outcome::RolledBack => Some(&src),
        Outcome::Destination | Outcome::Recovered => Some(&dst),
        _ => None,
    };
    let verify_errors = runner.map_or(0, |f| {
        let start = f.info().passes;
        let info = f.wait_info("one more pass", Duration::from_secs(60), |i| {
            i.passes > start
        });
        info.verify_errors
    });
    Result {
        outcome,
        verify_errors,
        reached,
        secs: started.elapsed().as_secs_f64(),
    }
}

fn kill(f: &mut Ferry) {
    if let Some(child) = f.child.as_mut() {
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
    }
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

fn cases(full: bool) -> Vec<Case> {
    let all = modes().into_iter().flat_map(|(mode, points)| {
        points.into_iter().flat_map(move |point| {
            FAULTS
                .into_iter()
                .map(move |fault| Case { mode, point, fault })
        })
    });
    if full {
        return all.collect();
    }
    // One case of each fault (two of killing the destination: before the switch, and during
    // post-copy, where the operator takes the VM back), spread over the modes and points.
    let short = [
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
    ];
    all.filter(|c| short.contains(&(c.mode, c.point, c.fault)))
        .collect()
}

#[test]
fn fault_matrix() {
    if !kvm_available() {
        return;
    }
    let full = std::env::var("FERRY_FAULTS").is_ok_and(|v| v == "full");
    let mut cases = cases(full);
    // FERRY_FAULTS_ONLY="precopy/completion/kill -9 destination": the cases whose row has
    // every part (to look at one).
    if let Ok(only) = std::env::var("FERRY_FAULTS_ONLY") {
        cases.retain(|c| {
            let row = format!("{}/{}/{}", c.mode, c.point.name(), c.fault.name());
            only.split('/').all(|part| row.contains(part))
        });
    }
    let mut rows = Vec::new();
    let mut broken = Vec::new();
    for c in &cases {
        let r = run_case(c);
        let promise = promised(c.mode, c.point, c.fault);
        let ok = r.reached && promise.contains(&r.outcome) && r.verify_errors == 0;
        let line = format!(
            "| {} | {} | {} | {:?} | {} | {} | {:.1} |",
            c.mode,
            c.point.name(),
            c.fault.name(),
            r.outcome,
            r.verify_errors,
            if !r.reached {
                "NOT REACHED".to_string()
            } else if ok {
                "yes".to_string()
            } else {
                format!("NO (promised {promise:?})")
            },
            r.secs
        );
        eprintln!("{line}");
        if !ok {
            broken.push(line.clone());
        }
        rows.push((c.mode, r.outcome, line));
    }
    let count = |o: Outcome| rows.iter().filter(|(_, x, _)| *x == o).count();
    let mut table = String::from(
        "| mode | point | fault | outcome | verify errors | as promised | s |\n|---|---|---|---|---|---|---|\n",
    );
    for (_, _, line) in &rows {
        table.push_str(line);
        table.push('\n');
    }
    table.push_str(&format!(
        "\n{} faults injected: {} source, {} destination, {} recovered, {} rolled back, {} reclaimed, \
         {} held, {} lost, {} twice.\n",
        rows.len(),
        count(Outcome::Source),
        count(Outcome::Destination),
        count(Outcome::Recovered),
        count(Outcome::RolledBack),
        count(Outcome::Reclaimed),
        count(Outcome::Held),
        count(Outcome::Lost),
        count(Outcome::Twice),
    ));
    let out = repo_root()
        .join("target")
        .join(if full { "faults.md" } else { "faults-short.md" });
    let _ = std::fs::write(&out, &table);
    eprintln!("{table}");
    assert_eq!(count(Outcome::Twice), 0, "a VM ran twice:\n{table}");
    assert!(
        broken.is_empty(),
        "faults with other outcomes than promised:\n{}",
        broken.join("\n")
    );
}
