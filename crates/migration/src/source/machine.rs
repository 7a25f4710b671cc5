//! The source's side of the conversation as a state machine: which message from the
//! destination is allowed in which state, and where each step leads. The session drives it;
//! tests drive it alone.

use crate::error::{Error, Result};
use crate::wire::Message;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceState {
    /// Hello sent; the destination builds the VM.
    AwaitReady,
    /// Live rounds (or, warm/snapshot, the one full pass).
    Rounds,
    /// Rounds over, the switch will be to post-copy: the destination drops the copies the
    /// guest dirtied since, while the guest still runs here.
    DroppingStale,
    /// Rounds over: waiting for the destination to apply everything before pausing.
    Syncing,
    /// Paused; last pages and the state are on their way.
    Switchover,
    /// State sent; the destination loads it.
    AwaitLoaded,
    /// The destination holds everything: `Go` may be sent.
    Loaded,
    /// `Go` went right behind the state (`go_with_state`): the destination starts once it
    /// has loaded it; its `Loaded` is still to come. From here the VM may run there, unless
    /// the destination says why it could not load.
    AwaitLoadedGoSent {
        postcopy: bool,
    },
    /// `Go` sent: from here the VM may run on the destination. Whether pages follow.
    AwaitResumed {
        postcopy: bool,
    },
    /// The VM runs there; pages follow (requests first).
    Postcopy,
    /// The VM runs there; waiting a moment for what the guest saw.
    AwaitGuestReport,
    Done,
}

/// What happened: the source sent something, or heard something.
#[derive(Debug)]
pub enum Event<'a> {
    Ready,
    StartRounds,
    StaleSent,
    SyncSent,
    Paused,
    StateSent,
    GoSent { postcopy: bool },
    Heard(&'a Message),
}

