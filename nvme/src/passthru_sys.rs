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
