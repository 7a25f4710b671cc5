//! Seeds of the `live_destination` and `source` targets: live migrations between two VMs of
//! plain memory, through a relay that records what each side sent.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use ferry_fuzz::{LANE_MARK, PlainVm, RESUME_MARK};
use migration::destination::Source;
use migration::wire::frame::{FRAME_HEADER_LEN, KIND_CONTROL, KIND_PAGES, STREAM_HEADER_LEN};
use migration::wire::{self, Message};
use migration::{Endpoint, Incoming, Migratable, MigrationParams, Outgoing, StatusBoard};

/// What one connection carried: from the source, and from the destination.
struct Recorded {
    sent: Vec<u8>,
    answered: Vec<u8>,
}

pub fn seeds(write: &dyn Fn(&str, &str, &[u8])) {
    // The knob bytes of the `source` target (see `ferry_fuzz::params_from`).
    for (name, knobs, connections) in [
        ("precopy", 0b0_0000, 1),
        ("precopy-checksum", 0b1_0000, 1),
        ("warm", 0b0_0001, 1),
        ("postcopy", 0b0_0010, 1),
        ("hybrid-checkpoints", 0b0_0111, 1),
        ("go-with-state", 0b0_1000, 1),
        ("two-connections", 0b0_0000, 2),
    ] {
        let params = MigrationParams {
            connections,
            ..ferry_fuzz::params_from(knobs)
        };
        let connections = migrate(params, PlainVm::small());
        write(
            "live_destination",
            &format!("{name}.ferry"),
            &destination_input(&connections),
        );
        if name.starts_with("precopy") {
            resume_seeds(name, &connections[0].sent, write);
        }
        if connections.len() == 1 {
            let mut input = vec![knobs];
            input.extend_from_slice(&connections[0].answered);
            write("source", &format!("{name}.ferry"), &input);
        }
    }
    // A pre-copy whose disk moves with it: data, a block of zeros, a hole.
    let params = MigrationParams {
        copy_storage: true,
        ..ferry_fuzz::params_from(0)
    };
    let connections = migrate(params, PlainVm::small_with_disk(&ferry_fuzz::seed_disk()));
    let input = destination_input(&connections);
    write("live_destination", "copy-storage.ferry", &input);
}

/// Seeds of a resumed pre-copy from the main connection of one that ran whole: for `resume`,
/// its frames after `Hello` and `ResumeWindow`; for `live_destination`, the stream cut after
/// its first page frame and carried on with the rest.
fn resume_seeds(name: &str, sent: &[u8], write: &dyn Fn(&str, &str, &[u8])) {
    let frames = frames(sent);
    let is = |frame: &[u8], want: fn(&Message) -> bool| {
        frame[0] == KIND_CONTROL && want(&wire::read_message(&mut &frame[..]).unwrap())
    };
    let after_window = frames
        .iter()
        .position(|f| is(f, |m| matches!(m, Message::ResumeWindow { .. })))
        .expect("a pre-copy names its resume window")
        + 1;
    let rest: Vec<u8> = frames[after_window..].concat();
    write("resume", &format!("{name}.ferry"), &rest);
    if name == "precopy" {
        local_seeds(&rest, write);
    }
    let cut = frames[after_window..]
        .iter()
        .position(|f| f[0] == KIND_PAGES)
        .map_or(frames.len(), |i| after_window + i + 1);
    // Carried on, then cut again: the destination waits for a second resume.
    write(
        "resume",
        &format!("{name}-cut-again.ferry"),
        &frames[after_window..cut].concat(),
    );
    let mut input = sent[..STREAM_HEADER_LEN].to_vec();
    input.extend(frames[..cut].concat());
    input.extend_from_slice(RESUME_MARK);
    input.extend(frames[cut..].concat());
    write("live_destination", &format!("{name}-resumed.ferry"), &input);
}

/// Seeds of `local_destination`: the files ferry passes (two sealed memfds, one per RAM
/// range of `PlainVm::small`), an earlier ferry's, unsealed, short ones, and other kinds of
/// file, before `tail`.
fn local_seeds(tail: &[u8], write: &dyn Fn(&str, &str, &[u8])) {
    for (name, kinds) in [
        ("sealed", &[0u8, 0][..]),
        ("sealed-shut", &[1, 1]),
        ("unsealed", &[2, 0]),
        ("short-pipe-socket", &[3, 5, 6]),
        ("null", &[4]),
    ] {
        let seed = ferry_fuzz::local_seed(kinds, tail);
        write("local_destination", &format!("{name}.ferry"), &seed);
    }
}

