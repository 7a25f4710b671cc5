//! The same guest.elf boots under QEMU (PVH) and prints progress on its serial port.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

#[test]
fn guest_boots_under_qemu() {
    if !qemu_available() || !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let serial = dir.path().join("serial.log");
    let mut qemu = Command::new("qemu-system-x86_64")
        .args([
            "-enable-kvm",
            "-m",
            "512",
            "-display",
            "none",
            "-monitor",
            "none",
        ])
        .arg("-serial")
        .arg(format!("file:{}", serial.display()))
        .arg("-kernel")
        .arg(guest())
        .args(["-append", "write ws=16M verify"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn qemu");
    let deadline = Instant::now() + Duration::from_secs(30);
    let (text, passes) = loop {
        let text = std::fs::read_to_string(&serial).unwrap_or_default();
        let passes = text
            .lines()
            .filter_map(|l| l.split("passes=").nth(1))
            .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .max()
            .unwrap_or(0);
        if passes >= 2 || Instant::now() > deadline || qemu.try_wait().ok().flatten().is_some() {
            break (text, passes);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = qemu.kill();
    let _ = qemu.wait();
    let mut stderr = String::new();
    if let Some(mut e) = qemu.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    assert!(
        text.contains("ferry-guest: booted"),
        "no boot line; serial:\n{text}\nqemu:\n{stderr}"
    );
    assert!(text.contains("mode=write"), "serial:\n{text}");
    assert!(passes >= 2, "no progress; serial:\n{text}");
    assert!(!text.contains("verify error"), "serial:\n{text}");
}
