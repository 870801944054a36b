//! Raw NVMe passthrough ABI (linux/nvme_ioctl.h): the command structs and ioctl numbers, through nix.
//! The only place with the kernel's layouts; `passthru.rs` builds safe types on top.

#![allow(non_camel_case_types)]

/// `struct nvme_passthru_cmd` (also `nvme_admin_cmd`): 72 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct nvme_passthru_cmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub result: u32,
}

/// `struct nvme_passthru_cmd64`: 80 bytes, 64-bit result.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct nvme_passthru_cmd64 {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub rsvd2: u32,
    pub result: u64,
}

/// `struct nvme_uring_cmd`: the 72-byte payload of an `IORING_OP_URING_CMD` SQE128.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct nvme_uring_cmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub rsvd2: u32,
}

impl nvme_uring_cmd {
    /// The 80-byte command area of an `IORING_OP_URING_CMD` SQE128 holding this command, field by
    /// field at the kernel's offsets (native byte order; the last 8 bytes are zero).
    pub fn to_cmd_bytes(&self) -> [u8; 80] {
        let mut b = [0u8; 80];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.rsvd1.to_ne_bytes());
        let words: [(usize, u32); 13] = [
            (4, self.nsid),
            (8, self.cdw2),
            (12, self.cdw3),
            (32, self.metadata_len),
            (36, self.data_len),
            (40, self.cdw10),
            (44, self.cdw11),
            (48, self.cdw12),
            (52, self.cdw13),
            (56, self.cdw14),
            (60, self.cdw15),
            (64, self.timeout_ms),
            (68, self.rsvd2),
        ];
        for (o, w) in words {
            b[o..o + 4].copy_from_slice(&w.to_ne_bytes());
        }
        b[16..24].copy_from_slice(&self.metadata.to_ne_bytes());
        b[24..32].copy_from_slice(&self.addr.to_ne_bytes());
        b
    }
}

const _: () = assert!(std::mem::size_of::<nvme_passthru_cmd>() == 72);
const _: () = assert!(std::mem::size_of::<nvme_passthru_cmd64>() == 80);
const _: () = assert!(std::mem::size_of::<nvme_uring_cmd>() == 72);

nix::ioctl_none!(nvme_ioctl_id, b'N', 0x40);
nix::ioctl_readwrite!(nvme_ioctl_admin_cmd, b'N', 0x41, nvme_passthru_cmd);
nix::ioctl_readwrite!(nvme_ioctl_io_cmd, b'N', 0x43, nvme_passthru_cmd);
nix::ioctl_readwrite!(nvme_ioctl_admin64_cmd, b'N', 0x47, nvme_passthru_cmd64);
nix::ioctl_readwrite!(nvme_ioctl_io64_cmd, b'N', 0x48, nvme_passthru_cmd64);

/// `NVME_URING_CMD_IO`: `_IOWR('N', 0x80, struct nvme_uring_cmd)`.
pub const NVME_URING_CMD_IO: u32 =
    nix::request_code_readwrite!(b'N', 0x80, std::mem::size_of::<nvme_uring_cmd>()) as u32;
/// `NVME_URING_CMD_ADMIN`: `_IOWR('N', 0x82, struct nvme_uring_cmd)`.
pub const NVME_URING_CMD_ADMIN: u32 =
    nix::request_code_readwrite!(b'N', 0x82, std::mem::size_of::<nvme_uring_cmd>()) as u32;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uring_cmd_bytes_follow_the_struct_layout() {
        use std::mem::offset_of;
        let c = nvme_uring_cmd {
            opcode: 0x02,
            flags: 0x11,
            rsvd1: 0x2233,
            nsid: 7,
            cdw2: 0x0a0b_0c0d,
            cdw3: 3,
            metadata: 0x0102_0304_0506_0708,
            addr: 0xdead_beef_0000_1000,
            metadata_len: 9,
            data_len: 4096,
            cdw10: 10,
            cdw11: 11,
            cdw12: 12,
            cdw13: 13,
            cdw14: 14,
            cdw15: 15,
            timeout_ms: 16,
            rsvd2: 17,
        };
        let b = c.to_cmd_bytes();
        let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
        assert_eq!(b[offset_of!(nvme_uring_cmd, opcode)], 0x02);
        assert_eq!(b[offset_of!(nvme_uring_cmd, flags)], 0x11);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, nsid)), 7);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, cdw2)), 0x0a0b_0c0d);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, cdw3)), 3);
        assert_eq!(
            u64_at(offset_of!(nvme_uring_cmd, metadata)),
            0x0102_0304_0506_0708
        );
        assert_eq!(
            u64_at(offset_of!(nvme_uring_cmd, addr)),
            0xdead_beef_0000_1000
        );
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, metadata_len)), 9);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, data_len)), 4096);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, cdw10)), 10);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, cdw12)), 12);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, cdw15)), 15);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, timeout_ms)), 16);
        assert_eq!(u32_at(offset_of!(nvme_uring_cmd, rsvd2)), 17);
        assert_eq!(&b[72..], &[0u8; 8]);
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        assert_eq!(
            nix::request_code_readwrite!(b'N', 0x41, std::mem::size_of::<nvme_passthru_cmd>()),
            0xC048_4E41
        );
        assert_eq!(
            nix::request_code_readwrite!(b'N', 0x43, std::mem::size_of::<nvme_passthru_cmd>()),
            0xC048_4E43
        );
        assert_eq!(
            nix::request_code_readwrite!(b'N', 0x47, std::mem::size_of::<nvme_passthru_cmd64>()),
            0xC050_4E47
        );
        assert_eq!(
            nix::request_code_readwrite!(b'N', 0x48, std::mem::size_of::<nvme_passthru_cmd64>()),
            0xC050_4E48
        );
        assert_eq!(NVME_URING_CMD_IO, 0xC048_4E80);
        assert_eq!(NVME_URING_CMD_ADMIN, 0xC048_4E82);
    }
}
