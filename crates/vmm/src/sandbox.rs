//! The sandbox: what a VMM thread may ask the kernel for (seccomp, through rust-vmm's
//! `seccompiler`), so that a guest that takes a thread over through a device bug holds
//! little. On by default; `--sandbox off` for debugging.
//!
//! - **Device threads** (each vCPU, each virtio device's I/O thread) run the code a guest
//!   drives. They get an allow-list: memory, files they already hold (read, write, sync,
//!   give back), KVM's ioctls, waiting and signals. Nothing opens a file, makes a socket,
//!   spawns a process or a thread, or changes a privilege.
//! - **The metrics endpoint's threads** (the one port a stranger may reach without a
//!   certificate) get an allow-list too: connections they were handed, threads to serve
//!   them, memory and waiting. Nothing opens a file, makes a socket or touches KVM.
//! - **Every thread** (the API, the migration, the rest) gets a deny-list of what a VMM never
//!   does: run a program, trace or write another process, mount, change namespaces, load a
//!   module or a BPF program, reboot, set the clock, and so on. `clone3` answers `ENOSYS` (its
//!   flags cannot be read by a filter), so that the C library creates threads with `clone`,
//!   whose flags the filter reads: a `clone` that would make a process is refused.
//!
//! A refused system call is not run: it fails with `EPERM`, and the process says which on
//! its standard error (a `SIGSYS` handler). The VM goes on: a refusal of ferry's own code
//! is an error it reports, never a VM lost.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::privileges::RunAs;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Whether the sandbox is on, once the process said (`enter_process`).
static ON: OnceLock<bool> = OnceLock::new();
/// Whom the process will become once its VM runs (`ferry run --user`), if anyone.
static RUN_AS: OnceLock<Option<RunAs>> = OnceLock::new();
/// The filter for device threads, built once.
static DEVICE_FILTER: OnceLock<BpfProgram> = OnceLock::new();
/// System calls refused so far.
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// What device threads may do.
const DEVICE_SYSCALLS: &[libc::c_long] = &[
    // Files and devices they hold.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_lseek,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_fallocate,
    libc::SYS_fstat,
    libc::SYS_close,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    // Memory: the allocator, and guest pages given back.
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mincore,
    libc::SYS_brk,
];

