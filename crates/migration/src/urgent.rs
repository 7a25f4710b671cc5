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

/// The nice value of such a thread: about three times an `ahead` thread's weight, 28 times a
/// default thread's.
const URGENT_NICE: i32 = -15;

/// The nice value of a thread whose bulk work goes before the guest's: nine times a default
/// thread's weight (a busy vCPU's).
const AHEAD_NICE: i32 = -10;

fn this_thread() -> libc::id_t {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as libc::id_t }
}

/// The calling thread runs urgent until this is dropped (then as before). Where raising a
/// thread's priority is not allowed (no `CAP_SYS_NICE`) it runs as before, which costs
/// latency only.
pub(crate) struct Urgent {
    tid: libc::id_t,
    before: Option<i32>,
}

pub(crate) fn urgent() -> Urgent {
    raised_to(URGENT_NICE)
}

/// The calling thread runs ahead of the vCPUs (but behind urgent threads) until this is
/// dropped: post-copy's pushing, reading and installing threads.
pub(crate) fn ahead() -> Urgent {
    raised_to(AHEAD_NICE)
}

fn raised_to(nice: i32) -> Urgent {
    let tid = this_thread();
    let before = nice_of(tid);
    if before.is_some_and(|n| n > nice) && !set_nice(tid, nice) {
        tracing::debug!(
            "post-copy's fault path runs at the default priority: {}",
            std::io::Error::last_os_error()
        );
        return Urgent { tid, before: None };
    }
    Urgent { tid, before }
}

impl Drop for Urgent {
    fn drop(&mut self) {
        if let Some(n) = self.before {
            set_nice(self.tid, n);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_runs_raised_then_as_before() {
        for (raise, nice) in [(urgent as fn() -> Urgent, URGENT_NICE), (ahead, AHEAD_NICE)] {
            std::thread::spawn(move || {
                let tid = this_thread();
                let before = nice_of(tid).unwrap();
                let raised = {
                    let u = raise();
                    let now = nice_of(tid).unwrap();
                    match u.before {
                        Some(_) => assert_eq!(now, nice.min(before)),
                        None => assert_eq!(now, before, "not allowed: unchanged"),
                    }
                    now
                };
                assert!(raised <= before);
                assert_eq!(nice_of(tid).unwrap(), before, "restored when dropped");
            })
            .join()
            .unwrap();
        }
    }
}
