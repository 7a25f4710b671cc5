//! One lifecycle per VM, and the rule every API call goes through: which call is allowed in
//! which state (the table is in docs/api.md). A call refused here gets 409 naming the state.
//! The state comes from the VM's own phase of life (`Phase`) and its migration's status.

use api::{ApiError, ApiRequest};
use migration::{Phase as Migration, Role, Status};

/// Where the VM is in its life, beyond running/paused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for an incoming migration or restoring a snapshot.
    Incoming,
    Live,
    /// The destination runs the VM; this process is about to exit.
    Migrated,
    ShuttingDown,
    Failed(String),
}

/// Where the VM is, as far as what may be done to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    /// Waiting for an incoming migration or a snapshot restore.
    Incoming,
    Running,
    Paused,
    /// An outgoing migration before the switch (setup, rounds).
    Migrating,
    /// An outgoing migration's switch: the VM is paused and handed over; from `Go` on it may
    /// run on the destination before this side hears so.
    Switching,
    /// Post-copy after the switch: the VM runs on the destination, pages still move.
    PostcopySource,
    PostcopyDestination,
    /// Post-copy whose connection broke after the switch (`vm.migrate-resume` carries on).
    PostcopyPausedSource,
    PostcopyPausedDestination,
    /// `Go` was sent and never confirmed: the VM may run on the destination.
    Unconfirmed,
    /// The VM runs on the destination; this process is about to exit.
    Migrated,
    ShuttingDown,
    Failed,
}

impl Lifecycle {
    pub fn name(self) -> &'static str {
        match self {
            Lifecycle::Incoming => "incoming",
            Lifecycle::Running => "running",
            Lifecycle::Paused => "paused",
            Lifecycle::Migrating => "migrating",
            Lifecycle::Switching => "switching over",
            Lifecycle::PostcopySource => "postcopy-active (source)",
            Lifecycle::PostcopyDestination => "postcopy-active (destination)",
            Lifecycle::PostcopyPausedSource => "postcopy-paused (source)",
            Lifecycle::PostcopyPausedDestination => "postcopy-paused (destination)",
            Lifecycle::Unconfirmed => "unconfirmed",
            Lifecycle::Migrated => "migrated",
            Lifecycle::ShuttingDown => "shutting-down",
            Lifecycle::Failed => "failed",
        }
    }

    /// The state as `vm.info` and `ferry status` name it: one word, the migration's phase
    /// names where a migration holds the VM (its role is in `vm.migration`).
    pub fn word(self) -> &'static str {
        match self {
            Lifecycle::Switching => "switching-over",
            Lifecycle::PostcopySource | Lifecycle::PostcopyDestination => "postcopy-active",
            Lifecycle::PostcopyPausedSource | Lifecycle::PostcopyPausedDestination => {
                "postcopy-paused"
            }
            other => other.name(),
        }
    }

    /// Whether the VM's memory is split between two hosts right now.
    pub fn mid_postcopy(self) -> bool {
        matches!(
            self,
            Lifecycle::PostcopySource
                | Lifecycle::PostcopyDestination
                | Lifecycle::PostcopyPausedSource
                | Lifecycle::PostcopyPausedDestination
        )
    }

    /// Whether a stop (shutdown, a signal) must wait: the VM's memory is on two hosts, or
    /// the VM is being handed over and may already run on the destination. The wait ends
    /// with the migration: the VM then runs on one host only, and the stop applies there.
    pub fn holds_stop(self) -> bool {
        self.mid_postcopy() || self == Lifecycle::Switching
    }

    /// The state from the VM's own phase, whether its vCPUs run, and its migration's status.
    pub fn of(vm: Phase, running: bool, migration: &Status) -> Self {
        use Phase as Vm;
        match (vm, (migration.phase, migration.role)) {
            (Vm::Incoming, _) => Lifecycle::Incoming,
            (Vm::ShuttingDown, _) => Lifecycle::ShuttingDown,
            (Vm::Failed(_), _) => Lifecycle::Failed,
            (Vm::Migrated, _) => Lifecycle::Migrated,
            // The migration published its end before the controller heard of it: the VM
            // runs on the destination already, so nothing may resume it here.
            (Vm::Live, _) if migration.moved_away() => Lifecycle::Migrated,
            (Vm::Live, (Migration::Postcopy, Role::Source)) => Lifecycle::PostcopySource,
            (Vm::Live, (Migration::Postcopy, Role::Destination)) => Lifecycle::PostcopyDestination,
            (Vm::Live, (Migration::PostcopyPaused, Role::Source)) => {
                Lifecycle::PostcopyPausedSource
            }
            (Vm::Live, (Migration::PostcopyPaused, Role::Destination)) => {
                Lifecycle::PostcopyPausedDestination
            }
            (Vm::Live, (Migration::Unconfirmed, Role::Source)) => Lifecycle::Unconfirmed,
            (Vm::Live, (Migration::Switchover, Role::Source)) => Lifecycle::Switching,
            (Vm::Live, (Migration::Setup | Migration::Active, Role::Source)) => {
                Lifecycle::Migrating
            }
            (Vm::Live, _) if running => Lifecycle::Running,
            (Vm::Live, _) => Lifecycle::Paused,
        }
    }
}

