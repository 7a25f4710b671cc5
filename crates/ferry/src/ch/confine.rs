//! What `ferry ch --landlock` may reach: the files and sockets its flags name, the
//! `--allow-disk-dir` directories (an arriving VM's files lie there), and `--landlock-rules`.
//! A VM created later through the API may use only files beneath these.

use std::path::Path;

use anyhow::Result;
use api::ch::{ConsoleMode, VmSpec};
use vmm::landlock::{self, Rule};

use super::cli::{ChArgs, Target};
use crate::confine::output_file;
use crate::metrics::MetricsAddr;

pub fn rules(args: &ChArgs) -> Result<Vec<Rule>> {
    let mut rules = landlock::ferry_needs();
    rules.extend(args.allow_disk_dirs.iter().map(Rule::read_write));
    if let Some(Target::Path(socket)) = &args.api_socket {
        rules.push(Rule::socket(socket));
    }
    if let Some(Target::Path(file)) = &args.event_monitor {
        rules.push(output_file(file)?);
    }
    if let Some(MetricsAddr::Unix(socket)) = &args.metrics {
        rules.push(Rule::socket(socket));
    }
    rules.extend(args.metrics_token_file.iter().map(Rule::read));
    if let Some(spec) = &args.spec {
        rules.extend(vm_rules(spec)?);
    }
    if let Some(serial) = &args.arrival_serial {
        rules.extend(console_rule(serial)?);
    }
    // A missing path the flags name is said by what opens it, later.
    rules.retain(|r| r.path.exists());
    rules.extend(args.landlock_rules.iter().cloned());
    Ok(rules)
}

/// The VM of `--kernel`: its payload, disks and console files.
fn vm_rules(spec: &VmSpec) -> Result<Vec<Rule>> {
    let payload = std::iter::once(&spec.kernel).chain(&spec.initramfs);
    let mut rules: Vec<Rule> = payload.map(Rule::read).collect();
    rules.extend(spec.disks.iter().map(|d| match d.readonly {
        true => Rule::read(&d.path),
        false => Rule::read_write(&d.path),
    }));
    for console in [&spec.serial, &spec.console] {
        rules.extend(console_rule(console)?);
    }
    Ok(rules)
}

fn console_rule(mode: &ConsoleMode) -> Result<Option<Rule>> {
    Ok(match mode {
        ConsoleMode::File(f) => Some(output_file(Path::new(f))?),
        ConsoleMode::Socket(s) => Some(Rule::socket(Path::new(s))),
        ConsoleMode::Off | ConsoleMode::Tty | ConsoleMode::Pty(_) => None,
    })
}
