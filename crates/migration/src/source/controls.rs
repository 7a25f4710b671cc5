//! What a VM's `Outgoing` shares with the migration it runs (`Session`): the controls others
//! set while it runs, and what an interrupted post-copy still owes, kept for a resume.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use super::checkpoints::Checkpoints;
use crate::bitmap::Bitmap;
use crate::io::transport::Stream;
use crate::params::MigrationParams;

/// What others may ask of a running migration.
#[derive(Default)]
pub struct Controls {
    pub cancel: AtomicBool,
    /// Switch a running pre-copy to post-copy at the next round boundary.
    pub start_postcopy: AtomicBool,
    /// The connection while the source waits for the destination's first answer: a cancel
    /// closes it, as a silent peer would otherwise hold the wait for `IO_TIMEOUT`.
    pub handshake: Mutex<Option<Stream>>,
    /// The migration's connections until `Go`: `wait_ended` shuts them down when a cancelled
    /// migration does not end, blocked in a write to a peer that reads nothing.
    pub connections: Mutex<Vec<Stream>>,
    /// Set as `Go` leaves, under this lock: a cancel either comes first (and `Go` never
    /// leaves) or finds it set and is refused (the VM may run on the destination already).
    pub go_sent: Mutex<bool>,
    /// Set while a pre-copy whose connection broke dials again (see `resume`).
    pub reconnecting: AtomicBool,
    /// Where an operator said to dial next (`vm.migrate-resume` while `reconnecting`).
    pub redial: Mutex<Option<Redial>>,
}

/// Opens a connection to where an operator pointed a reconnecting pre-copy.
pub type Redial = Box<dyn Fn() -> crate::error::Result<Stream> + Send>;

/// What an interrupted post-copy still owes the destination.
#[derive(Clone)]
pub struct Leftover {
    pub pending: Bitmap,
    pub params: MigrationParams,
    /// What the destination sent back so far, when it sends checkpoints.
    pub checkpoints: Option<Arc<Checkpoints>>,
}
