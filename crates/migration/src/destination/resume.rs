//! Carrying a pre-copy on after its connection broke before the switch: the VM never ran
//! here, and its memory holds what landed. The destination keeps listening where the source
//! first came, for as long as the source said it tries (`ResumeWindow`), for a connection
//! that opens with `ResumePrecopy` naming this migration; it answers with the copies of each
//! page that landed (`CopiesHeld`), and of each disk block where disks move (`BlocksHeld`),
//! and the conversation goes on over it. Anything else that connects meanwhile is told why
//! it is turned away.

use std::time::{Duration, Instant};

use super::arrival::{Filling, Hello};
use super::receive::Receiver;
use crate::error::{Error, Result};
use crate::io::gate::Gate;
use crate::io::transport::{IO_TIMEOUT, Stream};
use crate::wire::{self, Message};

/// How much longer than the source's window the destination waits: the source's last try
/// may start as its window closes.
const LAST_TRY: Duration = Duration::from_secs(10);

/// How the status note begins while the destination waits for the source to carry on.
pub const WAITING: &str = "the connection broke";

impl Receiver<'_> {
    /// Waits for the source to carry the migration on; replaces `stream` with the new
    /// connection. `cut`: why the old one ended, the error if none comes.
    pub(super) fn await_resume(
        &mut self,
        filling: &Filling,
        stream: &mut Stream,
        hello: &Hello,
        cut: Error,
    ) -> Result<()> {
        let (Some(listener), Some(window)) = (self.listener.as_ref(), filling.resume_window())
        else {
            return Err(cut);
        };
        let wait = window + LAST_TRY;
        self.status.note = Some(format!(
            "{WAITING} ({}); waiting up to {} s for the source to carry on",
            cut.report(),
            wait.as_secs()
        ));
        self.board.publish(&self.status);
        let until = Instant::now() + wait;
        let gate = Gate::new(listener)?;
        let stop = || (self.stop)() || self.handover.check().is_err() || Instant::now() > until;
        loop {
            let Some(opened) = gate.next(&stop)? else {
                self.check_stop()?;
                return Err(Error::transport(
                    format!(
                        "the connection broke ({}) and the source did not carry on within {} s",
                        cut.report(),
                        wait.as_secs()
                    ),
                    std::io::Error::from(std::io::ErrorKind::TimedOut),
                ));
            };
            let stranger = filling.peer().refuses(&opened.stream);
            match opened.first {
                Message::ResumePrecopy { session }
                    if session == hello.session && stranger.is_some() =>
                {
                    let why = stranger.unwrap_or_default();
                    opened.refuse(format!("not a connection of this migration's peer: {why}"));
                }
                Message::ResumePrecopy { session } if session == hello.session => {
                    let (mut new, _) = opened.admit();
                    new.set_timeouts(Some(IO_TIMEOUT))?;
                    let held = filling.copies_held().expect("a resumable filling counts");
                    wire::write_message(&mut new, &held)?;
                    if let Some(blocks) = filling.blocks_held() {
                        wire::write_message(&mut new, &blocks)?;
                    }
                    // Said before the old connection closes: whoever sees it close finds
                    // the migration carried on.
                    self.status.report.resumes += 1;
                    self.status.note = Some("the source carried the migration on".into());
                    self.board.publish(&self.status);
                    *stream = new;
                    return Ok(());
                }
                Message::ResumePrecopy { .. } => {
                    opened.refuse("a resume of another migration".into());
                }
                ref other => {
                    let why = format!(
                        "a migration is arriving here already (its connection broke; waiting \
                         for its source to carry it on), not {}",
                        other.name()
                    );
                    opened.refuse(why);
                }
            }
        }
    }
}
