//! Writes seed frames for `wire_decode` into `DIR/wire_decode/`: a header of every kind with short
//! payloads (the fuzzer starts past the magic and version). Usage: `net_seeds DIR`, built without
//! the fuzzing flags: `cargo run --manifest-path net/fuzz/Cargo.toml --bin net_seeds -- net/fuzz/seeds`.

use ubdirect_net::proto::{Header, Kind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::PathBuf::from(std::env::args_os().nth(1).ok_or("usage: net_seeds DIR")?)
        .join("wire_decode");
    std::fs::create_dir_all(&dir)?;
    let kinds = [
        Kind::Hello,
        Kind::HelloOk,
        Kind::Open,
        Kind::OpenOk,
        Kind::Read,
        Kind::ReadOk,
        Kind::Error,
        Kind::RdmaConnect,
        Kind::RdmaAccept,
        Kind::ReadTo,
        Kind::ReadDone,
        Kind::SmcOpen,
        Kind::SmcOpenOk,
        Kind::SmcRead,
        Kind::SmcWrite,
        Kind::SmcWriteOk,
        Kind::SmcWriteV,
    ];
    for (i, kind) in kinds.into_iter().enumerate() {
        for len in [0u32, 8, 40] {
            let mut f = Header { kind, id: 7, len }.encode().to_vec();
            f.extend(std::iter::repeat_n(1u8, len as usize));
            std::fs::write(dir.join(format!("seed-{i}-{len}")), f)?;
        }
    }
    // `smc_writev`: payloads (region, count, table, data) of 0, 1 and 3 ranges.
    let dir = dir.with_file_name("smc_writev");
    std::fs::create_dir_all(&dir)?;
    for (i, ranges) in [
        &[][..],
        &[(0u64, 4u32)][..],
        &[(0, 2), (4096, 3), (8192, 1)][..],
    ]
    .into_iter()
    .enumerate()
    {
        let mut p = 0u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
        for &(o, l) in ranges {
            p.extend_from_slice(&o.to_le_bytes());
            p.extend_from_slice(&l.to_le_bytes());
        }
        let data: u32 = ranges.iter().map(|r| r.1).sum();
        p.extend(std::iter::repeat_n(9u8, data as usize));
        std::fs::write(dir.join(format!("seed-{i}")), p)?;
    }
    Ok(())
}
