//! Where a migration's CPU time goes, by the work its threads do. Each worker thread (a
//! connection's sender or receiver, a compressing thread, a prefault thread) is tracked
//! from its start to its end: the CPU it used, by its own clock, and how long it lived. A
//! thread on a core nearly all its life is what the migration waits for; one mostly idle
//! waits on something else (the link, its peer, another thread). Built in, because the hosts
//! where it matters most (many cores, large guests) often have no profiler.

use crate::sync::Locked;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a tracked thread does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Reads guest pages and writes frames to a connection (and, on the main connection, the
    /// migration's conversation).
    Send,
    /// Compresses frames for a sender (`--migration-threads` above the connections).
    Pack,
    /// Reads frames from a connection into guest memory.
    Receive,
    /// Faults the destination's memory in ahead of the pages (`destination::prefault`).
    Prefault,
    /// Puts post-copy's pushed pages in place (`destination::installers`).
    Install,
}

impl Work {
    /// In declaration order: `work as usize` is a work's place here.
    const ALL: [Work; 5] = [
        Work::Send,
        Work::Pack,
        Work::Receive,
        Work::Prefault,
        Work::Install,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Work::Send => "send",
            Work::Pack => "pack",
            Work::Receive => "receive",
            Work::Prefault => "prefault",
            Work::Install => "install",
        }
    }
}

/// Whom a tracked thread works for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Worker {
    /// A connection: its sender runs on a thread of its own each round, and the rounds add
    /// up as one worker.
    Lane(u32),
    /// Itself alone.
    Own,
}

/// What the threads that did one kind of work used.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkCpu {
    pub work: String,
    /// Workers that did it: threads, except that a connection's rounds count as one.
    pub threads: u32,
    /// CPU seconds, all its threads together.
    pub cpu_s: f64,
    /// Their lives, added up: `cpu_s / wall_s` is how busy they were on average.
    pub wall_s: f64,
    /// The busiest of them: its CPU ÷ its life (1: on a core all the time).
    pub busiest: f64,
}

/// A worker's CPU and life so far (its threads' added up).
#[derive(Clone, Copy, Debug, Default)]
struct Spent {
    cpu: Duration,
    wall: Duration,
}

impl Spent {
    fn add(&mut self, cpu: Duration, wall: Duration) {
        self.cpu += cpu;
        self.wall += wall;
    }
}

/// A worker: its work (by `Work::ALL`'s order) and who it is (a lane, or a thread's own
/// number above every lane's).
type WorkerKey = (usize, u64);

/// Numbers for `Worker::Own` start here, above every lane.
const OWN_WORKERS: u64 = 1 << 32;

/// The CPU used by one migration's tracked threads. Clones share it.
#[derive(Clone, Debug, Default)]
pub struct CpuMeter(Arc<Mutex<Tally>>);

#[derive(Debug, Default)]
struct Tally {
    /// What the threads that ended spent, by worker.
    ended: BTreeMap<WorkerKey, Spent>,
    /// Threads still running: read on their own clocks when asked.
    running: Vec<Running>,
    next_id: u64,
}

#[derive(Debug)]
struct Running {
    id: u64,
    worker: WorkerKey,
    clock: libc::clockid_t,
    cpu_at_start: Duration,
    started: Instant,
}

/// Tracks the calling thread until dropped, on that thread: it is not `Send`, since its drop
/// reads the calling thread's clock as the tracked thread's.
pub struct Tracked {
    meter: CpuMeter,
    id: u64,
    not_send: PhantomData<*const ()>,
}

impl CpuMeter {
    fn lock(&self) -> MutexGuard<'_, Tally> {
        // Figures only, never a broken invariant: a panicked thread's are still good.
        self.0.locked()
    }

    /// Tracks the calling thread, doing `work` for `worker`, until the returned guard is
    /// dropped; a thread whose CPU clock cannot be read is not tracked.
    pub fn track(&self, work: Work, worker: Worker) -> Option<Tracked> {
        let mut clock: libc::clockid_t = 0;
        // SAFETY: asks for the calling thread's CPU clock; writes one clockid.
        if unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) } != 0 {
            return None;
        }
        // The wall clock starts first and stops last: a life is never shorter than its CPU.
        let started = Instant::now();
        let cpu_at_start = read_clock(clock)?;
        let mut t = self.lock();
        t.next_id += 1;
        let id = t.next_id;
        let who = match worker {
            Worker::Lane(lane) => u64::from(lane),
            Worker::Own => OWN_WORKERS + id,
        };
        t.running.push(Running {
            id,
            worker: (work as usize, who),
            clock,
            cpu_at_start,
            started,
        });
        Some(Tracked {
            meter: self.clone(),
            id,
            not_send: PhantomData,
        })
    }

    /// What each kind of work used so far (threads still running counted up to now), the
    /// kinds no thread did left out.
    pub fn uses(&self) -> Vec<WorkCpu> {
        let t = self.lock();
        let mut spent = t.ended.clone();
        // A running thread cannot end (its guard's drop waits for the lock held here), so its
        // clock is still its own.
        for r in &t.running {
            r.add_to(&mut spent);
        }
        let mut uses: Vec<WorkCpu> = Work::ALL
            .iter()
            .map(|w| WorkCpu {
                work: w.name().into(),
                ..WorkCpu::default()
            })
            .collect();
        for (&(work, _), s) in &spent {
            let (cpu, wall) = (s.cpu.as_secs_f64(), s.wall.as_secs_f64());
            let u = &mut uses[work];
            u.threads += 1;
            u.cpu_s += cpu;
            u.wall_s += wall;
            if wall > 0.0 {
                u.busiest = u.busiest.max(cpu / wall);
            }
        }
        uses.retain(|u| u.threads > 0);
        uses
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut t = self.meter.lock();
        let Some(at) = t.running.iter().position(|r| r.id == self.id) else {
            return;
        };
        let r = t.running.swap_remove(at);
        r.add_to(&mut t.ended);
    }
}

