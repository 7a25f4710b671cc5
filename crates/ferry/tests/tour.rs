//! The README's CLI tour, run as written (`scripts/tour.sh`): a newcomer's first commands
//! cannot go stale.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

#[test]
fn the_readme_tour_runs_as_written() {
    if !kvm_available() {
        return;
    }
    let bin_dir = Path::new(FERRY).parent().unwrap();
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/tour.sh"))
        .env("FERRY_BIN_DIR", bin_dir)
        .current_dir(repo_root())
        .output()
        .expect("run scripts/tour.sh");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    assert!(said.contains("tour: every step ran as the README says"));
    assert!(!said.contains("the sandbox refused"), "{said}");
    // The tour's own checks ran: the live migration's report and the guest's own figures.
    for seen in [
        "migration completed",
        "downtime (guest-observed)",
        "post-copy:",
    ] {
        assert!(said.contains(seen), "{seen} not in\n{said}");
    }
}