/// Whether `request` may be served in `state`; 409 naming the state (and why) when not.
pub fn allow(request: &ApiRequest, state: Lifecycle) -> Result<(), ApiError> {
    use Lifecycle::*;
    let ok = match request {
        ApiRequest::VmInfo | ApiRequest::MigrationStatus => true,
        ApiRequest::Pause => matches!(state, Running | Paused),
        ApiRequest::Resume => matches!(state, Paused | Running),
        // Shutting down mid post-copy would lose the VM (its memory is on two hosts); mid
        // switch, it could leave the destination's guest waiting for pages never sent.
        ApiRequest::Shutdown => !state.holds_stop(),
        ApiRequest::SendMigration(_) | ApiRequest::Snapshot(_) => matches!(state, Running | Paused),
        // A cancel in the switch is refused by the migration itself once `Go` left.
        ApiRequest::CancelMigration => {
            matches!(state, Migrating | Switching | PostcopyPausedDestination)
        }
        ApiRequest::StartPostcopy => state == Migrating,
        ApiRequest::MigrateReclaim(_) => matches!(state, Unconfirmed | PostcopyPausedSource),
        ApiRequest::MigrateRollback(_) => state == PostcopyPausedSource,
        ApiRequest::MigrateResume(r) => match (r.listen.is_some(), r.destination.is_some()) {
            (true, false) => state == PostcopyPausedDestination,
            // Migrating: a pre-copy dialling again after its link broke (the handler checks).
            (false, true) => matches!(state, PostcopyPausedSource | Migrating),
            _ => true, // the handler names the malformed body
        },
        ApiRequest::CorruptPage(_) | ApiRequest::DirtyLogging(_) => {
            matches!(state, Running | Paused)
        }
        // A migration skips what the guest gives back meanwhile.
        ApiRequest::Balloon(_) => matches!(state, Running | Paused | Migrating),
    };
    if ok {
        return Ok(());
    }
    if matches!(
        request,
        ApiRequest::CancelMigration | ApiRequest::StartPostcopy
    ) {
        return Err(ApiError::conflict(format!(
            "no migration is running (the VM is {})",
            state.name()
        )));
    }
    if matches!(
        request,
        ApiRequest::MigrateReclaim(_) | ApiRequest::MigrateRollback(_)
    ) {
        return Err(ApiError::conflict(format!(
            "no switch to take back (the VM is {})",
            state.name()
        )));
    }
    if matches!(request, ApiRequest::MigrateResume(_)) {
        return Err(ApiError::conflict(format!(
            "no interrupted post-copy to resume on this side (the VM is {})",
            state.name()
        )));
    }
    let why = match state {
        Unconfirmed | PostcopyPausedSource | PostcopySource => {
            "; the VM may run on the destination, and this could make two copies or lose one"
        }
        PostcopyDestination | PostcopyPausedDestination => {
            "; part of the VM's memory is still on the source"
        }
        Migrating
            if matches!(
                request,
                ApiRequest::SendMigration(_) | ApiRequest::Snapshot(_)
            ) =>
        {
            ": a migration is already running"
        }
        Migrating => ": a migration is running: cancel it first (vm.cancel-migration)",
        Switching if matches!(request, ApiRequest::Shutdown) => {
            ": the VM is being handed over and may run on the destination already; ask \
             again once the switch ends (seconds): it then runs on one host only"
        }
        Switching => ": the VM is being handed over to the destination",
        _ => "",
    };
    Err(ApiError::conflict(format!(
        "not allowed while the VM is {}{why}",
        state.name()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::{MigrateResumeRequest, MigrationRequest};
    use migration::Transfer;

    #[test]
    fn nothing_that_could_make_two_copies_or_lose_one_is_allowed() {
        let send = ApiRequest::SendMigration(MigrationRequest::default());
        for state in [
            Lifecycle::Unconfirmed,
            Lifecycle::PostcopySource,
            Lifecycle::PostcopyPausedSource,
            Lifecycle::PostcopyDestination,
            Lifecycle::PostcopyPausedDestination,
        ] {
            for call in [&ApiRequest::Resume, &send] {
                let e = allow(call, state).unwrap_err();
                assert_eq!(e.status, 409);
                assert!(e.message.contains(state.name()), "{}", e.message);
            }
        }
        for state in [
            Lifecycle::PostcopySource,
            Lifecycle::PostcopyPausedDestination,
        ] {
            assert!(allow(&ApiRequest::Shutdown, state).is_err());
        }
        // The operator's ways out of `unconfirmed`: shutting this copy down (the VM runs
        // there), or taking it back (the destination is down); also after a broken post-copy,
        // never while one runs.
        assert!(allow(&ApiRequest::Shutdown, Lifecycle::Unconfirmed).is_ok());
        assert!(
            allow(
                &ApiRequest::MigrateReclaim(Default::default()),
                Lifecycle::Unconfirmed
            )
            .is_ok()
        );
        assert!(
            allow(
                &ApiRequest::MigrateReclaim(Default::default()),
                Lifecycle::PostcopyPausedSource
            )
            .is_ok()
        );
        for state in [
            Lifecycle::Running,
            Lifecycle::Migrating,
            Lifecycle::PostcopySource,
            Lifecycle::PostcopyPausedDestination,
        ] {
            let e = allow(&ApiRequest::MigrateReclaim(Default::default()), state).unwrap_err();
            assert!(e.message.contains(state.name()), "{}", e.message);
        }
        // A rollback to a post-copy checkpoint: only where post-copy broke, on the source.
        assert!(
            allow(
                &ApiRequest::MigrateRollback(Default::default()),
                Lifecycle::PostcopyPausedSource
            )
            .is_ok()
        );
        for state in [
            Lifecycle::Running,
            Lifecycle::Unconfirmed,
            Lifecycle::PostcopySource,
            Lifecycle::PostcopyPausedDestination,
        ] {
            let e = allow(&ApiRequest::MigrateRollback(Default::default()), state).unwrap_err();
            assert!(e.message.contains(state.name()), "{}", e.message);
        }
        let listen = ApiRequest::MigrateResume(MigrateResumeRequest {
            listen: Some("unix:/x".into()),
            destination: None,
            timeout_s: None,
        });
        assert!(allow(&listen, Lifecycle::PostcopyPausedDestination).is_ok());
        assert!(allow(&listen, Lifecycle::PostcopyPausedSource).is_err());
        assert!(allow(&ApiRequest::CancelMigration, Lifecycle::Running).is_err());
        assert!(allow(&ApiRequest::CancelMigration, Lifecycle::Migrating).is_ok());
        assert!(allow(&ApiRequest::Pause, Lifecycle::Migrating).is_err());
    }

    #[test]
    fn a_switch_holds_stops_and_its_cancel_is_decided_by_the_migration() {
        let e = allow(&ApiRequest::Shutdown, Lifecycle::Switching).unwrap_err();
        assert_eq!(e.status, 409);
        assert!(e.message.contains("handed over"), "{}", e.message);
        assert!(Lifecycle::Switching.holds_stop());
        assert!(!Lifecycle::Migrating.holds_stop());
        assert!(allow(&ApiRequest::Shutdown, Lifecycle::Migrating).is_ok());
        assert!(allow(&ApiRequest::CancelMigration, Lifecycle::Switching).is_ok());
        assert!(allow(&ApiRequest::StartPostcopy, Lifecycle::Switching).is_err());
        assert!(allow(&ApiRequest::Resume, Lifecycle::Switching).is_err());
        // An arriving VM's stop is the arrival's to decide (`Incoming::stop_arrival`).
        assert!(allow(&ApiRequest::Shutdown, Lifecycle::Incoming).is_ok());
    }

    #[test]
    fn the_state_comes_from_the_vm_and_its_migration() {
        use super::Phase as Vm;
        let of = |vm, running, (phase, role): (Migration, Role)| {
            let mode = (role == Role::Source).then_some(Transfer::Precopy);
            let status = Status {
                phase,
                ..Status::new(role, mode, String::new())
            };
            Lifecycle::of(vm, running, &status)
        };
        assert_eq!(
            of(Vm::Live, true, (Migration::None, Role::Source)),
            Lifecycle::Running
        );
        assert_eq!(
            of(Vm::Live, false, (Migration::Failed, Role::Source)),
            Lifecycle::Paused
        );
        assert_eq!(
            of(Vm::Live, false, (Migration::Unconfirmed, Role::Source)),
            Lifecycle::Unconfirmed
        );
        assert_eq!(
            of(Vm::Live, false, (Migration::Switchover, Role::Source)),
            Lifecycle::Switching
        );
        assert_eq!(
            of(Vm::Live, true, (Migration::Active, Role::Source)),
            Lifecycle::Migrating
        );
        assert_eq!(
            of(Vm::Live, true, (Migration::Postcopy, Role::Destination)),
            Lifecycle::PostcopyDestination
        );
        assert_eq!(
            of(Vm::Live, true, (Migration::Completed, Role::Destination)),
            Lifecycle::Running
        );
        assert_eq!(
            of(Vm::Migrated, false, (Migration::Completed, Role::Source)),
            Lifecycle::Migrated
        );
        // Between the source publishing `completed` and the controller marking the VM
        // migrated, the VM must already count as gone: a resume then would run it twice.
        let moved = of(Vm::Live, false, (Migration::Completed, Role::Source));
        assert_eq!(moved, Lifecycle::Migrated);
        assert!(allow(&ApiRequest::Resume, moved).is_err());
        // After a snapshot the VM stays here, paused or running as it was.
        let snapshot = Status {
            phase: Migration::Completed,
            ..Status::new(Role::Source, Some(Transfer::Snapshot), "file".into())
        };
        assert_eq!(Lifecycle::of(Vm::Live, false, &snapshot), Lifecycle::Paused);
        assert_eq!(Lifecycle::of(Vm::Live, true, &snapshot), Lifecycle::Running);
    }
}
