//! Carrying on an interrupted post-copy on the destination (the source's half is
//! `source::recovery`): wait for the source on a new listener, tell it which pages are here,
//! receive the rest.

use super::postcopy::Postcopy;
use crate::cpu::CpuMeter;
use crate::error::{Error, Result};
use crate::io::transport::{Listener, Stream};
use crate::wire::{self, Frame, Message, PostcopyReport};

/// Waits for the source until `stop` says so (a deadline, a cancel, a later listen); a
/// connection that does not open a resume is dropped and the wait goes on.
pub(crate) fn resume(
    dest: &Postcopy,
    listener: Listener,
    stop: &dyn Fn() -> Option<Error>,
) -> Result<PostcopyReport> {
    let mut stream = loop {
        let stopped = || stop().is_some();
        let mut stream = match listener.accept_until(&stopped) {
            Ok(Some(s)) => s,
            Ok(None) => return Err(stop().unwrap_or(Error::Cancelled)),
            Err(e) => {
                tracing::warn!(
                    "refused a connection to the resume listener: {}",
                    crate::error::chain(&e)
                );
                continue;
            }
        };
        match open_resume(&mut stream).and_then(|()| match dest.refuses(&stream) {
            None => Ok(()),
            Some(why) => Err(Error::Setup(format!(
                "not a connection of this migration's peer: {why}"
            ))),
        }) {
            Ok(()) => break stream,
            Err(e) => tracing::warn!(
                "ignored a connection to the resume listener: {}",
                crate::error::chain(&e)
            ),
        }
    };
    wire::write_message(
        &mut stream,
        &Message::ResumeFrom {
            map: dest.present_map(),
        },
    )?;
    dest.attach(stream.try_clone()?);
    // One connection; the report of the migration this carries on was taken when it broke.
    let result = dest.receive_pages(&mut stream, Vec::new(), &CpuMeter::default());
    if result.is_err() {
        dest.detach();
    }
    result
}

/// Reads what a source's new connection opens with: it must ask to resume post-copy.
fn open_resume(stream: &mut Stream) -> Result<()> {
    wire::read_stream_header(stream)?;
    let first = match wire::read_frame(stream)? {
        Frame::Message(m) => m,
        Frame::Pages { .. } => {
            return Err(Error::Protocol("a new connection began with pages".into()));
        }
    };
    match first {
        Message::ResumePostcopy => {}
        Message::Abort { reason } => return Err(Error::Peer(reason)),
        m => {
            return Err(Error::Protocol(format!(
                "expected ResumePostcopy on the new connection, got {}",
                m.name()
            )));
        }
    }
    Ok(())
}
