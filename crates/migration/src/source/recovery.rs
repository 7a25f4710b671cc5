//! Carrying on a post-copy whose connection dropped after the switch (the destination's half
//! is `destination::recovery`): connect to the destination's new listener, learn which pages
//! it has, send the rest.

use super::controls::Leftover;
use super::lane::DEFAULT_BATCH_PAGES;
use super::postcopy::{Outlet, serve, spawn_reader};
use crate::bitmap::Bitmap;
use crate::board::StatusBoard;
use crate::cpu::CpuMeter;
use crate::error::{Error, Result};
use crate::io::tls::Tls;
use crate::io::transport::Endpoint;
use crate::pages::PageSender;
use crate::ratelimit::RateLimiter;
use crate::status::{Phase, Status};
use crate::vm::Migratable;
use crate::wire::{self, Message};

/// Sends the pages of `left` the destination at `endpoint` does not have yet. `status` is
/// the interrupted migration's, carried on.
pub(crate) fn resume(
    vm: &dyn Migratable,
    endpoint: &Endpoint,
    tls: Option<&Tls>,
    left: &Leftover,
    board: &StatusBoard,
    mut status: Status,
) -> Result<Status> {
    let ram = vm.ram();
    let mut stream = endpoint.connect(tls)?;
    wire::write_stream_header(&mut stream)?;
    wire::write_message(&mut stream, &Message::ResumePostcopy)?;
    let here = match wire::read_message(&mut stream)? {
        Message::ResumeFrom { map } => {
            if map.word_count() as u64 != ram.gfn_end().div_ceil(64) {
                return Err(Error::Protocol(format!(
                    "the destination's page map has {} words for {} pages",
                    map.word_count(),
                    ram.gfn_end()
                )));
            }
            let mut here = Bitmap::new(ram.gfn_end());
            here.merge(&map);
            here
        }
        other => {
            return Err(Error::Protocol(format!(
                "expected ResumeFrom from the destination, got {}",
                other.name()
            )));
        }
    };
    let mut todo = left.pending.clone();
    for gfn in here.iter() {
        todo.unset(gfn);
    }
    status.phase = Phase::Postcopy;
    status.error = None;
    status.progress.pages_remaining = todo.count();
    board.publish(&status);
    let events = spawn_reader(stream.try_clone()?, left.checkpoints.clone())?;
    let mut limiter = RateLimiter::new(left.params.max_bandwidth_mbps);
    let mut sender = PageSender::new(limiter.batch_pages(DEFAULT_BATCH_PAGES));
    sender.checked = true; // the source guest is paused for good
    let base = status.progress.pages;
    let outlet = Outlet {
        stream: &mut stream,
        ram: &ram,
        limiter: &mut limiter,
        sender: &mut sender,
        events: &events,
        lanes: &mut [],
        checkpoints: left.checkpoints.is_some(),
        // One connection, on this thread: no lane to track.
        cpu: &CpuMeter::default(),
    };
    let (served, report) = serve(
        outlet,
        todo,
        left.params.prepaging,
        |msg| match msg {
            Message::PageRequest { .. }
            | Message::Taken { .. }
            | Message::PostcopyComplete(_)
            | Message::GuestReport { .. }
            | Message::Checkpoint { .. } => Ok(()),
            other => Err(Error::Protocol(format!(
                "the destination sent {} during a resumed post-copy",
                other.name()
            ))),
        },
        |s, left| {
            status.progress.pages.pushed = base.pushed + s.pushed;
            status.progress.pages.requested = base.requested + s.requested;
            status.progress.pages_remaining = left;
            board.publish(&status);
        },
    )?;
    let p = &mut status.progress;
    p.pages.pushed = base.pushed + served.pushed;
    p.pages.requested = base.requested + served.requested;
    p.pages.full += sender.counters.full;
    p.pages.zero += sender.counters.zero;
    p.bytes_on_wire += sender.counters.bytes;
    status.report.memory_checksum_destination = report.memory_checksum;
    status.report.postcopy_report = Some(report);
    status.phase = Phase::Completed;
    status.note = Some("post-copy resumed over a new connection".into());
    board.publish(&status);
    Ok(status)
}
