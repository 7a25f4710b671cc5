//! Threads a post-copy fault waits on run ahead of bulk work. A vCPU's fault passes through
//! several threads on both hosts (the fault handler, the source's reader and the thread that
//! answers, the reader that installs the answer); on a host whose cores are all busy (vCPUs,
//! the pushes) each one that waits for a core adds a scheduler slice to the fault. These
//! threads sleep most of the time, so a larger share for them takes little from the rest.
//! The threads that carry post-copy's pushes come next, ahead of the vCPUs (the source's
//! pushers, the destination's readers of pushes and its installers): every page they put in
//! place is one no vCPU faults on, and the sooner all are in, the sooner the VM needs nothing
//! more from the source. They form one pipeline paced by the destination's receipts, so one
//! stage left waiting for a core behind busy vCPUs idles the others.

/// The real-time priority of such a thread: the lowest of `SCHED_FIFO`, above every ordinary
/// thread. A waking thread of the default policy, however high its nice value, may now and then
/// wait for a running one to reach the end of its slice, and a fault passes through several
/// such wakeups; a real-time one runs at once. These threads do little per wakeup, and the
/// kernel's real-time throttling keeps a share of every core for the rest even if one never
/// slept.
const URGENT_FIFO: i32 = 1;

/// The nice value of such a thread where real-time scheduling is not allowed: about three
/// times an `ahead` thread's weight, 28 times a default thread's.
const URGENT_NICE: i32 = -15;

/// The nice value of a thread whose bulk work goes before the guest's: nine times a default
/// thread's weight (a busy vCPU's).
const AHEAD_NICE: i32 = -10;

fn this_thread() -> libc::id_t {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as libc::id_t }
}

/// The calling thread runs raised until this is dropped (then as before). Where raising a
/// thread's priority is not allowed (no `CAP_SYS_NICE`) it runs as before, which costs
/// latency only.
pub(crate) struct Urgent {
    tid: libc::id_t,
    before: Before,
}

/// What to put back when an `Urgent` ends.
enum Before {
    Nothing,
    Nice(i32),
    /// The policy it ran under (its nice value is kept across the change).
    Policy(libc::c_int),
}

/// The calling thread runs real-time (or, where that is refused, at `URGENT_NICE`).
pub(crate) fn urgent() -> Urgent {
    let tid = this_thread();
    // SAFETY: reads the calling thread's policy.
    let policy = unsafe { libc::sched_getscheduler(tid as libc::pid_t) };
    if policy == libc::SCHED_OTHER && set_policy(tid, libc::SCHED_FIFO, URGENT_FIFO) {
        return Urgent {
            tid,
            before: Before::Policy(policy),
        };
    }
    raised_to(URGENT_NICE)
}

/// The calling thread runs ahead of the vCPUs (but behind urgent threads) until this is
/// dropped: post-copy's pushing, reading and installing threads.
pub(crate) fn ahead() -> Urgent {
    raised_to(AHEAD_NICE)
}

fn raised_to(nice: i32) -> Urgent {
    let tid = this_thread();
    let before = match nice_of(tid) {
        Some(n) if n > nice && set_nice(tid, nice) => Before::Nice(n),
        Some(n) if n > nice => {
            tracing::debug!(
                "post-copy's fault path runs at the default priority: {}",
                std::io::Error::last_os_error()
            );
            Before::Nothing
        }
        _ => Before::Nothing,
    };
    Urgent { tid, before }
}

impl Drop for Urgent {
    fn drop(&mut self) {
        match self.before {
            Before::Nothing => {}
            Before::Nice(n) => {
                set_nice(self.tid, n);
            }
            Before::Policy(p) => {
                set_policy(self.tid, p, 0);
            }
        }
    }
}

fn nice_of(tid: libc::id_t) -> Option<i32> {
    // SAFETY: errno is this thread's; getpriority may return -1 as a value, told apart by it.
    unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, tid);
        (n != -1 || *libc::__errno_location() == 0).then_some(n)
    }
}

fn set_nice(tid: libc::id_t, nice: i32) -> bool {
    // SAFETY: sets one thread's nice value; no memory is touched.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) == 0 }
}

fn set_policy(tid: libc::id_t, policy: libc::c_int, priority: i32) -> bool {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: sets one thread's scheduling policy from a parameter that lives across the call.
    unsafe { libc::sched_setscheduler(tid as libc::pid_t, policy, &param) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy_of(tid: libc::id_t) -> libc::c_int {
        // SAFETY: reads one thread's policy.
        unsafe { libc::sched_getscheduler(tid as libc::pid_t) }
    }

    /// Runs `check` on a fresh thread with the thread's id and its nice value before.
    fn on_a_thread(check: fn(libc::id_t, i32)) {
        std::thread::spawn(move || {
            let tid = this_thread();
            check(tid, nice_of(tid).unwrap());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn an_urgent_thread_runs_real_time_or_raised_then_as_before() {
        on_a_thread(|tid, before| {
            {
                let u = urgent();
                match u.before {
                    Before::Policy(p) => {
                        assert_eq!(p, libc::SCHED_OTHER);
                        assert_eq!(policy_of(tid), libc::SCHED_FIFO);
                    }
                    Before::Nice(_) => assert_eq!(nice_of(tid).unwrap(), URGENT_NICE),
                    Before::Nothing => assert_eq!(nice_of(tid).unwrap(), before, "not allowed"),
                }
            }
            assert_eq!(policy_of(tid), libc::SCHED_OTHER, "restored when dropped");
            assert_eq!(nice_of(tid).unwrap(), before, "its nice value kept");
        });
    }

    #[test]
    fn a_thread_ahead_runs_raised_then_as_before() {
        on_a_thread(|tid, before| {
            {
                let u = ahead();
                let now = nice_of(tid).unwrap();
                match u.before {
                    Before::Nice(n) => assert_eq!((n, now), (before, AHEAD_NICE)),
                    Before::Nothing => assert_eq!(now, before, "not allowed or already above"),
                    Before::Policy(_) => panic!("a thread ahead keeps its policy"),
                }
            }
            assert_eq!(nice_of(tid).unwrap(), before, "restored when dropped");
        });
    }
}
