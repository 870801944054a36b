//! The FFI edge for RDMA verbs (feature `rdma`): device, protection domain, one completion queue with
//! an event channel, RC queue pairs, memory regions over memory we already own, and one-sided RDMA
//! WRITE. Bindings come from the `ibverbs` crate (`ibverbs::ffi`, rdma-core's headers); its safe API
//! cannot register foreign memory or post one-sided verbs, so those few calls are made here
//! (docs/decisions.md). Every unsafe block is in this file.

use std::ffi::CStr;
use std::ptr;
use std::sync::Arc;

use ibverbs_sys as ffi;

const PORT: u8 = 1;

/// What the peer needs to connect a queue pair to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number we send.
    pub psn: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active path MTU (`ibv_mtu` enum value, 1..=5).
    pub mtu: u8,
    /// Port GID (RoCE: the IP address as a GID).
    pub gid: [u8; 16],
}

/// An opened device: context, protection domain, completion channel and one completion queue.
pub struct Device {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    chan: *mut ffi::ibv_comp_channel,
    cq: *mut ffi::ibv_cq,
    /// Device name (`rxe0`, `mlx5_0`).
    pub name: String,
    /// Port LID.
    pub lid: u16,
    /// Port active MTU.
    pub mtu: u8,
    /// GID index in use.
    pub gid_index: u8,
    /// GID at that index.
    pub gid: [u8; 16],
    /// Completion queue entries.
    pub cq_depth: u32,
}

// SAFETY: libibverbs objects may be used from any thread (rdma-core documents verbs as thread-safe);
// the pointers are only freed in Drop, which takes `&mut self`.
unsafe impl Send for Device {}
// SAFETY: as above; every call through `&self` is a thread-safe verb.
unsafe impl Sync for Device {}

fn err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// Names of the RDMA devices present (empty when there are none or no RDMA in the kernel).
pub fn device_names() -> std::io::Result<Vec<String>> {
    let mut n = 0i32;
    // SAFETY: ibv_get_device_list writes the count into `n` and returns a NULL-terminated array that
    // we free below; names are copied before freeing.
    unsafe {
        let list = ffi::ibv_get_device_list(&mut n);
        if list.is_null() {
            return Err(std::io::Error::last_os_error());
        }
        let mut out = Vec::new();
        for i in 0..n.max(0) as usize {
            let d = *list.add(i);
            if d.is_null() {
                break;
            }
            let name = ffi::ibv_get_device_name(d);
            if !name.is_null() {
                out.push(CStr::from_ptr(name).to_string_lossy().into_owned());
            }
        }
        ffi::ibv_free_device_list(list);
        Ok(out)
    }
}

/// Opens device `name` (the first when `None`): its context, and its name. The caller owns the
/// context (a [`Device`] made over it closes it in Drop).
fn open_context(name: Option<&str>) -> Result<(*mut ffi::ibv_context, String), String> {
    let mut n = 0i32;
    // SAFETY: see device_names; the chosen device is opened before the list is freed (a context
    // stays valid after ibv_free_device_list), and the list is freed on every path after it was
    // got.
    unsafe {
        let list = ffi::ibv_get_device_list(&mut n);
        if list.is_null() {
            return Err(err("ibv_get_device_list"));
        }
        let mut chosen: *mut ffi::ibv_device = ptr::null_mut();
        let mut names = Vec::new();
        for i in 0..n.max(0) as usize {
            let d = *list.add(i);
            if d.is_null() {
                break;
            }
            let p = ffi::ibv_get_device_name(d);
            let dn = if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            };
            if chosen.is_null() && name.is_none_or(|w| w == dn) {
                chosen = d;
                names.insert(0, dn);
            } else {
                names.push(dn);
            }
        }
        if chosen.is_null() {
            ffi::ibv_free_device_list(list);
            return Err(match name {
                Some(w) => format!("RDMA device {w:?} not found (present: {names:?})"),
                None => "no RDMA device (load rdma_rxe and `rdma link add` for Soft-RoCE)".into(),
            });
        }
        let ctx = ffi::ibv_open_device(chosen);
        ffi::ibv_free_device_list(list);
        if ctx.is_null() {
            return Err(err(&format!("ibv_open_device({})", names[0])));
        }
        Ok((ctx, names.swap_remove(0)))
    }
}

impl Device {
    /// Opens device `name` (the first when `None`), port 1, at GID index `gid_index` (when `None`:
    /// the first RoCE v2 GID holding an IPv4 address, else the first RoCE v2, else index 0).
    pub fn open(name: Option<&str>, gid_index: Option<u8>, cq_depth: u32) -> Result<Self, String> {
        let (ctx, dev_name) = open_context(name)?;
        let mut d = Device {
            ctx,
            pd: ptr::null_mut(),
            chan: ptr::null_mut(),
            cq: ptr::null_mut(),
            name: dev_name,
            lid: 0,
            mtu: 0,
            gid_index: 0,
            gid: [0; 16],
            cq_depth,
        };
        // From here on, Drop releases whatever was made.
        let gid_table_len = d.query_port()?;
        d.choose_gid(gid_index, gid_table_len)?;
        d.create_queues()?;
        d.arm()?;
        Ok(d)
    }

