//! Carrying on an interrupted post-copy on the destination (the source's half is
//! `source::recovery`): wait for the source on a new listener, tell it which pages are here,
//! receive the rest.

use super::machine::{DestinationState, Incoming};
use super::postcopy::Postcopy;
use crate::error::{Error, Result};
use crate::wire::transport::Listener;
use crate::wire::{self, Frame, Message, PostcopyReport};

pub(crate) fn resume(dest: &Postcopy, listener: Listener) -> Result<PostcopyReport> {
    let mut stream = listener.accept()?;
    wire::read_stream_header(&mut stream)?;
    let first = match wire::read_frame(&mut stream)? {
        Frame::Message(m) => m,
        Frame::Pages { .. } => {
            return Err(Error::Protocol("a new connection began with pages".into()));
        }
    };
    if DestinationState::AwaitHello.next(Incoming::Message(&first), true)?
        != DestinationState::Postcopy
    {
        return Err(Error::Protocol(format!(
            "expected ResumePostcopy on the new connection, got {}",
            first.name()
        )));
    }
    wire::write_message(
        &mut stream,
        &Message::ResumeFrom {
            words: dest.present_words(),
        },
    )?;
    dest.attach(stream.try_clone()?);
    let result = dest.receive_pages(&mut stream);
    if result.is_err() {
        dest.detach();
    }
    result
}
