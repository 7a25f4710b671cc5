//! Live update across builds: what live update is for. A VM run by an earlier build of ferry
//! is handed to this build in place (`ferry migrate --local`), and back to the earlier build,
//! its memory verified and its disk read back on each. The earlier build is made from git by
//! `scripts/build-before.sh` (once; it is kept in `target/`): `FERRY_UPDATE_FROM` names the
//! commit, by default `FIRST_WITH_LIVE_UPDATE`, the oldest build that can take part. Two
//! builds whose stream or state versions differ refuse each other before anything moves,
//! naming both versions (`wire::frame::read_stream_header`, `persist`; their tests).

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use api::MigrationPhase;
use common::*;

/// The first commit with live update: every build from it on can hand a VM to this one.
const FIRST_WITH_LIVE_UPDATE: &str = "6cde7bc";

const T: Duration = Duration::from_secs(60);

/// The earlier build's binary, built from git the first time it is asked for.
fn earlier_build() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let commit =
            std::env::var("FERRY_UPDATE_FROM").unwrap_or_else(|_| FIRST_WITH_LIVE_UPDATE.into());
        let root = repo_root();
        let folder = root.join("target").join(format!("update-from-{commit}"));
        let binary = folder.join("ferry");
        if !binary.exists() {
            let out = Command::new(root.join("scripts/build-before.sh"))
                .args([commit.as_str(), folder.to_str().unwrap()])
                .current_dir(&root)
                .output()
                .expect("run scripts/build-before.sh");
            assert!(
                out.status.success(),
                "building ferry as of {commit} failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        binary
    })
}

/// A `run --incoming unix:…` of `binary` and its address.
fn waiting(binary: &std::path::Path, socket: &str, dir: &std::path::Path) -> (Ferry, String) {
    let url = format!("unix:{}", dir.join(socket).display());
    (Ferry::start_as(binary, &["--incoming", &url]), url)
}

#[test]
fn an_earlier_build_hands_its_vm_to_this_one_and_back() {
    if !kvm_available() {
        return;
    }
    let earlier = earlier_build();
    let this = PathBuf::from(FERRY);
    let dir = tempfile::tempdir().unwrap();
    let (_disk, mut vm) = updatable_vm(earlier, dir.path());
    for (to, name, socket) in [
        (&this, "this build", "this.sock"),
        (earlier, "the earlier build", "earlier.sock"),
    ] {
        let (next, url) = waiting(to, socket, dir.path());
        let (report, ok, errors) = migrate(&vm, &url, &["--local", "--checksum"]);
        assert!(ok, "to {name}: {errors}");
        assert_eq!(report.phase, MigrationPhase::Completed, "to {name}");
        assert_eq!(report.pages_full, 0, "to {name}: no page copied");
        assert_eq!(
            report.memory_checksum_source, report.memory_checksum_destination,
            "to {name}"
        );
        assert!(
            vm.wait_exit(T).success(),
            "to {name}: the old process let go"
        );
        assert_carries_on(&next, name);
        vm = next;
    }
}