    /// Checks that port 1 is active and takes its LID and MTU; returns its GID table's length.
    fn query_port(&mut self) -> Result<i32, String> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: ctx is open (a Device is only made over an opened context, closed in Drop); the
        // compat struct is a prefix of ibv_port_attr (as the ibverbs crate calls it), and `attr` is
        // a live, exclusively borrowed ibv_port_attr for the call.
        let rc = unsafe { ffi::ibv_query_port(self.ctx, PORT, &mut attr as *mut _ as *mut _) };
        if rc != 0 {
            return Err(format!(
                "ibv_query_port({}): {}",
                self.name,
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        if attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(format!(
                "{} port 1 is not active (state {})",
                self.name, attr.state
            ));
        }
        self.lid = attr.lid;
        self.mtu = attr.active_mtu as u8;
        Ok(attr.gid_tbl_len)
    }

    /// Picks the GID at `gid_index` (when `None`: the first RoCE v2 GID holding an IPv4 address,
    /// else the first RoCE v2, else the first) from the port's GID table of `table_len` entries.
    fn choose_gid(&mut self, gid_index: Option<u8>, table_len: i32) -> Result<(), String> {
        let mut table = vec![ffi::ibv_gid_entry::default(); table_len.max(0) as usize];
        // SAFETY: ctx is open; the table has `table.len()` entries of the size we pass, so the call
        // writes only inside it; it returns how many it filled (negative on error), and the table
        // is truncated to that before any entry is read.
        let got = unsafe {
            ffi::_ibv_query_gid_table(
                self.ctx,
                table.as_mut_ptr(),
                table.len(),
                0,
                std::mem::size_of::<ffi::ibv_gid_entry>(),
            )
        };
        table.truncate(got.max(0) as usize);
        // SAFETY: `raw` is the byte view of the 16-byte GID union: every bit pattern is a valid
        // [u8; 16], and the entry was initialised (default, then filled by the query).
        let raw = |e: &ffi::ibv_gid_entry| unsafe { e.gid.raw };
        let v4 = |g: &[u8; 16]| g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
        let pick = match gid_index {
            Some(i) => table.iter().find(|e| e.gid_index == i as u32),
            None => table
                .iter()
                .find(|e| e.gid_type == ffi::IBV_GID_TYPE_ROCE_V2 && v4(&raw(e)))
                .or_else(|| {
                    table
                        .iter()
                        .find(|e| e.gid_type == ffi::IBV_GID_TYPE_ROCE_V2)
                })
                .or_else(|| table.first()),
        };
        let Some(e) = pick else {
            return Err(format!(
                "{}: GID index {gid_index:?} not in the GID table ({} entries)",
                self.name,
                table.len()
            ));
        };
        self.gid_index = e.gid_index as u8;
        self.gid = raw(e);
        Ok(())
    }

    /// Allocates the protection domain, the completion channel (nonblocking) and the completion
    /// queue of `cq_depth` entries on it.
    fn create_queues(&mut self) -> Result<(), String> {
        // SAFETY: ctx is open; each result is checked before use and owned by `self` (freed in Drop,
        // children first; a null one is skipped there). The channel's fd is live while the channel
        // is, and fcntl on it only changes its flags.
        unsafe {
            self.pd = ffi::ibv_alloc_pd(self.ctx);
            if self.pd.is_null() {
                return Err(err("ibv_alloc_pd"));
            }
            self.chan = ffi::ibv_create_comp_channel(self.ctx);
            if self.chan.is_null() {
                return Err(err("ibv_create_comp_channel"));
            }
            let fd = (*self.chan).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            self.cq = ffi::ibv_create_cq(
                self.ctx,
                self.cq_depth as i32,
                ptr::null_mut(),
                self.chan,
                0,
            );
            if self.cq.is_null() {
                return Err(err("ibv_create_cq"));
            }
        }
        Ok(())
    }

    /// Asks for an event on the next completion.
    pub fn arm(&self) -> Result<(), String> {
        // SAFETY: cq is live; req_notify_cq is set by every provider.
        let rc = unsafe {
            let ops = &(*(*self.cq).context).ops;
            match ops.req_notify_cq {
                Some(f) => f(self.cq, 0),
                None => return Err("provider has no req_notify_cq".into()),
            }
        };
        if rc != 0 {
            return Err(format!(
                "ibv_req_notify_cq: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        Ok(())
    }

    /// Waits up to `timeout_ms` for a completion event; true when one came (it is acknowledged).
    pub fn wait(&self, timeout_ms: i32) -> Result<bool, String> {
        // SAFETY: chan is live; the pollfd is ours.
        let fd = unsafe { (*self.chan).fd };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if n <= 0 {
            return Ok(false);
        }
        let mut cq = ptr::null_mut();
        let mut cq_ctx = ptr::null_mut();
        // SAFETY: the channel is non-blocking; on success the event is acked once, as required before
        // ibv_destroy_cq.
        unsafe {
            if ffi::ibv_get_cq_event(self.chan, &mut cq, &mut cq_ctx) != 0 {
                return Ok(false);
            }
            ffi::ibv_ack_cq_events(cq, 1);
        }
        Ok(true)
    }

    /// Pops up to `out.len()` completions: (wr_id, None on success or the failure text).
    pub fn poll(&self, out: &mut Vec<(u64, Option<String>)>, max: usize) -> Result<(), String> {
        let mut wc = vec![ffi::ibv_wc::default(); max.max(1)];
        // SAFETY: cq is live; poll_cq writes at most `len` entries.
        let n = unsafe {
            let ops = &(*(*self.cq).context).ops;
            match ops.poll_cq {
                Some(f) => f(self.cq, wc.len() as i32, wc.as_mut_ptr()),
                None => return Err("provider has no poll_cq".into()),
            }
        };
        if n < 0 {
            return Err("ibv_poll_cq failed".into());
        }
        for w in &wc[..n as usize] {
            let why = w.error().map(|(st, vendor)| {
                // SAFETY: ibv_wc_status_str returns a static string for any status.
                let s = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(st)) };
                format!("{} (vendor error {vendor})", s.to_string_lossy())
            });
            out.push((w.wr_id(), why));
        }
        Ok(())
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: each object was created by us and is destroyed once, children first; queue pairs
        // and memory regions hold an Arc<Device>, so none outlives it.
        unsafe {
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            if !self.chan.is_null() {
                ffi::ibv_destroy_comp_channel(self.chan);
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// A memory region over memory the caller owns (a pool's blocks).
pub struct MemoryRegion {
    mr: *mut ffi::ibv_mr,
    _dev: Arc<Device>,
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Local key.
    pub lkey: u32,
    /// Remote key (meaningful when registered with remote access).
    pub rkey: u32,
}

// SAFETY: an ibv_mr is an immutable handle once registered; deregistration happens in Drop only.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

/// What a peer may do to our memory through a queue pair or a memory region (local writes are always
/// allowed: received data and RDMA READ results land in it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerAccess {
    /// Nothing: the memory is ours alone.
    None,
    /// One-sided RDMA WRITE into it.
    Write,
    /// One-sided RDMA READ from it.
    Read,
    /// Both.
    ReadWrite,
}

impl PeerAccess {
    fn flags(self) -> u32 {
        use ffi::ibv_access_flags as a;
        a::IBV_ACCESS_LOCAL_WRITE.0
            | match self {
                PeerAccess::None => 0,
                PeerAccess::Write => a::IBV_ACCESS_REMOTE_WRITE.0,
                PeerAccess::Read => a::IBV_ACCESS_REMOTE_READ.0,
                PeerAccess::ReadWrite => a::IBV_ACCESS_REMOTE_WRITE.0 | a::IBV_ACCESS_REMOTE_READ.0,
            }
    }
}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` for local writes and what `peer` may do to them one-sided.
    ///
    /// # Safety
    /// The memory must stay mapped until the region is dropped.
    pub unsafe fn register(
        dev: &Arc<Device>,
        addr: *mut u8,
        len: usize,
        peer: PeerAccess,
    ) -> Result<Self, String> {
        let access = peer.flags();
        // SAFETY: pd is live; the caller keeps the memory mapped for the region's life.
        let mr = unsafe { ffi::ibv_reg_mr(dev.pd, addr.cast(), len, access as i32) };
        if mr.is_null() {
            return Err(err(&format!("ibv_reg_mr({len} bytes on {})", dev.name)));
        }
        // SAFETY: mr is a valid registration.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Self {
            mr,
            _dev: dev.clone(),
            addr: addr as u64,
            len: len as u64,
            lkey,
            rkey,
        })
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by us, deregistered once.
        unsafe {
            ffi::ibv_dereg_mr(self.mr);
        }
    }
}

/// An RC queue pair on a device's completion queue.
pub struct QueuePair {
    qp: *mut ffi::ibv_qp,
    dev: Arc<Device>,
    /// Our endpoint, to send to the peer.
    pub local: Endpoint,
}

// SAFETY: posting to a QP is thread-safe in libibverbs; the QP is destroyed in Drop only.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

impl QueuePair {
    /// Creates an RC queue pair with room for `max_wr` outstanding sends.
    pub fn new(dev: &Arc<Device>, max_wr: u32, psn: u32) -> Result<Self, String> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: dev.cq,
            recv_cq: dev.cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: max_wr.max(1),
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: pd and cq are live; init is fully initialised.
        let qp = unsafe { ffi::ibv_create_qp(dev.pd, &mut init) };
        if qp.is_null() {
            return Err(err(&format!("ibv_create_qp on {}", dev.name)));
        }
        // SAFETY: qp is valid.
        let qpn = unsafe { (*qp).qp_num };
        Ok(Self {
            qp,
            dev: dev.clone(),
            local: Endpoint {
                qpn,
                psn: psn & 0xff_ffff,
                lid: dev.lid,
                mtu: dev.mtu,
                gid: dev.gid,
            },
        })
    }

    fn modify(&self, attr: &mut ffi::ibv_qp_attr, mask: u32, step: &str) -> Result<(), String> {
        // SAFETY: qp is live and attr initialised for the fields named by mask.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask as i32) };
        if rc != 0 {
            return Err(format!(
                "ibv_modify_qp to {step}: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        Ok(())
    }

    /// INIT → RTR → RTS towards `remote`; `peer` is what the peer may do to our memory regions
    /// (each region's own access flags narrow it further).
    pub fn connect(&self, remote: &Endpoint, peer: PeerAccess) -> Result<(), String> {
        use ffi::ibv_qp_attr_mask as m;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: peer.flags(),
            ..Default::default()
        };
        self.modify(
            &mut a,
            (m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS).0,
            "INIT",
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: self.local.mtu.min(remote.mtu).max(1) as _,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = PORT;
        if remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.sgid_index = self.dev.gid_index;
        }
        self.modify(
            &mut a,
            (m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER)
                .0,
            "RTR",
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: self.local.psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            &mut a,
            (m::IBV_QP_STATE
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_MAX_QP_RD_ATOMIC)
                .0,
            "RTS",
        )
    }

    /// Posts a signaled one-sided RDMA WRITE of `len` bytes from `local` (in region `lkey`) to
    /// `remote_addr` (region `rkey` of the peer).
    ///
    /// # Safety
    /// The local bytes must stay valid and unchanged until the completion for `wr_id` is polled (or
    /// the queue pair is destroyed).
    pub unsafe fn post_write(
        &self,
        wr_id: u64,
        local: *const u8,
        len: u32,
        lkey: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), String> {
        // SAFETY: forwarded: the caller's contract is post()'s.
        unsafe {
            self.post(
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                wr_id,
                local.cast_mut(),
                len,
                lkey,
                remote_addr,
                rkey,
            )
        }
    }

    /// Posts a signaled one-sided RDMA READ of `len` bytes at the peer's `remote_addr` (region
    /// `rkey`) into `local` (in region `lkey`).
    ///
    /// # Safety
    /// The local bytes must stay valid, and nothing else may read or write them, until the completion
    /// for `wr_id` is polled (or the queue pair is destroyed): the device writes them at any time
    /// until then.
    pub unsafe fn post_read(
        &self,
        wr_id: u64,
        local: *mut u8,
        len: u32,
        lkey: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), String> {
        // SAFETY: forwarded: the caller's contract is post()'s.
        unsafe {
            self.post(
                ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
                wr_id,
                local,
                len,
                lkey,
                remote_addr,
                rkey,
            )
        }
    }

    /// # Safety
    /// See [`QueuePair::post_write`] / [`QueuePair::post_read`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn post(
        &self,
        opcode: ffi::ibv_wr_opcode::Type,
        wr_id: u64,
        local: *mut u8,
        len: u32,
        lkey: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), String> {
        let mut sge = ffi::ibv_sge {
            addr: local as u64,
            length: len,
            lkey,
        };
        // SAFETY: zeroed is a valid ibv_send_wr (null pointers, zero counts); fields set below.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = opcode;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        let mut bad = ptr::null_mut();
        // SAFETY: qp is live; wr and sge outlive the call (the provider copies them); the caller
        // keeps the local bytes valid (and, for a READ, untouched) until completion.
        let rc = unsafe {
            let ops = &(*(*self.qp).context).ops;
            match ops.post_send {
                Some(f) => f(self.qp, &mut wr, &mut bad),
                None => return Err("provider has no post_send".into()),
            }
        };
        if rc != 0 {
            return Err(format!(
                "ibv_post_send: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        Ok(())
    }

    /// Moves the queue pair to the error state: outstanding work requests complete as flushed.
    pub fn set_error(&self) {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
            ..Default::default()
        };
        let _ = self.modify(&mut a, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0, "ERR");
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once; after this returns the device no longer touches
        // memory through this queue pair.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
        }
    }
}
