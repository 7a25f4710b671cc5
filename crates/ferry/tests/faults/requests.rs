//! Requests an operator makes of a side while a frame is held: cancel the migration, or stop
//! (the API's `vm.shutdown`, or SIGTERM). What the side answered is part of the row: a
//! request the lifecycle must refuse is checked refused, not only its outcome looked at (a
//! source that stops after `Go` in pre-copy leaves the VM on the destination all the same).

use std::time::Duration;

use crate::common::Ferry;
use crate::sides::{ANSWER_WAIT, poll_until};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// `vm.shutdown`.
    Api,
    /// SIGTERM.
    Signal,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// `vm.cancel-migration` to the source.
    Cancel,
    Stop(Side, How),
}

/// Where the switch stood when the request came (the frame held), in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Moment {
    /// The VM runs on the source (setup, rounds).
    Live,
    /// The source is switching over: paused, `Go` not written (pause, state).
    Paused,
    /// As `Paused`, but `Go` may be written behind the frame held (go-with-state).
    AroundGo,
    /// `Go` held on its way: the source gave the VM up; the destination has not run it.
    GoHeld,
    /// The destination runs the VM while its pages still arrive (post-copy).
    Runs,
    /// The destination ran the VM and said so: its last word is held.
    Said,
}

/// What the side said or did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heard {
    /// The API's HTTP status.
    Http(u16),
    /// The API did not answer.
    NoAnswer,
    /// SIGTERM: the process was still there `GRACE` after it took the signal.
    Stayed,
    /// SIGTERM: it was gone by then.
    Gone,
}

/// What a request got: the answer, and whether its process had exited by the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    pub heard: Heard,
    pub exited: bool,
}

/// What the lifecycle promises a request gets.
pub struct Expect {
    /// Any of these (empty: any).
    pub heard: &'static [Heard],
    /// Its process must have exited by the end.
    pub exits: bool,
}

/// How long a process that took SIGTERM is watched before the frame goes on: many times its
/// supervisor's 20 ms poll, so that one which heeds the signal too early is caught at it.
const GRACE: Duration = Duration::from_secs(1);

impl Request {
    pub fn name(self) -> &'static str {
        match self {
            Request::Cancel => "API cancel",
            Request::Stop(Side::Source, How::Api) => "stop source (API)",
            Request::Stop(Side::Source, How::Signal) => "stop source (SIGTERM)",
            Request::Stop(Side::Destination, How::Api) => "stop destination (API)",
            Request::Stop(Side::Destination, How::Signal) => "stop destination (SIGTERM)",
        }
    }

    /// The side the request goes to.
    pub fn side(self) -> Side {
        match self {
            Request::Cancel => Side::Source,
            Request::Stop(side, _) => side,
        }
    }

    /// Makes the request of its side; returns what it heard.
    pub fn make(self, target: &mut Ferry) -> Heard {
        match self {
            Request::Cancel => put(target, "vm.cancel-migration"),
            Request::Stop(_, How::Api) => put(target, "vm.shutdown"),
            Request::Stop(_, How::Signal) => terminate(target),
        }
    }

    /// The lifecycle's rule. A cancel is decided with `Go`: accepted before, refused (409)
    /// after. The source takes a stop while the VM runs there; from its switch-over (the
    /// pause) until the switch resolves it refuses (409) or defers (SIGTERM) it. The
    /// destination ends the arrival and exits on a stop until it runs the VM; while post-copy
    /// pages still arrive it refuses (409) or drops (SIGTERM) a stop; once it has said the VM
    /// runs there, a stop is the VM's own (taken or refused).
    pub fn expect(self, at: Moment) -> Expect {
        use {Heard::*, Moment::*};
        const ANY: &[Heard] = &[];
        let heard: &'static [Heard] = match (self, at) {
            (Request::Cancel, Live | Paused) => &[Http(204)],
            (Request::Cancel, AroundGo) => &[Http(204), Http(409)],
            (Request::Cancel, _) => &[Http(409)],
            (Request::Stop(Side::Source, How::Api), Live) => &[Http(204)],
            (Request::Stop(Side::Source, How::Signal), Live) => ANY,
            (Request::Stop(Side::Source, How::Api), _) => &[Http(409)],
            (Request::Stop(Side::Source, How::Signal), _) => &[Stayed],
            (Request::Stop(Side::Destination, How::Api), Runs) => &[Http(409)],
            (Request::Stop(Side::Destination, How::Signal), Runs) => &[Stayed],
            (Request::Stop(Side::Destination, How::Api), Said) => &[Http(204), Http(409)],
            (Request::Stop(Side::Destination, How::Api), _) => &[Http(204)],
            (Request::Stop(Side::Destination, How::Signal), _) => ANY,
        };
        Expect {
            heard,
            exits: self.side() == Side::Destination && at < Runs,
        }
    }
}

