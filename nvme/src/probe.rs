//! What this kernel's io_uring supports: opcodes (IORING_REGISTER_PROBE) and setup flags (tried).

use io_uring::{IoUring, Probe, cqueue, opcode, squeue};

/// One capability and whether it is there (with the reason when not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capability {
    /// Name.
    pub name: &'static str,
    /// Supported.
    pub ok: bool,
    /// Why not (errno text).
    pub detail: String,
}

/// io_uring opcodes and setup flags the loader cares about.
pub fn io_uring_support() -> Result<Vec<Capability>, std::io::Error> {
    let ring = IoUring::new(4)?;
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    let mut v: Vec<Capability> = [
        ("op READ", opcode::Read::CODE),
        ("op READ_FIXED", opcode::ReadFixed::CODE),
        ("op URING_CMD", opcode::UringCmd16::CODE),
        ("op ASYNC_CANCEL", opcode::AsyncCancel::CODE),
        ("op READV", opcode::Readv::CODE),
    ]
    .into_iter()
    .map(|(name, code)| Capability {
        name,
        ok: probe.is_supported(code),
        detail: String::new(),
    })
    .collect();
    let mut try_flag = |name: &'static str, r: std::io::Result<()>| {
        v.push(Capability {
            name,
            ok: r.is_ok(),
            detail: r.err().map(|e| e.to_string()).unwrap_or_default(),
        });
    };
    try_flag(
        "setup SQPOLL",
        IoUring::<squeue::Entry, cqueue::Entry>::builder()
            .setup_sqpoll(100)
            .build(4)
            .map(|_| ()),
    );
    try_flag(
        "setup SQE128+CQE32",
        IoUring::<squeue::Entry128, cqueue::Entry32>::builder()
            .build(4)
            .map(|_| ()),
    );
    try_flag(
        "setup SINGLE_ISSUER",
        IoUring::<squeue::Entry, cqueue::Entry>::builder()
            .setup_single_issuer()
            .build(4)
            .map(|_| ()),
    );
    try_flag(
        "setup DEFER_TASKRUN",
        IoUring::<squeue::Entry, cqueue::Entry>::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(4)
            .map(|_| ()),
    );
    try_flag(
        "register sparse buffers",
        IoUring::new(4).and_then(|r| r.submitter().register_buffers_sparse(8)),
    );
    Ok(v)
}