impl SourceState {
    pub fn next(self, event: Event<'_>) -> Result<Self> {
        use SourceState::*;
        let next = match (self, &event) {
            (_, Event::Heard(Message::Abort { reason })) => {
                return Err(Error::Peer(reason.clone()));
            }
            (AwaitReady, Event::Heard(Message::Ready { .. })) => Rounds,
            (AwaitReady, Event::StartRounds) => Rounds, // a snapshot file answers nothing
            (Rounds, Event::StaleSent) => DroppingStale,
            (DroppingStale, Event::Heard(Message::StaleDropped)) => Rounds,
            (Rounds, Event::SyncSent) => Syncing,
            (Syncing, Event::Heard(Message::Synced)) => Rounds,
            (Rounds, Event::Paused) => Switchover,
            (Switchover, Event::StateSent) => AwaitLoaded,
            (AwaitLoaded, Event::Heard(Message::Loaded { .. })) => Loaded,
            (Loaded, Event::GoSent { postcopy }) => AwaitResumed {
                postcopy: *postcopy,
            },
            (AwaitLoaded, Event::GoSent { postcopy }) => AwaitLoadedGoSent {
                postcopy: *postcopy,
            },
            (AwaitLoadedGoSent { postcopy }, Event::Heard(Message::Loaded { .. })) => {
                AwaitResumed { postcopy }
            }
            (AwaitResumed { postcopy: true }, Event::Heard(Message::Resumed { .. })) => Postcopy,
            (AwaitResumed { postcopy: false }, Event::Heard(Message::Resumed { .. })) => {
                AwaitGuestReport
            }
            (Postcopy, Event::Heard(Message::PageRequest { .. })) => Postcopy,
            (Postcopy, Event::Heard(Message::Taken { .. })) => Postcopy,
            (Postcopy, Event::Heard(Message::GuestReport { .. })) => Postcopy,
            (Postcopy, Event::Heard(Message::Checkpoint { .. })) => Postcopy,
            (Postcopy, Event::Heard(Message::PostcopyComplete(_))) => AwaitGuestReport,
            (AwaitGuestReport, Event::Heard(Message::GuestReport { .. })) => Done,
            (state, Event::Heard(m)) => {
                return Err(Error::out_of_turn("source", m.name(), format!("{state:?}")));
            }
            (state, e) => {
                return Err(Error::State(format!(
                    "source step {e:?} is not allowed in {state:?}"
                )));
            }
        };
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::SourceState::*;
    use super::*;
    use crate::wire::PostcopyReport;

    fn run(steps: Vec<Event<'_>>) -> Result<SourceState> {
        steps.into_iter().try_fold(AwaitReady, |s, e| s.next(e))
    }

    /// The destination's answers every conversation below hears.
    static READY: Message = Message::Ready {
        postcopy: true,
        host: None,
    };
    static LOADED: Message = Message::Loaded {
        memory_checksum: None,
    };
    static RESUMED: Message = Message::Resumed {
        state_to_resume_ns: 1,
    };

    /// `go_with_state`: Go right behind the state; Loaded, then Resumed, follow. Go twice,
    /// or Resumed before Loaded, is refused.
    #[test]
    fn go_may_go_with_the_state() {
        let before = || {
            vec![
                Event::Heard(&READY),
                Event::Paused,
                Event::StateSent,
                Event::GoSent { postcopy: true },
            ]
        };
        assert_eq!(run(before()).unwrap(), AwaitLoadedGoSent { postcopy: true });
        let mut steps = before();
        steps.extend([Event::Heard(&LOADED), Event::Heard(&RESUMED)]);
        assert_eq!(run(steps).unwrap(), Postcopy);
        let mut steps = before();
        steps.push(Event::Heard(&RESUMED));
        assert!(run(steps).is_err(), "Resumed before Loaded");
        let mut steps = before();
        steps.push(Event::GoSent { postcopy: true });
        assert!(run(steps).is_err(), "Go twice");
    }

    #[test]
    fn precopy_conversation() {
        let report = Message::GuestReport {
            observed_downtime_ns: None,
            pages_per_s_after: None,
        };
        let s = run(vec![
            Event::Heard(&READY),
            Event::Paused,
            Event::StateSent,
            Event::Heard(&LOADED),
            Event::GoSent { postcopy: false },
            Event::Heard(&RESUMED),
        ])
        .unwrap();
        // Pre-copy has nothing to push: the guest report ends it.
        assert_eq!(s, AwaitGuestReport);
        assert_eq!(s.next(Event::Heard(&report)).unwrap(), Done);
        let req = Message::PageRequest { gfn: 1 };
        assert!(
            s.next(Event::Heard(&req)).is_err(),
            "no requests in pre-copy"
        );
    }

    #[test]
    fn postcopy_conversation_serves_requests_until_complete() {
        let req = Message::PageRequest { gfn: 5 };
        let done = Message::PostcopyComplete(PostcopyReport::default());
        let report = Message::GuestReport {
            observed_downtime_ns: Some(1),
            pages_per_s_after: None,
        };
        let s = run(vec![
            Event::Heard(&READY),
            Event::Paused,
            Event::StateSent,
            Event::Heard(&LOADED),
            Event::GoSent { postcopy: true },
            Event::Heard(&RESUMED),
            Event::Heard(&req),
            Event::Heard(&req),
            Event::Heard(&done),
            Event::Heard(&report),
        ])
        .unwrap();
        assert_eq!(s, Done);
    }

    #[test]
    fn the_source_pauses_only_after_the_stale_copies_are_dropped() {
        let s = run(vec![Event::Heard(&READY), Event::StaleSent]).unwrap();
        assert_eq!(s, DroppingStale);
        assert!(s.next(Event::Paused).is_err(), "no pause before the answer");
        let s = s.next(Event::Heard(&Message::StaleDropped)).unwrap();
        assert_eq!(s.next(Event::Paused).unwrap(), Switchover);
        // Pre-copy: the pause waits for Synced.
        let s = run(vec![Event::Heard(&READY), Event::SyncSent]).unwrap();
        assert_eq!(s, Syncing);
        assert!(s.next(Event::Paused).is_err(), "no pause before the answer");
        let s = s.next(Event::Heard(&Message::Synced)).unwrap();
        assert_eq!(s.next(Event::Paused).unwrap(), Switchover);
        let e = run(vec![
            Event::Heard(&READY),
            Event::Heard(&Message::StaleDropped),
        ])
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("unexpected StaleDropped while the source was in Rounds")
        );
    }

    #[test]
    fn out_of_order_answers_are_refused() {
        let e = run(vec![Event::Heard(&LOADED)]).unwrap_err();
        let Error::OutOfTurn { side, got, state } = &e else {
            panic!("not an out-of-turn error: {e}");
        };
        assert_eq!(
            (*side, got.as_str(), state.as_str()),
            ("source", "Loaded", "AwaitReady")
        );
        assert!(
            e.to_string()
                .contains("unexpected Loaded while the source was in AwaitReady")
        );
        // Go before the destination loaded the state: never.
        let ready = Message::Ready {
            postcopy: false,
            host: None,
        };
        let e = run(vec![
            Event::Heard(&ready),
            Event::GoSent { postcopy: false },
        ])
        .unwrap_err();
        assert!(matches!(e, Error::State(_)), "{e}");
        let req = Message::PageRequest { gfn: 1 };
        let e = run(vec![Event::Heard(&ready), Event::Heard(&req)]).unwrap_err();
        assert!(e.to_string().contains("PageRequest"), "{e}");
        let abort = Message::Abort {
            reason: "disk full".into(),
        };
        let e = run(vec![Event::Heard(&abort)]).unwrap_err();
        assert!(matches!(e, Error::Peer(r) if r == "disk full"));
    }
}
