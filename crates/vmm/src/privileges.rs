//! Giving up root once the VM runs (`ferry run --user`): the process needs root to open
//! `/dev/kvm`, taps, disks and `/dev/userfaultfd` and to build the VM, not to run it; from
//! then on it holds the files it opened and nothing of root — a guest that takes a thread
//! over gets an unprivileged user with no capabilities.
//!
//! Credentials belong to each thread in Linux; the C library changes them on every thread
//! of the process at once (it signals each to make the same call), so the sandbox's
//! allow-lists must let a device or metrics thread make exactly these calls with exactly
//! these ids ([`crate::sandbox`]), and nothing else of the kind.

use std::ffi::CString;

/// The user and group to become.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunAs {
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
}

/// `USER[:GROUP]`, each a name or a number; without a group, the user's own.
impl std::str::FromStr for RunAs {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (user, group) = match s.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (s, None),
        };
        let (uid, own_gid) = user_ids(user)?;
        let gid = match group {
            Some(g) => group_id(g)?,
            None => own_gid.ok_or_else(|| {
                format!("user {user} has no entry in the user database: give {user}:GROUP")
            })?,
        };
        if uid == 0 {
            return Err(format!("'{s}' is root: name the user to become"));
        }
        Ok(RunAs { uid, gid })
    }
}

/// The uid of `user` (a name or a number) and its primary group when the database has it.
fn user_ids(user: &str) -> Result<(libc::uid_t, Option<libc::gid_t>), String> {
    let entry = match user.parse::<libc::uid_t>() {
        // SAFETY: getpwuid returns a pointer into static storage or null; read at once,
        // before any other call to it (the process is single-threaded while it parses).
        Ok(uid) => (uid, unsafe { libc::getpwuid(uid) }),
        Err(_) => {
            let name = CString::new(user).map_err(|_| format!("'{user}' is not a user"))?;
            // SAFETY: as above.
            let entry = unsafe { libc::getpwnam(name.as_ptr()) };
            if entry.is_null() {
                return Err(format!("no user '{user}'"));
            }
            // SAFETY: non-null, pointing at a passwd entry.
            (unsafe { (*entry).pw_uid }, entry)
        }
    };
    let (uid, entry) = entry;
    // SAFETY: null or a passwd entry, read at once.
    let gid = (!entry.is_null()).then(|| unsafe { (*entry).pw_gid });
    Ok((uid, gid))
}

fn group_id(group: &str) -> Result<libc::gid_t, String> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    let name = CString::new(group).map_err(|_| format!("'{group}' is not a group"))?;
    // SAFETY: getgrnam returns null or a pointer into static storage, read at once.
    let entry = unsafe { libc::getgrnam(name.as_ptr()) };
    if entry.is_null() {
        return Err(format!("no group '{group}'"));
    }
    // SAFETY: non-null, pointing at a group entry.
    Ok(unsafe { (*entry).gr_gid })
}

/// Becomes `to` on every thread: no supplementary groups, then the group, then the user
/// (real, effective and saved, so that root cannot be taken back; the kernel clears every
/// capability as the last root id goes). Checks the result on the calling thread.
pub fn drop_to(to: RunAs) -> Result<(), String> {
    // What the process reads of itself later it opens now: its own /proc files become
    // root's once it is not.
    migration::scan::pagemap().map_err(|e| format!("before becoming {}: {e}", to.uid))?;
    let fail = |what: &str| format!("cannot become {}:{}: {what}: {}", to.uid, to.gid, errno());
    // SAFETY: plain system calls on this process's credentials; the C library repeats each
    // on every thread.
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0 {
            return Err(fail("setgroups"));
        }
        if libc::setresgid(to.gid, to.gid, to.gid) != 0 {
            return Err(fail("setresgid"));
        }
        if libc::setresuid(to.uid, to.uid, to.uid) != 0 {
            return Err(fail("setresuid"));
        }
    }
    let (mut r, mut e, mut s) = (0, 0, 0);
    // SAFETY: three out-pointers to locals.
    unsafe { libc::getresuid(&mut r, &mut e, &mut s) };
    if [r, e, s] != [to.uid; 3] {
        return Err(format!("still uid {r}/{e}/{s} after becoming {}", to.uid));
    }
    Ok(())
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_is_read_by_name_or_number() {
        let nobody: RunAs = "nobody".parse().unwrap();
        assert_eq!(nobody.uid, 65534);
        assert_eq!(
            "65534:65534".parse::<RunAs>().unwrap(),
            RunAs {
                uid: 65534,
                gid: 65534
            }
        );
        assert_eq!("nobody:0".parse::<RunAs>().unwrap().gid, 0);
        for bad in [
            "root",
            "0:0",
            "no-such-user-here",
            "nobody:no-such-group",
            "4242",
        ] {
            let e = bad.parse::<RunAs>().unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
    }
}
