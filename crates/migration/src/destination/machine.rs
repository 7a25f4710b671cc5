//! The destination's side of the conversation as a state machine: which frame may come in
//! which state. Anything else is refused with the state and the frame named.

use crate::error::{Error, Result};
use crate::wire::Message;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestinationState {
    /// Nothing read yet: `Hello` (a new migration) or `ResumePostcopy` (carry one on).
    AwaitHello,
    /// Pages and round ends; then the switch (`PostcopyPending` or the first state frame).
    Memory,
    /// The stale copies are dropped: no more pages before the switch to post-copy.
    StaleDropped,
    /// vCPU and device state, up to `StateEnd`.
    State,
    /// Loaded; waiting for the source's `Go`.
    AwaitGo,
    /// The VM runs here; pages arrive until `PostcopyDone`.
    Postcopy,
    Done,
}

/// A frame as the state machine sees it.
#[derive(Clone, Copy, Debug)]
pub enum Incoming<'a> {
    Pages,
    Message(&'a Message),
}

impl DestinationState {
    /// Where `frame` leads from here. `postcopy` says whether the switch handed over by
    /// post-copy (known once `PostcopyPending` came).
    pub fn next(self, frame: Incoming<'_>, postcopy: bool) -> Result<Self> {
        use DestinationState::*;
        let m = match frame {
            Incoming::Pages => {
                return match self {
                    Memory | Postcopy => Ok(self),
                    other => Err(Error::Protocol(format!(
                        "a page frame while the destination was in {other:?}"
                    ))),
                };
            }
            Incoming::Message(m) => m,
        };
        let next = match (self, m) {
            (_, Message::Abort { reason }) => return Err(Error::Peer(reason.clone())),
            (AwaitHello, Message::Hello { .. }) => Memory,
            (AwaitHello, Message::ResumePostcopy) => Postcopy,
            (
                Memory,
                Message::RoundEnd { .. } | Message::Sync { .. } | Message::Populated { .. },
            ) => Memory,
            (Memory, Message::Stale { .. }) => StaleDropped,
            (Memory | StaleDropped, Message::PostcopyPending { .. }) => State,
            (State, Message::Checkpoints { .. }) if postcopy => State,
            (Memory | State, Message::VcpuState { .. } | Message::DeviceState { .. }) => State,
            (State, Message::StateEnd { .. }) => AwaitGo,
            (AwaitGo, Message::Go) if postcopy => Postcopy,
            (AwaitGo, Message::Go) => Done,
            (Postcopy, Message::PostcopyDone { .. }) => Done,
            (Postcopy, Message::CheckpointTaken { .. }) => Postcopy,
            (state, m) => {
                return Err(Error::Protocol(format!(
                    "unexpected {} while the destination was in {state:?}",
                    m.name()
                )));
            }
        };
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::DestinationState::*;
    use super::*;
    use crate::memory::RamRange;
    use crate::vm::VmDescriptor;
    use crate::wire::StreamMode;

    fn hello() -> Message {
        Message::Hello {
            vm: VmDescriptor {
                memory_bytes: 4096,
                ranges: vec![RamRange { gpa: 0, len: 4096 }],
                vcpus: 1,
                memory_backend: "anonymous".into(),
                running: true,
            },
            mode: StreamMode::Precopy,
            source: "test".into(),
            connections: 1,
            session: 0,
        }
    }

    fn walk(frames: &[Incoming<'_>], postcopy: bool) -> Result<DestinationState> {
        frames
            .iter()
            .try_fold(AwaitHello, |s, f| s.next(*f, postcopy))
    }

    #[test]
    fn precopy_stream() {
        let (h, end) = (hello(), Message::RoundEnd { round: 0, pages: 1 });
        let vcpu = Message::VcpuState {
            index: 0,
            state: vec![],
        };
        let dev = Message::DeviceState { state: vec![] };
        let state_end = Message::StateEnd {
            pages_sent: 1,
            memory_checksum: None,
        };
        let s = walk(
            &[
                Incoming::Message(&h),
                Incoming::Pages,
                Incoming::Message(&end),
                Incoming::Pages,
                Incoming::Message(&end),
                Incoming::Message(&vcpu),
                Incoming::Message(&dev),
                Incoming::Message(&state_end),
                Incoming::Message(&Message::Go),
            ],
            false,
        )
        .unwrap();
        assert_eq!(s, Done);
    }

    #[test]
    fn postcopy_stream() {
        let h = hello();
        let pending = Message::PostcopyPending {
            pages: 1,
            words: vec![1],
        };
        let vcpu = Message::VcpuState {
            index: 0,
            state: vec![],
        };
        let state_end = Message::StateEnd {
            pages_sent: 0,
            memory_checksum: None,
        };
        let done = Message::PostcopyDone { pages_sent: 1 };
        let s = walk(
            &[
                Incoming::Message(&h),
                Incoming::Message(&pending),
                Incoming::Message(&vcpu),
                Incoming::Message(&state_end),
                Incoming::Message(&Message::Go),
                Incoming::Pages,
                Incoming::Pages,
                Incoming::Message(&done),
            ],
            true,
        )
        .unwrap();
        assert_eq!(s, Done);
        // Recovery: a new connection starts with ResumePostcopy and carries pages on.
        let s = walk(
            &[
                Incoming::Message(&Message::ResumePostcopy),
                Incoming::Pages,
                Incoming::Message(&done),
            ],
            true,
        )
        .unwrap();
        assert_eq!(s, Done);
    }

    #[test]
    fn stale_copies_are_dropped_once_and_then_no_page_may_come() {
        let (h, end) = (hello(), Message::RoundEnd { round: 0, pages: 1 });
        let stale = Message::Stale {
            pages: 1,
            words: vec![1],
        };
        let pending = Message::PostcopyPending {
            pages: 1,
            words: vec![1],
        };
        let before = [
            Incoming::Message(&h),
            Incoming::Pages,
            Incoming::Message(&end),
            Incoming::Message(&stale),
        ];
        let s = walk(&before, false).unwrap();
        assert_eq!(s, StaleDropped);
        let sync = Message::Sync { lane_pages: vec![] };
        assert!(
            s.next(Incoming::Message(&sync), false).is_err(),
            "Sync belongs to pre-copy's rounds"
        );
        assert_eq!(
            Memory.next(Incoming::Message(&sync), false).unwrap(),
            Memory
        );
        assert_eq!(s.next(Incoming::Message(&pending), false).unwrap(), State);
        let e = s.next(Incoming::Pages, false).unwrap_err();
        assert!(
            e.to_string()
                .contains("page frame while the destination was in StaleDropped")
        );
        let e = s.next(Incoming::Message(&stale), false).unwrap_err();
        assert!(e.to_string().contains("unexpected Stale"), "{e}");
        let vcpu = Message::VcpuState {
            index: 0,
            state: vec![],
        };
        assert!(
            s.next(Incoming::Message(&vcpu), false).is_err(),
            "after Stale the switch is to post-copy"
        );
    }

    #[test]
    fn frames_out_of_order_are_refused() {
        let h = hello();
        let vcpu = Message::VcpuState {
            index: 0,
            state: vec![],
        };
        // Pages before Hello.
        let e = walk(&[Incoming::Pages], false).unwrap_err();
        assert!(
            e.to_string()
                .contains("page frame while the destination was in AwaitHello")
        );
        // Go before the state.
        let e = walk(
            &[Incoming::Message(&h), Incoming::Message(&Message::Go)],
            false,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("unexpected Go while the destination was in Memory")
        );
        // Pages after the state began (the source must send them before).
        let e = walk(
            &[
                Incoming::Message(&h),
                Incoming::Message(&vcpu),
                Incoming::Pages,
            ],
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("in State"), "{e}");
        // A second Hello.
        let e = walk(&[Incoming::Message(&h), Incoming::Message(&h)], false).unwrap_err();
        assert!(e.to_string().contains("unexpected Hello"), "{e}");
        let abort = Message::Abort {
            reason: "no".into(),
        };
        let e = walk(&[Incoming::Message(&h), Incoming::Message(&abort)], false).unwrap_err();
        assert!(matches!(e, Error::Peer(_)));
    }
}
