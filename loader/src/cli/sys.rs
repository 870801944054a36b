//! Raw OS calls of the CLI: the memlock limit and whether we are root (`ubdirect doctor`).

/// The soft RLIMIT_MEMLOCK in bytes (`u64::MAX` = unlimited), if it can be read.
pub(crate) fn memlock_limit() -> Option<u64> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    (r == 0).then_some(if rl.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        rl.rlim_cur
    })
}

/// Whether the effective user is root (and so holds CAP_IPC_LOCK in practice).
pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
