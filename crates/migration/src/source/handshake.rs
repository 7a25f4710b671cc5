//! The first phase: the stream header and `Hello`, the destination's `Ready`, the extra
//! connections. Hands the rounds what the two sides agreed.

use crate::sync::Locked;
use std::os::fd::RawFd;
use std::time::Duration;

use super::lane;
use super::machine::Event;
use super::session::Session;
use crate::error::{Error, Result};
use crate::host::HostId;
use crate::wire::{self, Message, StreamMode};

/// What the handshake settled, for the phases after it.
pub(super) struct Agreed {
    /// The destination said it can take post-copy.
    pub peer_postcopy: bool,
    /// The connection's shortest round trip, where TCP says it.
    pub round_trip: Option<Duration>,
}

impl Session<'_> {
    pub(super) fn handshake(&mut self, mode: StreamMode) -> Result<Agreed> {
        let vm = self.vm.descriptor();
        let version = match mode {
            StreamMode::Local => {
                // Nothing goes to a stranger, not the VM's Hello, not an Abort.
                if let Err(e) = self.stream.check_peer_is_own() {
                    self.stream.shutdown();
                    return Err(e);
                }
                // A VM with no config of its profile moves in place to builds that predate
                // `Config` too.
                match vm.config {
                    Some(_) => wire::frame::CONFIG_SINCE,
                    None => wire::frame::LOCAL_SINCE,
                }
            }
            _ => wire::frame::VERSION,
        };
        wire::frame::write_stream_header_as(&mut self.stream, version)?;
        let connections = self.connections();
        self.status.connections = connections;
        self.status.migration_threads = (0..connections)
            .map(|lane| self.params.packers_of(lane) as u32)
            .sum();
        // A live migration is named for a resume too; a file only for its writers.
        let session = if connections > 1 || self.stream.has_peer() {
            lane::session_id()?
        } else {
            0
        };
        self.session_id = session;
        let config = vm.config.clone();
        self.send(&Message::Hello {
            vm,
            mode,
            source: format!("ferry {}", env!("CARGO_PKG_VERSION")),
            connections,
            session,
        })?;
        if mode == StreamMode::Local {
            self.pass_files()?;
        }
        if version >= wire::frame::CONFIG_SINCE {
            self.send(&Message::Config { config })?;
        }
        if version >= wire::frame::STORAGE_SINCE {
            self.announce_storage()?;
        }
        if !self.stream.has_peer() {
            if connections > 1 {
                self.open_lanes(session)?;
            }
            self.step(Event::StartRounds)?;
            return Ok(Agreed {
                peer_postcopy: false,
                round_trip: None,
            });
        }
        let (peer_postcopy, peer_host) = self.hear_ready()?;
        if peer_host.is_some() && peer_host == crate::host::this_host() {
            // Before the extra connections open: they learn it from this one.
            lane::to_this_host(self.params, &mut self.pages);
        }
        if self.params.mode.wants_postcopy() && !peer_postcopy {
            return Err(Error::Param(
                "the destination cannot take post-copy (no userfaultfd there)".into(),
            ));
        }
        self.lap("handshake");
        let round_trip = self.stream.tcp_path().map(|(_, rtt)| rtt);
        if let Some(rtt) = round_trip {
            self.stream.fit_send_buffer(rtt);
        }
        if connections > 1 {
            self.open_lanes(session)?;
            self.lap("extra connections");
        }
        Ok(Agreed {
            // Disk blocks go before the switch: a switch to post-copy would leave them behind.
            peer_postcopy: peer_postcopy && !self.params.copy_storage,
            round_trip,
        })
    }

    /// A live update: guest memory's files and the devices' pass to the destination, which
    /// builds the VM on them before its `Ready`.
    fn pass_files(&mut self) -> Result<()> {
        let memory = self.ram.files();
        let memory: Vec<RawFd> = memory
            .iter()
            .copied()
            .collect::<Option<_>>()
            .ok_or_else(|| Error::Param(super::ANONYMOUS_MEMORY.into()))?;
        let devices = self.vm.device_files();
        self.send(&Message::Files {
            memory: memory.len() as u32,
            devices: devices.iter().map(Option::is_some).collect(),
        })?;
        let all: Vec<RawFd> = memory
            .into_iter()
            .chain(devices.into_iter().flatten())
            .collect();
        self.stream.send_files(&all)?;
        self.lap("files passed");
        Ok(())
    }

    /// Which disks this stream carries (`copy_storage`), logging their writes from here on:
    /// the destination checks and locks its own before its `Ready`.
    fn announce_storage(&mut self) -> Result<()> {
        if self.params.copy_storage && !self.stream.has_peer() {
            return Err(Error::Param(
                "copy_storage moves disks to a destination that writes them; a snapshot \
                 file holds memory and state only"
                    .into(),
            ));
        }
        self.start_disk_copy()?;
        let disks = self
            .held
            .disks
            .as_ref()
            .map_or_else(Vec::new, |copy| copy.slots());
        self.send(&Message::Storage { disks })
    }

    /// How many connections (or lanes of a file) the migration uses: a file takes lanes only
    /// when laid out for them.
    fn connections(&self) -> u32 {
        if self.stream.has_peer() || self.dial.is_some() {
            self.params.connections.max(1)
        } else {
            1
        }
    }

    /// The destination's `Ready`: whether it can take post-copy, and which host it is on.
    fn hear_ready(&mut self) -> Result<(bool, Option<HostId>)> {
        // A cancel now closes the connection (see `Controls::handshake`); one that came
        // before is seen here.
        *self.controls.handshake.locked() = self.stream.try_clone().ok();
        let ready = self
            .check_continue()
            .and_then(|()| self.hear())
            .map_err(|e| match e {
                // Whatever answered is no ferry destination (an HTTP server, another service).
                Error::Protocol(why) => Error::Protocol(format!(
                    "the destination's first answer is not ferry's ({why}): is a ferry \
                     --incoming listening there?"
                )),
                e => e,
            });
        *self.controls.handshake.locked() = None;
        self.cancel_closes(&self.stream);
        let (postcopy, host) = match ready? {
            Message::Ready { postcopy, host } => (postcopy, host),
            // The state machine (`check_continue`'s step) lets nothing else through.
            _ => (false, None),
        };
        self.status.destination_supports_postcopy = Some(postcopy);
        Ok((postcopy, host))
    }
}
