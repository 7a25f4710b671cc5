//! Which host files the VMM process may reach (Landlock): what its VM was configured with,
//! what ferry itself needs, and the directories its operator names; nothing else, whatever
//! a thread that a guest took over asks.
//!
//! A Landlock domain binds the thread that enters it and the threads it starts later, not
//! those already running (kernels before Landlock ABI 8 cannot bind them all at once), so
//! [`confine`] refuses to run once the process has a second thread.

use std::path::{Path, PathBuf};

use ::landlock::{
    ABI, Access as _, AccessFs, BitFlags, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetStatus, make_bitflags,
};

/// The file-system rights ferry handles: every one Landlock ABI 5 (Linux 6.10) knows, the
/// same set on every later kernel, so a rule means the same thing wherever ferry runs.
const HANDLED_ABI: ABI = ABI::V5;

/// What a rule lets the process do beneath its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read files and list directories (and map libraries: the resolver loads its modules).
    Read,
    /// Everything: read, write, create, remove, truncate, device ioctls.
    ReadWrite,
    /// Listen on Unix sockets in a directory: make a socket (through a private directory
    /// beside it, `sockets::unix::bind_private`) and remove it again, no other file.
    Sockets,
}

impl Access {
    fn rights(self) -> BitFlags<AccessFs> {
        match self {
            Access::Read => AccessFs::from_read(HANDLED_ABI),
            Access::ReadWrite => AccessFs::from_all(HANDLED_ABI),
            Access::Sockets => make_bitflags!(AccessFs::{
                MakeSock | MakeDir | RemoveDir | RemoveFile | Refer | ReadDir
            }),
        }
    }
}

/// A path and what may be done beneath it (the path itself if it is a file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub path: PathBuf,
    pub access: Access,
}

impl Rule {
    pub fn read(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            access: Access::Read,
        }
    }

    pub fn read_write(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            access: Access::ReadWrite,
        }
    }

    /// The right to listen on the Unix socket `socket`: sockets in its directory.
    pub fn socket(socket: &Path) -> Self {
        let dir = socket
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        Self {
            path: dir.to_path_buf(),
            access: Access::Sockets,
        }
    }
}

/// Cloud Hypervisor's `--landlock-rules` spelling: `path=PATH,access=r|w|rw`. Write without
/// read is not a thing ferry can honour for a VMM (it reads back what it writes), so `w`
/// means `rw`, as it does in practice for Cloud Hypervisor's disks.
impl std::str::FromStr for Rule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (mut path, mut access) = (None, None);
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("path", p)) if !p.is_empty() => path = Some(PathBuf::from(p)),
                Some(("access", "r")) => access = Some(Access::Read),
                Some(("access", "w" | "rw")) => access = Some(Access::ReadWrite),
                Some(("access", a)) => {
                    return Err(format!("access={a}: give r, w or rw"));
                }
                _ => return Err(format!("'{part}': give path=PATH,access=r|w|rw")),
            }
        }
        match (path, access) {
            (Some(path), Some(access)) => Ok(Rule { path, access }),
            (None, _) => Err(format!("'{s}' gives no path=PATH")),
            (_, None) => Err(format!("'{s}' gives no access=r|w|rw")),
        }
    }
}

/// What ferry itself reaches whatever the VM: its own figures in /proc and /sys, the devices
/// it opens (KVM, userfaultfd, taps, terminals), randomness, and what the C library's name resolver
/// reads. Absent ones are left out.
pub fn ferry_needs() -> Vec<Rule> {
    let read = [
        "/proc",
        "/sys",
        "/dev/urandom",
        "/etc/hosts",
        "/etc/host.conf",
        "/etc/nsswitch.conf",
        "/etc/resolv.conf",
        "/etc/gai.conf",
        "/etc/services",
        "/etc/ld.so.cache",
        "/lib",
        "/lib64",
        "/usr/lib",
        "/usr/lib64",
    ];
    let read_write = [
        "/dev/kvm",
        "/dev/userfaultfd",
        "/dev/net/tun",
        "/dev/ptmx",
        "/dev/pts",
        "/dev/null",
    ];
    read.iter()
        .map(|p| Rule::read(*p))
        .chain(read_write.iter().map(|p| Rule::read_write(*p)))
        .filter(|r| r.path.exists())
        .collect()
}

/// How far the kernel confined the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Confined {
    /// Every rule as written.
    Fully,
    /// An older kernel that knows only some of the rights: what it knows is enforced.
    Partly,
    /// A kernel without Landlock: nothing is confined.
    NotSupported,
}

/// Confines this process's file access to `rules` from now on. Must be called before the
/// process starts a second thread (see the module's comment). A rule's path that does not
/// exist is an error naming it.
pub fn confine(rules: &[Rule]) -> Result<Confined, String> {
    let threads = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(1);
    if threads > 1 {
        return Err(format!(
            "landlock: the process already runs {threads} threads, which it would leave unconfined"
        ));
    }
    let status = confine_this_thread(rules)?;
    Ok(status)
}

