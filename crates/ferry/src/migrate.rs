//! `ferry migrate` and `ferry snapshot`: start through the API, show live progress, print the
//! report. Ctrl-C cancels the migration (the VM keeps running on the source). `ferry
//! migration` and `ferry cancel` look at (or end) one already started.

use anyhow::{Context, Result};
use api::{
    ApiClient, AutoConvergeField, MigrationPhase, MigrationRequest, MigrationStatus,
    SnapshotRequest,
};

use crate::cli::{CancelArgs, MigrateArgs, SnapshotArgs, WatchArgs};
use crate::follow::{self, OnInterrupt};

pub fn migrate(args: &MigrateArgs) -> Result<i32> {
    let client = ApiClient::new(&args.api_socket);
    let request = MigrationRequest {
        destination: args.to.clone(),
        mode: Some(if args.local {
            "local".into()
        } else {
            args.mode.clone()
        }),
        max_downtime_ms: Some(args.max_downtime_ms),
        max_bandwidth_mbps: args.max_bandwidth_mbps,
        max_rounds: Some(args.max_rounds),
        timeout_s: Some(args.timeout_s),
        checksum: Some(args.checksum),
        auto_postcopy: Some(args.auto_postcopy),
        auto_converge: args.auto_converge.clone().map(AutoConvergeField::Named),
        prepaging: args.prepaging.clone(),
        connections: args.connections,
        compression: args.compression.clone(),
        migration_threads: args.migration_threads,
        delta_cache_mb: args.delta_cache_mb,
        checkpoint_ms: args.checkpoint_ms,
        resume_window_s: args.resume_window_s,
        go_with_state: args.go_with_state,
        copy_storage: args.copy_storage.then_some(true),
    };
    client
        .put("vm.send-migration", Some(&serde_json::to_value(&request)?))
        .context("the migration did not start")?;
    let last = follow::follow(&client, args.json, OnInterrupt::Cancel)?;
    follow::finish(&last, args.json, &args.api_socket)
}

pub fn snapshot(args: &SnapshotArgs) -> Result<i32> {
    let client = ApiClient::new(&args.api_socket);
    let body = SnapshotRequest {
        file: args.to.display().to_string(),
        compression: args.compression.clone(),
        migration_threads: args.migration_threads,
        writers: args.writers,
    };
    let v = client
        .put("vm.snapshot", Some(&serde_json::to_value(&body)?))
        .context("snapshot failed")?;
    let status: MigrationStatus = serde_json::from_value(v)?;
    if status.phase == MigrationPhase::Completed && !args.json {
        eprintln!(
            "the VM stays paused here: `ferry resume` runs it on, `ferry shutdown` ends it once \
             the snapshot is its home"
        );
    }
    follow::finish(&status, args.json, &args.api_socket)
}

/// `ferry migration`: the VM's migration (either side, any time); with `--watch`, followed
/// until it ends and the guest's own figures are in.
pub fn migration(args: &WatchArgs) -> Result<i32> {
    let client = ApiClient::new(&args.api_socket);
    let mut status: MigrationStatus =
        serde_json::from_value(client.get("vm.migration")?).context("vm.migration body")?;
    if args.watch {
        // A destination (or a restore) whose VM has not begun to arrive: its move is to come.
        if status.phase == MigrationPhase::None {
            status = follow::until_arriving(&client)?;
        }
        if status.phase.is_running() {
            status = follow::follow(&client, args.json, OnInterrupt::Leave)?;
        }
        status = follow::with_guest_figures(&client, status);
    }
    if status.phase == MigrationPhase::None && !args.json {
        println!("no migration has run on this VM");
        return Ok(0);
    }
    if status.phase.is_running() && !args.json {
        println!("{}", crate::report::progress_line(&status));
        return Ok(0);
    }
    follow::finish(&status, args.json, &args.api_socket)
}

/// `ferry cancel`: cancels the running migration and follows it to its end. One past `Go`
/// cannot be cancelled: it is followed to its end all the same, and exits as it ended.
pub fn cancel(args: &CancelArgs) -> Result<i32> {
    let client = ApiClient::new(&args.api_socket);
    if let Err(refused) = client.put("vm.cancel-migration", None) {
        let now: MigrationStatus =
            serde_json::from_value(client.get("vm.migration")?).context("vm.migration body")?;
        if !now.phase.is_running() && now.phase != MigrationPhase::Completed {
            return Err(refused).context("the migration was not cancelled");
        }
        eprintln!("too late to cancel: the VM is being handed over ({refused:#})");
    }
    let last = follow::follow(&client, args.json, OnInterrupt::Leave)?;
    follow::finish(&last, args.json, &args.api_socket)
}