impl Running {
    /// Adds what this thread has spent so far to its worker's figures.
    fn add_to(&self, spent: &mut BTreeMap<WorkerKey, Spent>) {
        if let Some(cpu) = read_clock(self.clock) {
            spent.entry(self.worker).or_default().add(
                cpu.saturating_sub(self.cpu_at_start),
                self.started.elapsed(),
            );
        }
    }
}

fn read_clock(clock: libc::clockid_t) -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec; the clock is a live thread's (see `uses`) or our own.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spins on its core for at least `d` of its own CPU time.
    fn spin(d: Duration) {
        let clock = libc::CLOCK_THREAD_CPUTIME_ID;
        let start = read_clock(clock).unwrap();
        while read_clock(clock).unwrap() - start < d {
            std::hint::black_box(0u64);
        }
    }

    #[test]
    fn a_busy_thread_and_an_idle_one_are_told_apart() {
        let meter = CpuMeter::default();
        let (m1, m2) = (meter.clone(), meter.clone());
        // The idle thread waits on a channel, not a clock, and says when it is tracked.
        let (tracked_tx, tracked) = std::sync::mpsc::channel::<()>();
        let (end, end_rx) = std::sync::mpsc::channel::<()>();
        let idle = std::thread::spawn(move || {
            let _t = m2.track(Work::Prefault, Worker::Own).unwrap();
            tracked_tx.send(()).unwrap();
            let _ = end_rx.recv();
        });
        tracked.recv().unwrap();
        let busy = std::thread::spawn(move || {
            let _t = m1.track(Work::Receive, Worker::Own).unwrap();
            spin(Duration::from_millis(30));
        });
        busy.join().unwrap();
        // A thread still running counts up to now.
        let live = meter.uses();
        assert_eq!(live.len(), 2, "{live:?}");
        assert!(
            live[1].wall_s >= 0.03,
            "the idle one outlived the busy one: {live:?}"
        );
        drop(end);
        idle.join().unwrap();
        let uses = meter.uses();
        let receive = uses.iter().find(|u| u.work == "receive").unwrap();
        let prefault = uses.iter().find(|u| u.work == "prefault").unwrap();
        assert_eq!((receive.threads, prefault.threads), (1, 1));
        assert!(receive.cpu_s >= 0.03, "{receive:?}");
        assert!(receive.cpu_s <= receive.wall_s + 1e-3, "{receive:?}");
        // The idle thread's CPU is its start and end: far below the busy one's.
        assert!(prefault.cpu_s < receive.cpu_s / 2.0, "{prefault:?}");
        assert!(prefault.busiest < receive.busiest, "{uses:?}");
        assert!(uses.iter().all(|u| u.work != "send" && u.work != "pack"));
    }

    #[test]
    fn threads_of_one_work_add_up_and_a_lanes_rounds_count_once() {
        let meter = CpuMeter::default();
        // Two rounds of two lanes, each round on threads of their own, beside a thread of its
        // own doing the same work.
        for _ in 0..2 {
            std::thread::scope(|s| {
                for lane in 1..=2 {
                    let meter = &meter;
                    s.spawn(move || {
                        let _t = meter.track(Work::Send, Worker::Lane(lane)).unwrap();
                        spin(Duration::from_millis(20));
                    });
                }
            });
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                let _t = meter.track(Work::Send, Worker::Own).unwrap();
                spin(Duration::from_millis(20));
            });
        });
        let uses = meter.uses();
        assert_eq!(uses.len(), 1);
        assert_eq!(
            (uses[0].work.as_str(), uses[0].threads),
            ("send", 3),
            "{uses:?}"
        );
        assert!(uses[0].cpu_s >= 0.1, "five spans of 20 ms: {uses:?}");
        assert!(uses[0].busiest > 0.0 && uses[0].busiest <= 1.01, "{uses:?}");
    }
}