/// The frames of a stream, after its header.
fn frames(stream: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut at = STREAM_HEADER_LEN;
    while at + FRAME_HEADER_LEN <= stream.len() {
        let len = u32::from_le_bytes(stream[at + 4..at + 8].try_into().unwrap()) as usize;
        let end = at + FRAME_HEADER_LEN + len + 4;
        out.push(&stream[at..end]);
        at = end;
    }
    out
}

/// The main connection's bytes, then each extra one's after its `Join`.
fn destination_input(connections: &[Recorded]) -> Vec<u8> {
    let mut input = connections[0].sent.clone();
    for lane in &connections[1..] {
        let mut r = &lane.sent[..];
        wire::read_stream_header(&mut r).unwrap();
        let join = wire::read_message(&mut r).unwrap();
        assert!(matches!(join, Message::Join { .. }), "{join:?}");
        input.extend_from_slice(LANE_MARK);
        input.extend_from_slice(r);
    }
    input
}

/// Migrates `vm` through a relay; what each connection carried.
fn migrate(params: MigrationParams, vm: PlainVm) -> Vec<Recorded> {
    let dir = std::env::temp_dir().join(format!("ferry-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (to, via) = (dir.join("destination.sock"), dir.join("relay.sock"));
    let source = Source::listen(&Endpoint::Unix(to.clone()), None).unwrap();
    let destination = std::thread::spawn(move || {
        Incoming::new(StatusBoard::default(), None)
            .receive(
                source,
                &|| false,
                |d, _| PlainVm::build(d).map(Arc::new),
                |_| {},
            )
            .unwrap_or_else(|e| panic!("the destination: {e}"))
            .expect("a VM")
    });
    let relay = UnixListener::bind(&via).unwrap();
    let connections = params.connections;
    let relayed = std::thread::spawn(move || {
        (0..connections)
            .map(|_| relay_one(&relay, &to))
            .collect::<Vec<_>>()
    });
    let vm = Arc::new(vm);
    fill(&vm);
    vm.resume().unwrap();
    let (tx, rx) = mpsc::channel();
    Outgoing::new(StatusBoard::default(), None)
        .send(
            vm,
            Endpoint::Unix(via),
            params,
            Box::new(move |r| {
                tx.send(r.as_ref().map_err(ToString::to_string).cloned())
                    .unwrap()
            }),
        )
        .unwrap();
    let sent = rx.recv().unwrap();
    let arrived = destination.join().unwrap();
    sent.expect("the migration");
    let recorded = relayed
        .join()
        .unwrap()
        .into_iter()
        .map(|(a, b)| Recorded {
            sent: a.join().unwrap(),
            answered: b.join().unwrap(),
        })
        .collect();
    drop(arrived);
    std::fs::remove_dir_all(&dir).unwrap();
    recorded
}

/// Some of `vm`'s pages hold data (a stamp per word), the rest are zero.
fn fill(vm: &PlainVm) {
    let ram = vm.ram();
    for gfn in ram.ranges().iter().flat_map(|r| r.first_gfn()..r.end_gfn()) {
        if gfn % 3 == 0 {
            let mut page = [0u8; migration::PAGE_SIZE];
            page.chunks_exact_mut(8)
                .for_each(|w| w.copy_from_slice(&(gfn << 12).to_le_bytes()));
            ram.write_page(gfn, &page).unwrap();
        }
    }
}

type Copy = JoinHandle<Vec<u8>>;

/// Accepts one connection and relays it to `to` both ways, keeping what each side sent.
fn relay_one(relay: &UnixListener, to: &PathBuf) -> (Copy, Copy) {
    let (from_source, _) = relay.accept().unwrap();
    let to_destination = UnixStream::connect(to).unwrap();
    (
        copy(
            from_source.try_clone().unwrap(),
            to_destination.try_clone().unwrap(),
        ),
        copy(to_destination, from_source),
    )
}

/// Copies `from` to `to` until `from` ends, then ends `to`'s sending direction.
fn copy(mut from: UnixStream, mut to: UnixStream) -> Copy {
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buf) {
            kept.extend_from_slice(&buf[..n]);
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
        kept
    })
}