/// What every thread on an allow-list may do: wait, tell the time, take and return from
/// signals, end.
const THREAD_BASICS: &[libc::c_long] = &[
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_restart_syscall,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_getrandom,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// What the metrics endpoint's threads may do: take connections, read a request and write
/// the answer on them, and start a thread for each; memory, waiting and the thread's end.
/// It opens no file, makes no socket, touches no device: a bug in what parses a stranger's
/// request holds little.
const METRICS_SYSCALLS: &[libc::c_long] = &[
    // Connections.
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_getpeername,
    libc::SYS_getsockname,
    libc::SYS_shutdown,
    libc::SYS_close,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_fcntl,
    // Memory: the allocator, a new thread's stack and its guard.
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    // Threads: `clone` itself is checked by the process's filter (threads only). `clone3`
    // must pass this filter so that the process's answers `ENOSYS` (the C library then uses
    // `clone`): a trap would win over it, and the C library makes a thread with every signal
    // blocked, so the trap's `SIGSYS` would end the process.
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
];

/// What no thread of a VMM does.
const NEVER: &[libc::c_long] = &[
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_fork,
    libc::SYS_vfork,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_kcmp,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_fsopen,
    libc::SYS_fsmount,
    libc::SYS_fsconfig,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_setns,
    libc::SYS_unshare,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_vhangup,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_personality,
    libc::SYS_uselib,
    libc::SYS_lookup_dcookie,
];

/// The type byte of KVM's ioctls (`KVMIO`, bits 8..16 of the request).
const KVM_IOCTL_TYPE: u64 = 0xae;

fn condition(arg: u8, op: SeccompCmpOp, value: u64) -> SeccompCondition {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value)
        .expect("a condition on one of the six arguments")
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> BpfProgram {
    SeccompFilter::new(rules, mismatch, matched, TargetArch::x86_64)
        .and_then(BpfProgram::try_from)
        .expect("the filters are valid")
}

/// Rules that allow `calls` and the thread basics, whatever their arguments.
fn allowed(calls: &[libc::c_long]) -> BTreeMap<i64, Vec<SeccompRule>> {
    calls
        .iter()
        .chain(THREAD_BASICS)
        .map(|&nr| (nr, Vec::new()))
        .collect()
}

/// The device threads' allow-list: anything else is refused. With `run_as`, the calls that
/// make the thread that user, with exactly its ids (`privileges::drop_to`).
pub fn device_filter(run_as: Option<RunAs>) -> BpfProgram {
    let mut rules = allowed(DEVICE_SYSCALLS);
    let kvm = condition(1, SeccompCmpOp::MaskedEq(0xff00), KVM_IOCTL_TYPE << 8);
    let kvm = SeccompRule::new(vec![kvm]).expect("one condition");
    rules.insert(libc::SYS_ioctl, vec![kvm]);
    rules.extend(becoming(run_as));
    compile(rules, SeccompAction::Trap, SeccompAction::Allow)
}

/// `setgroups` to none, `setresgid` and `setresuid` to `run_as`'s ids and no others: what
/// the C library has every thread call when the process becomes that user. A thread that
/// makes them only gives up root.
fn becoming(run_as: Option<RunAs>) -> BTreeMap<i64, Vec<SeccompRule>> {
    let Some(to) = run_as else {
        return BTreeMap::new();
    };
    let all_three = |id: u32| {
        let same = (0..3).map(|arg| condition(arg, SeccompCmpOp::Eq, u64::from(id)));
        vec![SeccompRule::new(same.collect()).expect("three conditions")]
    };
    let no_groups = condition(0, SeccompCmpOp::Eq, 0);
    BTreeMap::from([
        (
            libc::SYS_setgroups,
            vec![SeccompRule::new(vec![no_groups]).expect("one")],
        ),
        (libc::SYS_setresgid, all_three(to.gid)),
        (libc::SYS_setresuid, all_three(to.uid)),
    ])
}

/// The metrics endpoint's allow-list (and `prctl` to name a thread), and the calls that
/// make it `run_as`.
pub fn metrics_filter(run_as: Option<RunAs>) -> BpfProgram {
    let mut rules = allowed(METRICS_SYSCALLS);
    rules.extend(becoming(run_as));
    let naming = condition(0, SeccompCmpOp::Eq, libc::PR_SET_NAME as u64);
    rules.insert(
        libc::SYS_prctl,
        vec![SeccompRule::new(vec![naming]).expect("one condition")],
    );
    compile(rules, SeccompAction::Trap, SeccompAction::Allow)
}

/// The process's deny-list, and `clone` that makes a process.
pub fn process_filter() -> BpfProgram {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        NEVER.iter().map(|&nr| (nr, Vec::new())).collect();
    let no_thread = condition(0, SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64), 0);
    let process = SeccompRule::new(vec![no_thread]).expect("one condition");
    rules.insert(libc::SYS_clone, vec![process]);
    compile(rules, SeccompAction::Allow, SeccompAction::Trap)
}

/// `clone3` answers `ENOSYS`: the C library then creates threads with `clone`.
fn clone3_filter() -> BpfProgram {
    let rules = BTreeMap::from([(libc::SYS_clone3, Vec::new())]);
    compile(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
    )
}

/// Turns the sandbox on (or says it is off) for this process: the `SIGSYS` handler, then the
/// deny-list on every thread. `run_as`: whom the process will become once its VM runs, which
/// the allow-lists must let every thread become. Call once, early, before the VM's threads
/// start.
pub fn enter_process(on: bool, run_as: Option<RunAs>) -> Result<(), String> {
    if ON.set(on).is_err() || RUN_AS.set(run_as).is_err() {
        return Err("the sandbox was already set up".into());
    }
    if !on {
        return Ok(());
    }
    migration::scan::pagemap().map_err(|e| format!("sandbox: {e}"))?;
    bound_malloc_arenas();
    install_sigsys_handler()?;
    for filter in [clone3_filter(), process_filter()] {
        seccompiler::apply_filter_all_threads(&filter)
            .map_err(|e| format!("sandbox: cannot install the seccomp filter: {e}"))?;
    }
    Ok(())
}

/// glibc's malloc bounds its arenas the first time it has more than a few: unless told the
/// bound, it reads `/sys/devices/system/cpu/online` then, from whichever thread frees or
/// allocates at that moment — a metrics or device thread, which may open no file, as often as
/// any (seen as two refused `openat`s in a metrics thread's exit). Told the bound it would
/// compute (8 arenas per core on 64-bit), it never reads the file.
fn bound_malloc_arenas() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let arenas = i32::try_from(cores * 8).unwrap_or(i32::MAX);
    // SAFETY: mallopt takes a plain integer option, under malloc's own lock.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) };
}

