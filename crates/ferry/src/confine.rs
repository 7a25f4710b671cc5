//! The host files a VMM process confines itself to when it starts (Landlock,
//! docs/security.md): those its command line names, what ferry itself needs, and the
//! operator's `--landlock-rules`.

use std::path::Path;

use anyhow::{Context, Result};
use vmm::landlock::{self, Confined, Rule};

use crate::cli::RunArgs;
use crate::metrics::MetricsAddr;

/// What `ferry run` may reach: its guest or kernel and initrd, its disks (read-only ones for
/// reading), its serial file, its snapshot directory and the snapshot it restores, its TLS
/// and token files, the directories of the sockets it listens on, and `--landlock-rules`.
pub fn for_run(args: &RunArgs) -> Result<Vec<Rule>> {
    let mut rules = landlock::ferry_needs();
    let read = [&args.guest, &args.kernel, &args.initrd, &args.restore];
    let secrets = [
        &args.tls_cert,
        &args.tls_key,
        &args.tls_ca,
        &args.metrics_token_file,
    ];
    rules.extend(read.into_iter().chain(secrets).flatten().map(Rule::read));
    rules.extend(args.disks.iter().map(|d| match d.readonly {
        true => Rule::read(&d.path),
        false => Rule::read_write(&d.path),
    }));
    if args.serial != "stdout" {
        rules.push(output_file(Path::new(&args.serial))?);
    }
    rules.extend(args.snapshot_dir.iter().map(Rule::read_write));
    rules.extend(args.api_socket.as_deref().map(Rule::socket));
    if let Some(MetricsAddr::Unix(path)) = &args.metrics {
        rules.push(Rule::socket(path));
    }
    if let Some(migration::Endpoint::Unix(path)) =
        args.incoming.as_deref().and_then(|u| u.parse().ok())
    {
        rules.push(Rule::socket(&path));
    }
    // A path the command line names that is missing is said by what opens it, later.
    rules.retain(|r| r.path.exists());
    rules.extend(args.landlock_rules.iter().cloned());
    Ok(rules)
}

/// A file ferry appends to: made now if missing, so that the rule can name the file alone
/// rather than its whole directory. One that exists is not opened here: it may be a FIFO
/// whose reader comes only once ferry's API answers.
pub fn output_file(path: &Path) -> Result<Rule> {
    if !path.exists() {
        std::fs::File::options()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("{}", path.display()))?;
    }
    Ok(Rule::read_write(path))
}

/// Confines the process to `rules`, saying so when the kernel cannot (fully).
pub fn enter(rules: &[Rule]) -> Result<()> {
    match landlock::confine(rules).map_err(anyhow::Error::msg)? {
        Confined::Fully => {}
        Confined::Partly => eprintln!(
            "ferry: this kernel's Landlock knows only some file rights: file access is \
             confined to the VM's files only in part"
        ),
        Confined::NotSupported => eprintln!(
            "ferry: this kernel has no Landlock: file access is not confined to the VM's files \
             (the seccomp sandbox still holds)"
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::path::PathBuf;
    use vmm::landlock::Access;

    fn run_args(argv: &[&str]) -> RunArgs {
        let argv = ["ferry", "run"].iter().chain(argv);
        match crate::cli::Cli::try_parse_from(argv).unwrap().command {
            crate::cli::Command::Run(args) => *args,
            _ => unreachable!(),
        }
    }

    /// A serial FIFO (a benchmark reads the console from one once the API answers) is named
    /// by its rule without being opened, which would wait for its reader.
    #[test]
    fn an_existing_output_is_not_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("serial.fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid path string and a mode.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let at = fifo.clone();
        // A thread of its own: an open that waits for a reader would never return.
        std::thread::spawn(move || tx.send(output_file(&at).unwrap()));
        let rule = rx.recv_timeout(std::time::Duration::from_secs(10));
        assert_eq!(rule, Ok(Rule::read_write(&fifo)), "the FIFO was opened");
    }

    /// `ferry run` reaches the files its command line names, each as it uses it, and the
    /// operator's rules; a serial file is made so that the rule names it alone.
    #[test]
    fn ferry_run_reaches_what_its_command_line_names() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        for file in ["guest.elf", "a.img", "b.img"] {
            std::fs::write(at(file), b"").unwrap();
        }
        std::fs::create_dir(at("snaps")).unwrap();
        let arg = |prefix: &str, name: &str| format!("{prefix}{}", at(name).display());
        let args = run_args(&[
            "--guest",
            &arg("", "guest.elf"),
            "--disk",
            &arg("path=", "a.img"),
            "--disk",
            &arg("path=", "b.img,readonly"),
            "--serial",
            &arg("", "serial.log"),
            "--api-socket",
            &arg("", "run/api.sock"),
            "--snapshot-dir",
            &arg("", "snaps"),
            "--landlock-rules",
            "path=/var/lib/extra,access=rw",
        ]);
        std::fs::create_dir(at("run")).unwrap();
        let rules = for_run(&args).unwrap();
        let access = |path: PathBuf| {
            let found = rules.iter().filter(|r| r.path == path);
            found.map(|r| r.access).collect::<Vec<_>>()
        };
        assert_eq!(access(at("guest.elf")), [Access::Read]);
        assert_eq!(access(at("a.img")), [Access::ReadWrite]);
        assert_eq!(access(at("b.img")), [Access::Read]);
        assert_eq!(access(at("serial.log")), [Access::ReadWrite]);
        assert!(at("serial.log").exists(), "the serial file is made");
        assert_eq!(access(at("run")), [Access::Sockets]);
        assert_eq!(access(at("snaps")), [Access::ReadWrite]);
        assert_eq!(access("/var/lib/extra".into()), [Access::ReadWrite]);
        assert!(access("/etc".into()).is_empty() && access(dir.path().into()).is_empty());
    }
}
