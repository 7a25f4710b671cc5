//! Where a migration's status is published (`StatusBoard`): the task that runs a migration
//! writes whole snapshots of its `Status`, readers (the API, metrics) read them, with the
//! totals of the migrations that ended.

use crate::sync::Locked;
use std::sync::{Arc, Mutex};

use crate::status::{CheckpointStats, Phase, Status};
use crate::totals::Totals;

/// Where the migration task publishes its status and readers read it. Only the task that
/// runs a migration writes, and only whole snapshots; checkpoint figures, which threads of
/// their own keep while post-copy runs, live beside it and join it when it is read.
#[derive(Clone, Debug, Default)]
pub struct StatusBoard {
    status: Arc<Mutex<Status>>,
    checkpoints: Arc<Mutex<Option<CheckpointStats>>>,
    /// Taken after `status`, under it: a reader of both sees a run in one or the other.
    totals: Arc<Mutex<Totals>>,
}

impl StatusBoard {
    pub fn publish(&self, s: &Status) {
        let mut status = self.status.locked();
        self.totals.locked().count(s);
        *status = s.clone();
    }

    /// The status, and the totals of the migrations that ended, read together: a migration
    /// that just ended shows in the totals and as the (ended) status, never twice as running.
    pub fn read_with_totals(&self) -> (Status, Totals) {
        let status = self.status.locked();
        let totals = self.totals.locked().clone();
        let mut s = status.clone();
        drop(status);
        s.checkpoints = self.checkpoints.locked().clone();
        (s, totals)
    }

    pub fn read(&self) -> Status {
        let mut s = self.status.locked().clone();
        s.checkpoints = self.checkpoints.locked().clone();
        s
    }

    /// Changes the checkpoint figures (`None`: no checkpoints in this migration).
    pub fn checkpoints(&self, f: impl FnOnce(&mut Option<CheckpointStats>)) {
        f(&mut self.checkpoints.locked());
    }

    pub fn phase(&self) -> Phase {
        self.status.locked().phase
    }
}