/// Narrows the calling thread to the device threads' allow-list, when the sandbox is on.
/// A thread that cannot be narrowed does not run guest-driven code: the error says why.
pub fn enter_device_thread() -> Result<(), String> {
    if !ON.get().copied().unwrap_or(false) {
        return Ok(());
    }
    let filter = DEVICE_FILTER.get_or_init(|| device_filter(run_as()));
    seccompiler::apply_filter(filter)
        .map_err(|e| format!("sandbox: cannot narrow a device thread: {e}"))
}

/// Narrows the calling thread, and the threads it starts, to the metrics endpoint's
/// allow-list, when the sandbox is on.
pub fn enter_metrics_thread() -> Result<(), String> {
    if !ON.get().copied().unwrap_or(false) {
        return Ok(());
    }
    seccompiler::apply_filter(&metrics_filter(run_as()))
        .map_err(|e| format!("sandbox: cannot narrow the metrics endpoint's thread: {e}"))
}

fn run_as() -> Option<RunAs> {
    RUN_AS.get().copied().flatten()
}

/// System calls the sandbox refused since the process started.
pub fn refused() -> u64 {
    REFUSED.load(Ordering::Relaxed)
}

fn install_sigsys_handler() -> Result<(), String> {
    // SAFETY: a zeroed sigaction with our handler and SA_SIGINFO; the handler only does
    // async-signal-safe work (an atomic add, write(2), a register in its context).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigsys as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) != 0 {
            return Err(format!(
                "sandbox: cannot handle SIGSYS: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// Where `siginfo_t` keeps a seccomp trap's system call number (`_sigsys._syscall`).
const SI_SYSCALL_OFFSET: usize = 24;

/// A refused system call: counted, said on standard error, and made to fail with `EPERM`.
extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    REFUSED.fetch_add(1, Ordering::Relaxed);
    // SAFETY: the kernel hands a valid siginfo and ucontext for a SIGSYS of seccomp's.
    let nr = unsafe { *(info.cast::<u8>().add(SI_SYSCALL_OFFSET).cast::<i32>()) };
    let mut line = *b"ferry: the sandbox refused system call       \n";
    let mut at = line.len() - 2;
    let mut n = nr.unsigned_abs();
    loop {
        line[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 || at == 0 {
            break;
        }
        at -= 1;
    }
    // SAFETY: write(2) is async-signal-safe and allowed on every thread.
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
        let uc = context.cast::<libc::ucontext_t>();
        (*uc).uc_mcontext.gregs[libc::REG_RAX as usize] = -(libc::EPERM as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    /// A device thread may read, wait and give pages back, but not make a socket, open a file
    /// or run a program: those fail with EPERM and are counted; the thread goes on. The
    /// metrics endpoint serves a scrape on a thread of its own, refused nothing, but makes no
    /// socket and opens no file. Another thread (the deny-list) may make a socket, not
    /// unshare or change its root.
    /// The tests count refusals: one at a time.
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn device_threads_are_refused_what_the_guest_should_never_get() {
        let _alone = ALONE.lock().unwrap();
        install_sigsys_handler().unwrap();
        let before = refused();
        std::thread::spawn(|| {
            seccompiler::apply_filter(&device_filter(None)).unwrap();
            // SAFETY: plain system calls with valid (or null) arguments.
            unsafe {
                assert_eq!(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0), -1);
                assert_eq!(errno(), libc::EPERM);
                assert_eq!(libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY), -1);
                assert_eq!(errno(), libc::EPERM);
                let argv = [std::ptr::null::<libc::c_char>()];
                assert_eq!(libc::execv(c"/bin/true".as_ptr(), argv.as_ptr()), -1);
                // Not a KVM ioctl: refused (TIOCSTI on stdin would type into a terminal).
                assert_eq!(libc::ioctl(0, libc::TIOCSTI, c"x".as_ptr()), -1);
                assert_eq!(errno(), libc::EPERM);
                assert_eq!(libc::sched_yield(), 0);
            }
            let mut buf = [0u8; 4];
            std::hint::black_box(&mut buf);
        })
        .join()
        .unwrap();
        assert!(refused() >= before + 4, "each refusal counted");

        // The endpoint is handed its listener; the client lives outside the filter.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let before = refused();
        let endpoint = std::thread::spawn(move || {
            seccompiler::apply_filter(&metrics_filter(None)).unwrap();
            // A scrape on a thread of its own, named as the endpoint names it.
            let served = std::thread::Builder::new()
                .name("metrics-scrape".into())
                .spawn(move || {
                    let (mut conn, _) = listener.accept().unwrap();
                    conn.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                        .unwrap();
                    let mut got = [0u8; 3];
                    std::io::Read::read_exact(&mut conn, &mut got).unwrap();
                    std::io::Write::write_all(&mut conn, b"ok").unwrap();
                    got
                })
                .unwrap();
            assert_eq!(&served.join().unwrap(), b"GET");
            assert_eq!(refused(), before, "serving a scrape is refused nothing");
            // SAFETY: plain system calls with valid arguments.
            unsafe {
                assert_eq!(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0), -1);
                assert_eq!(errno(), libc::EPERM);
                assert_eq!(libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY), -1);
                assert_eq!(errno(), libc::EPERM);
            }
        });
        let mut client = std::net::TcpStream::connect(at).unwrap();
        std::io::Write::write_all(&mut client, b"GET").unwrap();
        let mut answer = Vec::new();
        std::io::Read::read_to_end(&mut client, &mut answer).unwrap();
        assert_eq!(answer, b"ok");
        endpoint.join().unwrap();

        std::thread::spawn(|| {
            seccompiler::apply_filter(&process_filter()).unwrap();
            // SAFETY: as above.
            unsafe {
                let s = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                assert!(s >= 0, "sockets are the migration's");
                libc::close(s);
                assert_eq!(libc::unshare(0), -1);
                assert_eq!(errno(), libc::EPERM);
                assert_eq!(libc::chroot(c"/".as_ptr()), -1);
                assert_eq!(errno(), libc::EPERM);
            }
            // Threads are still made (clone with CLONE_THREAD).
            std::thread::spawn(|| ()).join().unwrap();
        })
        .join()
        .unwrap();
    }

    /// A device thread of a process that will become nobody may become nobody (the C library
    /// has every thread make the call), and not anyone else.
    #[test]
    fn device_threads_may_become_only_the_user_named() {
        install_sigsys_handler().unwrap();
        let nobody = RunAs {
            uid: 65534,
            gid: 65534,
        };
        let _alone = ALONE.lock().unwrap();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            seccompiler::apply_filter(&device_filter(Some(nobody))).unwrap();
            // Raw calls change this thread alone (the C library's wrappers would change every
            // thread of the test process).
            let call = |nr, a: u32, b: u32, c: u32| {
                // SAFETY: a credential call on this thread with plain integer arguments.
                let r = unsafe { libc::syscall(nr, a, b, c) };
                (r, errno())
            };
            assert_eq!(
                call(libc::SYS_setresuid, 1000, 1000, 1000),
                (-1, libc::EPERM)
            );
            assert_eq!(
                call(libc::SYS_setresgid, 0, 65534, 65534),
                (-1, libc::EPERM)
            );
            assert_eq!(call(libc::SYS_setgroups, 1, 0, 0).0, -1);
            assert_eq!(call(libc::SYS_setgroups, 0, 0, 0).0, 0);
            assert_eq!(call(libc::SYS_setresgid, 65534, 65534, 65534).0, 0);
            assert_eq!(call(libc::SYS_setresuid, 65534, 65534, 65534).0, 0);
            // SAFETY: gettid takes nothing.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            let _ = done_rx.recv();
        });
        let tid = tid_rx.recv().unwrap();
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        let line = |key: &str| {
            status
                .lines()
                .find(|l| l.starts_with(key))
                .unwrap()
                .to_string()
        };
        assert_eq!(line("Uid:"), "Uid:\t65534\t65534\t65534\t65534");
        assert_eq!(line("Gid:"), "Gid:\t65534\t65534\t65534\t65534");
        assert_eq!(line("CapEff:"), "CapEff:\t0000000000000000");
        done_tx.send(()).unwrap();
        thread.join().unwrap();
        // SAFETY: reads this thread's id.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(euid, 0, "the rest of the process stays root");
    }
}
