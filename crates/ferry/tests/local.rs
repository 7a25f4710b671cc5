//! Live update in place: the VM handed to another ferry process on the same host
//! (`ferry migrate --local` to `unix:PATH`), its memory (a memfd) and its disk's open file
//! passed over the socket, no page copied. The guest writes memory it verifies and stamps
//! disk sectors it reads back; the new process must carry both on, the disk's lock must never
//! lapse, and any failure before `Go` must leave the VM running in the old process.

mod common;

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Duration;

use api::MigrationPhase;
use common::*;
use migration::io::transport::Stream;
use migration::wire::{self, Message};

const T: Duration = Duration::from_secs(60);

/// A VM that can be updated in place, run by this build.
fn updatable(dir: &Path) -> (PathBuf, Ferry) {
    updatable_vm(Path::new(FERRY), dir)
}

/// A `ferry run --incoming unix:…` (nothing else: the VM brings its memory and devices) and
/// its address.
fn new_process() -> (Ferry, String) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("unix:{}", dir.path().join("update.sock").display());
    let ferry = Ferry::incoming(&url);
    // The socket's folder lives as long as the process's own scratch folder would.
    std::mem::forget(dir);
    (ferry, url)
}

#[test]
fn a_live_update_passes_memory_and_disk_and_copies_no_page() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (path, mut old) = updatable(dir.path());
    let (mut new, url) = new_process();
    let (report, ok, errors) = migrate(&old, &url, &["--local", "--checksum"]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert_eq!(report.mode, "local");
    assert_eq!(
        (report.pages_full, report.pages_zero),
        (0, 0),
        "no page sent"
    );
    // What crossed the socket is the vCPU and device state, and the handshake.
    assert!(
        report.bytes_on_wire > 0 && report.bytes_on_wire < 1 << 20,
        "{} bytes",
        report.bytes_on_wire
    );
    assert!(report.memory_checksum_source.is_some());
    assert_eq!(
        report.memory_checksum_source, report.memory_checksum_destination,
        "the new process maps the very memory"
    );
    assert!(old.wait_exit(T).success(), "the old process let go");
    assert_second_writer_refused(&path);
    assert_carries_on(&new, "after the update");

    // Updated once, it can be updated again.
    let (newer, url) = new_process();
    let (report, ok, errors) = migrate(&new, &url, &["--local"]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(new.wait_exit(T).success());
    assert_carries_on(&newer, "after a second update");
}

#[test]
fn what_a_live_update_cannot_do_is_refused_and_the_vm_runs_on() {
    if !kvm_available() {
        return;
    }
    // Anonymous memory cannot be passed.
    let anonymous = Ferry::writer("write ws=16M seq verify");
    let (_new, url) = new_process();
    let (_, ok, errors) = migrate(&anonymous, &url, &["--local"]);
    assert!(!ok);
    assert!(errors.contains("--memory-backend memfd"), "{errors}");
    assert_eq!(anonymous.info().state, "running");
    drop(anonymous);

    let dir = tempfile::tempdir().unwrap();
    let (_path, vm) = updatable(dir.path());
    for (args, why) in [
        (vec!["--local"], "unix:PATH"),
        (vec!["--local", "--connections", "2"], "connections"),
        (vec!["--local", "--mode", "warm"], "cannot be used with"),
    ] {
        let (_, ok, errors) = migrate(&vm, "tcp:127.0.0.1:9", &args);
        assert!(!ok, "{args:?}");
        assert!(errors.contains(why), "{args:?}: {errors}");
    }
    // A destination that built a VM of its own cannot take this one's memory.
    let sock = vm.scratch("prepared.sock");
    let url = format!("unix:{}", sock.display());
    let _prepared = Ferry::start(&["--incoming", &url, "--memory", "256M"]);
    let (_, ok, errors) = migrate(&vm, &url, &["--local"]);
    assert!(!ok);
    assert!(errors.contains("--incoming alone"), "{errors}");
    assert_carries_on(&vm, "after the refusals");
}

/// How far a stand-in destination goes before it stops answering.
#[derive(Clone, Copy, Debug)]
enum Until {
    /// It takes the files, then closes.
    Files,
    /// It answers `Ready`, takes the state, then closes (the source paused, never said `Go`).
    State,
    /// It answers `Loaded`, hears `Go`, then closes without `Resumed`.
    Go,
}

/// A destination that follows the live update's conversation up to `until` and then dies:
/// returns the files it was passed, counted.
fn stand_in(listener: UnixListener, until: Until) -> JoinHandle<usize> {
    std::thread::spawn(move || {
        let (socket, _) = listener.accept().unwrap();
        let mut s = Stream::Unix(socket);
        wire::read_stream_header(&mut s).unwrap();
        let Message::Hello { mode, .. } = wire::read_message(&mut s).unwrap() else {
            panic!("no Hello")
        };
        assert_eq!(mode, wire::StreamMode::Local);
        let Message::Files { memory, devices } = wire::read_message(&mut s).unwrap() else {
            panic!("no Files")
        };
        let count = memory as usize + devices.iter().filter(|&&d| d).count();
        let files = s.receive_files(count).unwrap().len();
        if let Until::Files = until {
            return files;
        }
        wire::write_message(
            &mut s,
            &Message::Ready {
                postcopy: false,
                host: None,
            },
        )
        .unwrap();
        while !matches!(
            wire::read_message(&mut s).unwrap(),
            Message::StateEnd { .. }
        ) {}
        if let Until::State = until {
            return files;
        }
        let loaded = Message::Loaded {
            memory_checksum: None,
        };
        wire::write_message(&mut s, &loaded).unwrap();
        assert_eq!(wire::read_message(&mut s).unwrap(), Message::Go);
        files
    })
}

#[test]
fn a_new_process_that_dies_before_go_leaves_the_vm_and_its_disk_in_the_old() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (path, vm) = updatable(dir.path());
    for until in [Until::Files, Until::State] {
        let sock = dir.path().join(format!("{until:?}.sock"));
        let listener = UnixListener::bind(&sock).unwrap();
        let destination = stand_in(listener, until);
        let (_, ok, errors) = migrate(&vm, &format!("unix:{}", sock.display()), &["--local"]);
        // 256 MiB of RAM is one range, and there is one disk: two files passed.
        assert_eq!(destination.join().unwrap(), 2, "{until:?}");
        assert!(!ok, "{until:?}");
        assert!(errors.contains("stream truncated"), "{until:?}: {errors}");
        assert_second_writer_refused(&path);
        assert_carries_on(&vm, &format!("{until:?}"));
    }
    // Past `Go`, the old process cannot know whether the new one runs the VM: it waits, paused,
    // for an operator who does.
    let sock = dir.path().join("go.sock");
    let destination = stand_in(UnixListener::bind(&sock).unwrap(), Until::Go);
    let (report, ok, _) = migrate(&vm, &format!("unix:{}", sock.display()), &["--local"]);
    destination.join().unwrap();
    assert!(!ok);
    assert_eq!(report.phase, MigrationPhase::Unconfirmed);
    assert_eq!(vm.info().state, "unconfirmed");
    assert_second_writer_refused(&path);
    let out = ferry_output(&[
        "migrate-reclaim",
        "--api-socket",
        vm.socket.to_str().unwrap(),
        "--force",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_carries_on(&vm, "reclaimed");
}

/// A stranger who bound the socket first in a shared directory (here: uid 65534 in a
/// world-writable one) gets nothing of the VM, not even its `Hello`: the source asks the
/// kernel who listens (`SO_PEERCRED`) before it writes a byte. The VM runs on.
#[test]
fn a_stranger_listening_first_gets_nothing_of_the_vm() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = shared.join("update.sock");
    // The stranger reads all it is sent, files included, and says how much came.
    let script = "import socket, sys\n\
        s = socket.socket(socket.AF_UNIX)\n\
        s.bind(sys.argv[1]); s.listen(1); print('listening', flush=True)\n\
        c, _ = s.accept(); got, fds = 0, 0\n\
        while True:\n\
        \x20   data, passed, _, _ = socket.recv_fds(c, 65536, 64)\n\
        \x20   got += len(data); fds += len(passed)\n\
        \x20   if not data: break\n\
        print(got, fds, flush=True)\n";
    let mut stranger = Command::new("python3")
        .args(["-c", script, sock.to_str().unwrap()])
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 (scripts/install-deps.sh installs it)");
    let mut said = BufReader::new(stranger.stdout.take().unwrap()).lines();
    assert_eq!(said.next().unwrap().unwrap(), "listening");
    let (_path, vm) = updatable(dir.path());
    let (report, ok, errors) = migrate(&vm, &format!("unix:{}", sock.display()), &["--local"]);
    assert!(!ok);
    assert!(errors.contains("runs as uid 65534"), "{errors}");
    assert_eq!(report.pages_full, 0);
    assert_eq!(
        said.next().unwrap().unwrap(),
        "0 0",
        "bytes and files it got"
    );
    assert!(stranger.wait().unwrap().success());
    assert_carries_on(&vm, "after the stranger");
}
