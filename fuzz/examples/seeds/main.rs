//! Writes the seed corpus (`fuzz/corpus/<target>/`): real streams made by ferry's own sender,
//! so that the fuzzer starts from every kind of frame; live migrations between two VMs of
//! plain memory, recorded on their way (what the source sent on each connection, what the
//! destination answered); and VM state as a KVM VM encodes it. Run it again after a change of the
//! wire format: `cargo run --manifest-path fuzz/Cargo.toml --example seeds`.

mod live;
mod state;

use std::path::Path;

use ferry_fuzz::PlainVm;
use migration::pages::PageSender;
use migration::ratelimit::RateLimiter;
use migration::wire::{self, Message};
use migration::{Compression, Migratable, MigrationParams, Outgoing, PAGE_SIZE, StatusBoard};

fn main() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let vm = PlainVm::small();
    let ram = vm.ram();
    // Pages of three kinds: a stamp per word, text-like bytes, and pseudo-random bytes.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for (i, gfn) in ram
        .ranges()
        .iter()
        .flat_map(|r| r.first_gfn()..r.end_gfn())
        .enumerate()
    {
        let mut page = [0u8; PAGE_SIZE];
        match i % 4 {
            0 => continue,
            1 => page
                .chunks_exact_mut(8)
                .for_each(|w| w.copy_from_slice(&(gfn << 12).to_le_bytes())),
            2 => page
                .iter_mut()
                .enumerate()
                .for_each(|(j, b)| *b = b"the quick brown fox "[j % 20]),
            _ => page.iter_mut().for_each(|b| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                *b = (state >> 56) as u8;
            }),
        }
        ram.write_page(gfn, &page).unwrap();
    }

    let write = |target: &str, name: &str, bytes: &[u8]| {
        let dir = corpus.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    };

    let plain = snapshot_of(&vm, 1);
    write("snapshot", "plain.ferry", &plain);
    write(
        "snapshot",
        "empty.ferry",
        &snapshot_of(&PlainVm::small(), 1),
    );
    // Written by two writers: a container of both lanes' chunks.
    write("snapshot", "writers.ferry", &snapshot_of(&vm, 2));
    write("stream", "plain.ferry", &plain);
    // The same VM cut short, and with its pages in small frames.
    write("snapshot", "truncated.ferry", &plain[..plain.len() / 3]);

    // Page frames of each codec, then a round that re-sends pages as deltas.
    let gfns: Vec<u64> = ram
        .ranges()
        .iter()
        .flat_map(|r| r.first_gfn()..r.end_gfn())
        .collect();
    for (name, compression, delta) in [
        ("lz4", "lz4".parse().unwrap(), 0),
        ("zstd", "zstd".parse().unwrap(), 0),
        ("delta", Compression::None, 256),
        ("small-frames", Compression::None, 0),
        ("unchecked", Compression::None, 0),
    ] {
        let mut out = Vec::new();
        wire::write_stream_header(&mut out).unwrap();
        wire::write_message(
            &mut out,
            &Message::Abort {
                reason: "seed".into(),
            },
        )
        .unwrap();
        let batch = if name == "small-frames" { 3 } else { 64 };
        let mut sender = PageSender::new(batch)
            .with_compression(compression)
            .with_delta_cache(delta);
        // Pages read while the guest runs go unchecked, each with its CRC.
        sender.checked = name != "unchecked";
        let mut limiter = RateLimiter::new(None);
        for round in 0..2u8 {
            for &gfn in &gfns {
                if round == 1 && gfn % 5 != 0 {
                    continue;
                }
                if round == 1 {
                    // SAFETY: nothing else touches the harness VM's memory here.
                    let page = unsafe { ram.pages_slice_mut(gfn, 1) }.unwrap();
                    page[100] ^= 0x5a;
                }
                sender.push(&mut out, &ram, gfn, &mut limiter).unwrap();
            }
            sender.flush(&mut out, &ram, &mut limiter).unwrap();
        }
        write("stream", &format!("{name}.ferry"), &out);
        if name == "unchecked" {
            // A page whose data no longer matches the CRC it was sent with (the last page of
            // the last frame, before its trailer): pre-copy must keep it as suspect.
            let mut corrupt = out.clone();
            let at = corrupt.len() - 100;
            corrupt[at] ^= 0xff;
            write("stream", "unchecked-corrupt.ferry", &corrupt);
        }
    }

    // A post-copy checkpoint as the destination sends it back: its pages, then its state.
    let mut out = Vec::new();
    wire::write_stream_header(&mut out).unwrap();
    wire::write_message(&mut out, &Message::Checkpoints { every_ms: 20 }).unwrap();
    let mut sender = PageSender::new(64);
    sender.checked = true;
    let mut limiter = RateLimiter::new(None);
    for &gfn in gfns.iter().take(3) {
        sender.push(&mut out, &ram, gfn, &mut limiter).unwrap();
    }
    sender.flush(&mut out, &ram, &mut limiter).unwrap();
    for msg in [
        Message::Checkpoint {
            seq: 1,
            pages: 3,
            vcpus: vec![vec![1; 64]],
            devices: vec![2; 32],
        },
        Message::CheckpointTaken { seq: 1 },
    ] {
        wire::write_message(&mut out, &msg).unwrap();
    }
    write("stream", "checkpoint.ferry", &out);

    for (name, request) in [
        (
            "info",
            "GET /api/v1/vm.info HTTP/1.1\r\nHost: x\r\n\r\n".to_string(),
        ),
        (
            "pause",
            "PUT /api/v1/vm.pause HTTP/1.1\r\nContent-Length: 0\r\n\r\n".into(),
        ),
        (
            "migrate",
            with_body(
                "vm.send-migration",
                r#"{"destination":"tcp:127.0.0.1:7000","mode":"hybrid","connections":2,"compression":"auto","delta_cache_mb":8}"#,
            ),
        ),
        (
            "snapshot",
            with_body("vm.snapshot", r#"{"file":"vm.ferry"}"#),
        ),
        (
            "resume",
            with_body("vm.migrate-resume", r#"{"listen":"tcp:127.0.0.1:7001"}"#),
        ),
        (
            "corrupt",
            with_body("vm.debug-corrupt-page", r#"{"page":3}"#),
        ),
    ] {
        write("api", &format!("{name}.http"), request.as_bytes());
    }
    live::seeds(&write);
    state::seeds(&write);
}

/// A snapshot file of `vm`, as `vm.snapshot` writes it.
fn snapshot_of(vm: &PlainVm, writers: u32) -> Vec<u8> {
    let path = std::env::temp_dir().join(format!("ferry-seed-{}.ferry", std::process::id()));
    Outgoing::new(StatusBoard::default(), None)
        .snapshot(
            vm,
            std::fs::File::create(&path).unwrap(),
            "seed",
            &MigrationParams {
                connections: writers,
                ..MigrationParams::default()
            },
        )
        .expect("snapshot");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    bytes
}

fn with_body(endpoint: &str, body: &str) -> String {
    format!(
        "PUT /api/v1/{endpoint} HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}
