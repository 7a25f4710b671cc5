//! The `ferry` command: run a VM, drive and watch it through its API.

mod balloon;
mod certs;
mod ch;
mod cli;
mod confine;
mod controller;
mod dirty_bench;
mod follow;
mod lifecycle;
mod metrics;
mod migrate;
mod migration_requests;
mod migrations;
mod report;
mod run;
mod status;

use std::io::IsTerminal;

use clap::Parser;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person's terminal, never into a log file.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if ch::invoked_as_ch() {
        let argv: Vec<String> = std::env::args().skip(1).collect();
        finish(ch::main(&argv));
    }
    let args = cli::Cli::parse();
    let result = match args.command {
        cli::Command::Run(run_args) => run::run(*run_args),
        cli::Command::Status(a) => status::status(&a),
        cli::Command::Pause(a) => status::simple_put(&a, "vm.pause"),
        cli::Command::Resume(a) => status::simple_put(&a, "vm.resume"),
        cli::Command::Shutdown(a) => status::simple_put(&a, "vm.shutdown"),
        cli::Command::Migrate(a) => migrate::migrate(&a),
        cli::Command::Migration(a) => migrate::migration(&a),
        cli::Command::Cancel(a) => migrate::cancel(&a),
        cli::Command::StartPostcopy(a) => status::start_postcopy(&a),
        cli::Command::MigrateReclaim(a) => status::take_back(&a, "vm.migrate-reclaim"),
        cli::Command::MigrateRollback(a) => status::take_back(&a, "vm.migrate-rollback"),
        cli::Command::Snapshot(a) => migrate::snapshot(&a),
        cli::Command::MigrateResume(a) => status::migrate_resume(&a),
        cli::Command::Certs(a) => certs::certs(&a),
        cli::Command::Balloon(a) => status::balloon(&a),
        cli::Command::Ch(a) => ch::main(&a.args),
    };
    finish(result)
}

fn finish(result: anyhow::Result<i32>) -> ! {
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // Each error in the chain says what failed; `:#` adds each cause once.
            eprintln!("ferry: error: {e:#}");
            std::process::exit(1);
        }
    }
}