impl Heard {
    pub fn name(self) -> String {
        match self {
            Heard::Http(code) => code.to_string(),
            Heard::NoAnswer => "no answer".into(),
            Heard::Stayed => "stayed".into(),
            Heard::Gone => "gone".into(),
        }
    }
}

impl Answer {
    pub fn name(self) -> String {
        let exited = if self.exited { ", exited" } else { "" };
        format!("{}{exited}", self.heard.name())
    }
}

impl Expect {
    /// What is wrong with `answer`, if anything.
    pub fn problem(&self, answer: Answer) -> Option<String> {
        if !self.heard.is_empty() && !self.heard.contains(&answer.heard) {
            let names: Vec<String> = self.heard.iter().map(|h| h.name()).collect();
            return Some(format!(
                "answered {} (promised {})",
                answer.heard.name(),
                names.join(" or ")
            ));
        }
        (self.exits && !answer.exited).then(|| "its process did not exit".to_string())
    }
}

/// Whether `f`'s process is gone, given up to `limit` to get there.
pub fn gone_within(f: &mut Ferry, limit: Duration) -> bool {
    poll_until(limit, || !f.is_running())
}

/// Whether the process a promise says exits did, by the end; others are not waited for.
pub fn exited(f: &mut Ferry, expect: &Expect) -> bool {
    let limit = if expect.exits {
        ANSWER_WAIT
    } else {
        Duration::ZERO
    };
    gone_within(f, limit)
}

fn put(f: &Ferry, endpoint: &str) -> Heard {
    match f.api().put(endpoint, None) {
        Ok(v) if v.is_null() => Heard::Http(204),
        Ok(_) => Heard::Http(200),
        Err(api::ClientError::Api { status, .. }) => Heard::Http(status),
        Err(_) => Heard::NoAnswer,
    }
}

/// SIGTERM; once the process has taken it, watches it for `GRACE`.
fn terminate(f: &mut Ferry) -> Heard {
    let Some(pid) = f.child.as_ref().map(|c| c.id()) else {
        return Heard::Gone;
    };
    // SAFETY: a signal to our own child, which has not been reaped (we hold its `Child`).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    // ferry says when its handler ran: from then on every check it makes sees the stop.
    poll_until(ANSWER_WAIT, || {
        f.stderr_text().contains("received SIGTERM") || !f.is_running()
    });
    if gone_within(f, GRACE) {
        Heard::Gone
    } else {
        Heard::Stayed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_are_refused_from_the_switch_on_and_while_pages_arrive() {
        let api = Request::Stop(Side::Source, How::Api);
        assert_eq!(api.expect(Moment::Live).heard, &[Heard::Http(204)]);
        assert_eq!(api.expect(Moment::Paused).heard, &[Heard::Http(409)]);
        assert_eq!(
            Request::Cancel.expect(Moment::Paused).heard,
            &[Heard::Http(204)]
        );
        assert_eq!(
            Request::Cancel.expect(Moment::GoHeld).heard,
            &[Heard::Http(409)]
        );
        let signal = Request::Stop(Side::Source, How::Signal);
        assert_eq!(signal.expect(Moment::GoHeld).heard, &[Heard::Stayed]);
        let dst = Request::Stop(Side::Destination, How::Api);
        let e = dst.expect(Moment::GoHeld);
        assert_eq!((e.heard, e.exits), (&[Heard::Http(204)][..], true));
        let e = dst.expect(Moment::Runs);
        assert_eq!((e.heard, e.exits), (&[Heard::Http(409)][..], false));
        let stayed = Answer {
            heard: Heard::Http(204),
            exited: false,
        };
        assert!(dst.expect(Moment::Live).problem(stayed).is_some());
    }
}
