//! Where a migration's CPU time goes, by the work its threads do. Each worker thread (a
//! connection's sender or receiver, a compressing thread, a prefault thread) is tracked
//! from its start to its end: the CPU it used, by its own clock, and how long it lived. A
//! thread on a core nearly all its life is what the migration waits for; one mostly idle
//! waits on something else (the link, its peer, another thread). Built in, because the hosts
//! where it matters most (many cores, large guests) often have no profiler.

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
}

impl Work {
    const ALL: [Work; 4] = [Work::Send, Work::Pack, Work::Receive, Work::Prefault];

    pub fn name(self) -> &'static str {
        match self {
            Work::Send => "send",
            Work::Pack => "pack",
            Work::Receive => "receive",
            Work::Prefault => "prefault",
        }
    }
}

/// What the threads that did one kind of work used.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkCpu {
    pub work: String,
    /// Threads that did it: a connection's sender runs on a thread of its own each round (a
    /// pre-copy of 10 rounds over 8 connections counts 1 + 7 × 10), the others for the
    /// whole migration.
    pub threads: u32,
    /// CPU seconds, all its threads together.
    pub cpu_s: f64,
    /// Their lives, added up: `cpu_s / wall_s` is how busy they were on average.
    pub wall_s: f64,
    /// The busiest of them: its CPU ÷ its life (1: on a core all the time).
    pub busiest: f64,
}

impl WorkCpu {
    fn add(&mut self, cpu: Duration, wall: Duration) {
        let (cpu, wall) = (cpu.as_secs_f64(), wall.as_secs_f64());
        self.threads += 1;
        self.cpu_s += cpu;
        self.wall_s += wall;
        if wall > 0.0 {
            self.busiest = self.busiest.max(cpu / wall);
        }
    }
}

/// The CPU used by one migration's tracked threads. Clones share it.
#[derive(Clone, Debug, Default)]
pub struct CpuMeter(Arc<Mutex<Tally>>);

#[derive(Debug, Default)]
struct Tally {
    /// Threads that ended, by `Work::ALL`'s order.
    ended: [WorkCpu; 4],
    /// Threads still running: read on their own clocks when asked.
    running: Vec<Running>,
    next_id: u64,
}

#[derive(Debug)]
struct Running {
    id: u64,
    work: Work,
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
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tracks the calling thread, doing `work`, until the returned guard is dropped; a thread
    /// whose CPU clock cannot be read is not tracked.
    pub fn track(&self, work: Work) -> Option<Tracked> {
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
        t.running.push(Running {
            id,
            work,
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
        let mut uses = t.ended.clone();
        // A running thread cannot end (its guard's drop waits for the lock held here), so its
        // clock is still its own.
        for r in &t.running {
            if let Some(cpu) = read_clock(r.clock) {
                uses[index(r.work)].add(cpu.saturating_sub(r.cpu_at_start), r.started.elapsed());
            }
        }
        Work::ALL
            .into_iter()
            .zip(uses)
            .filter(|(_, u)| u.threads > 0)
            .map(|(w, u)| WorkCpu {
                work: w.name().into(),
                ..u
            })
            .collect()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut t = self.meter.lock();
        let Some(at) = t.running.iter().position(|r| r.id == self.id) else {
            return;
        };
        let r = t.running.swap_remove(at);
        if let Some(cpu) = read_clock(r.clock) {
            t.ended[index(r.work)].add(cpu.saturating_sub(r.cpu_at_start), r.started.elapsed());
        }
    }
}

fn index(work: Work) -> usize {
    Work::ALL
        .iter()
        .position(|&w| w == work)
        .expect("every work is in ALL")
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
            let _t = m2.track(Work::Prefault).unwrap();
            tracked_tx.send(()).unwrap();
            let _ = end_rx.recv();
        });
        tracked.recv().unwrap();
        let busy = std::thread::spawn(move || {
            let _t = m1.track(Work::Receive).unwrap();
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
    fn threads_of_one_work_add_up() {
        let meter = CpuMeter::default();
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    let _t = meter.track(Work::Send).unwrap();
                    spin(Duration::from_millis(20));
                });
            }
        });
        let uses = meter.uses();
        assert_eq!(uses.len(), 1);
        assert_eq!((uses[0].work.as_str(), uses[0].threads), ("send", 3));
        assert!(uses[0].cpu_s >= 0.06, "{uses:?}");
        assert!(uses[0].busiest > 0.0 && uses[0].busiest <= 1.01, "{uses:?}");
    }
}
