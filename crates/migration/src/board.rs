//! Where a migration's status is published (`StatusBoard`): the task that runs a migration
//! writes whole snapshots of its `Status`, readers (the API, metrics) read them, with the
//! totals of the migrations that ended.

use crate::sync::Locked;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::status::{CheckpointStats, GuestAfter, Phase, Status};
use crate::totals::Totals;

/// Where the migration task publishes its status and readers read it. Only the task that
/// runs a migration writes, and only whole snapshots; checkpoint figures, which threads of
/// their own keep while post-copy runs, live beside it and join it when it is read.
#[derive(Clone, Debug, Default)]
pub struct StatusBoard {
    status: Arc<Mutex<Status>>,
    /// Told of every status published, for those who wait for a phase (`wait_while`).
    published: Arc<Condvar>,
    checkpoints: Arc<Mutex<Option<CheckpointStats>>>,
    /// What the guest lived through, measured on the destination a moment after the VM ran
    /// there: it arrives after the migration completed, from a thread of its own.
    guest_after: Arc<Mutex<GuestAfter>>,
    /// Taken after `status`, under it: a reader of both sees a run in one or the other.
    totals: Arc<Mutex<Totals>>,
}

impl StatusBoard {
    /// A new migration's first status: what lived beside the last one's is forgotten.
    pub fn begin(&self, s: &Status) {
        self.forget_side();
        self.publish(s);
    }

    /// Forgets the checkpoint figures and the guest's, which belong to one migration.
    pub fn forget_side(&self) {
        *self.checkpoints.locked() = None;
        *self.guest_after.locked() = GuestAfter::Unknown;
    }

    pub fn publish(&self, s: &Status) {
        let mut status = self.status.locked();
        self.totals.locked().count(s);
        *status = s.clone();
        self.published.notify_all();
    }

    /// Waits while the published phase is one `waiting` holds, for at most `limit`; the phase
    /// it ends on.
    pub fn wait_while(&self, waiting: impl Fn(Phase) -> bool, limit: Duration) -> Phase {
        let deadline = Instant::now() + limit;
        let mut status = self.status.locked();
        while waiting(status.phase) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            status = self
                .published
                .wait_timeout(status, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        status.phase
    }

    /// The status, and the totals of the migrations that ended, read together: a migration
    /// that just ended shows in the totals and as the (ended) status, never twice as running.
    pub fn read_with_totals(&self) -> (Status, Totals) {
        let status = self.status.locked();
        let totals = self.totals.locked().clone();
        let mut s = status.clone();
        drop(status);
        self.join(&mut s);
        (s, totals)
    }

    pub fn read(&self) -> Status {
        let mut s = self.status.locked().clone();
        self.join(&mut s);
        s
    }

    /// Adds what lives beside the status to a copy of it.
    fn join(&self, s: &mut Status) {
        s.checkpoints = self.checkpoints.locked().clone();
        let after = *self.guest_after.locked();
        s.report.guest_report_pending = after == GuestAfter::Pending;
        if let GuestAfter::Seen {
            observed_downtime,
            pages_per_s_after,
        } = after
        {
            s.report.guest_observed_downtime = observed_downtime;
            s.report.guest_pages_per_s_after = pages_per_s_after;
        }
    }

    /// Says what is known of the guest after the switch (see `GuestAfter`).
    pub fn guest_after(&self, after: GuestAfter) {
        *self.guest_after.locked() = after;
    }

    /// Changes the checkpoint figures (`None`: no checkpoints in this migration).
    pub fn checkpoints(&self, f: impl FnOnce(&mut Option<CheckpointStats>)) {
        f(&mut self.checkpoints.locked());
    }

    pub fn phase(&self) -> Phase {
        self.status.locked().phase
    }
}