/// Confines the calling thread (and those it starts) to `rules`.
pub fn confine_this_thread(rules: &[Rule]) -> Result<Confined, String> {
    let handled = AccessFs::from_all(HANDLED_ABI);
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(handled)
        .and_then(|r| r.create())
        .map_err(|e| format!("landlock: {e}"))?;
    for rule in rules {
        let fd = PathFd::new(&rule.path)
            .map_err(|e| format!("landlock: {}: {e}", rule.path.display()))?;
        let mut rights = rule.access.rights();
        if !rule.path.is_dir() {
            rights &= AccessFs::from_file(HANDLED_ABI);
        }
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, rights))
            .map_err(|e| format!("landlock: {}: {e}", rule.path.display()))?;
    }
    let status = ruleset
        .restrict_self()
        .map_err(|e| format!("landlock: {e}"))?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => Confined::Fully,
        RulesetStatus::PartiallyEnforced => Confined::Partly,
        RulesetStatus::NotEnforced => Confined::NotSupported,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    #[test]
    fn cloud_hypervisors_rule_spelling_is_read() {
        assert_eq!(
            "path=/var/lib/vm,access=rw".parse::<Rule>().unwrap(),
            Rule::read_write("/var/lib/vm")
        );
        assert_eq!(
            "access=r,path=/k".parse::<Rule>().unwrap(),
            Rule::read("/k")
        );
        assert_eq!(
            "path=/d,access=w".parse::<Rule>().unwrap().access,
            Access::ReadWrite
        );
        for bad in [
            "path=/d",
            "access=r",
            "path=/d,access=x",
            "path=,access=r",
            "/d",
        ] {
            let e = bad.parse::<Rule>().unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
    }

    #[test]
    fn a_socket_rule_names_its_directory() {
        let rule = Rule::socket(Path::new("/run/ferry/api.sock"));
        assert_eq!(rule.path, Path::new("/run/ferry"));
        assert_eq!(rule.access, Access::Sockets);
        assert_eq!(Rule::socket(Path::new("api.sock")).path, Path::new("."));
    }

    #[test]
    fn a_rule_on_a_missing_path_is_refused_by_name() {
        let e = std::thread::spawn(|| confine_this_thread(&[Rule::read("/no/such/ferry/path")]))
            .join()
            .unwrap()
            .unwrap_err();
        assert!(e.contains("/no/such/ferry/path"), "{e}");
    }

    #[test]
    fn a_second_thread_keeps_confine_from_running() {
        let _other =
            std::thread::spawn(|| std::thread::park_timeout(std::time::Duration::from_secs(5)));
        let e = confine(&[]).unwrap_err();
        assert!(e.contains("threads"), "{e}");
    }

    fn denied<T: std::fmt::Debug>(r: std::io::Result<T>) -> ErrorKind {
        r.unwrap_err().kind()
    }

    /// A confined thread reads and writes beneath its rules and nowhere else; a thread it
    /// starts is confined too; the rest of the process is not.
    #[test]
    fn a_confined_thread_reaches_only_its_rules() {
        let allowed = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join("secret"), b"x").unwrap();
        let sockets = tempfile::tempdir().unwrap();
        let (a, o, s) = (
            allowed.path().to_path_buf(),
            other.path().to_path_buf(),
            sockets.path().to_path_buf(),
        );
        let confined = std::thread::spawn(move || {
            let rules = [Rule::read_write(&a), Rule::socket(&s.join("api.sock"))];
            let status = confine_this_thread(&rules).unwrap();
            if status == Confined::NotSupported {
                return status;
            }
            std::fs::write(a.join("kept"), b"y").unwrap();
            assert_eq!(
                denied(std::fs::read(o.join("secret"))),
                ErrorKind::PermissionDenied
            );
            assert_eq!(
                denied(std::fs::write(o.join("new"), b"z")),
                ErrorKind::PermissionDenied
            );
            assert_eq!(
                denied(std::fs::read("/etc/hostname")),
                ErrorKind::PermissionDenied
            );
            // Sockets may be made in their directory, but not files.
            let listener = sockets::unix::bind_private(&s.join("api.sock")).unwrap();
            drop(listener);
            assert_eq!(
                denied(std::fs::write(s.join("file"), b"z")),
                ErrorKind::PermissionDenied
            );
            let child = std::thread::spawn(move || std::fs::read(o.join("secret")).is_err());
            assert!(
                child.join().unwrap(),
                "a thread started later is confined too"
            );
            status
        })
        .join()
        .unwrap();
        if confined == Confined::NotSupported {
            eprintln!("skipped: this kernel has no Landlock (ferry says so when it starts)");
            return;
        }
        assert_eq!(confined, Confined::Fully, "a kernel with Landlock ABI >= 5");
        assert_eq!(std::fs::read(other.path().join("secret")).unwrap(), b"x");
        assert_eq!(std::fs::read(allowed.path().join("kept")).unwrap(), b"y");
    }
}
