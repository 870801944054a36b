#!/usr/bin/env bash
# Boots a throwaway QEMU guest (TCG) with two emulated NVMe controllers and a virtio NIC carrying
# Soft-RoCE (rdma_rxe), and runs inside it: the NVMe test binary (nvme/examples/guest_nvme.rs), loader
# epochs with io = nvme vs io = file, the transport conformance suite over RDMA (net/tests/
# conformance.rs), the SMC suite over RDMA (net/tests/smc.rs), a loader epoch from `ubdirect serve`
# over RDMA vs the local read, doctor and the nvme/remote/smc benches (functional only). Fails unless
# every check passes.
#
#   nvme/tests/guest/run.sh [WORKDIR]
#
# Downloads are cached in ${UBDIRECT_GUEST_CACHE:-~/.cache/ubdirect/guest}: Debian's kernel package
# (full flavour: NVMe as modules), extracted to an uncompressed vmlinux that QEMU boots through the
# PVH entry. Runs as root (apt-get); takes about a minute from nothing, seconds when cached.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
CACHE=${UBDIRECT_GUEST_CACHE:-$HOME/.cache/ubdirect/guest}
W=${1:-$(mktemp -d)}
mkdir -p "$CACHE" "$W"

need=""
command -v qemu-system-x86_64 >/dev/null || need="$need qemu-system-x86"
command -v busybox >/dev/null || need="$need busybox-static"
# The rdma feature: rdma-core headers and provider (rxe), cmake + libclang for ibverbs-sys, iproute2's rdma.
[ -f /usr/include/infiniband/verbs.h ] || need="$need libibverbs-dev"
[ -f /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so ] || need="$need ibverbs-providers"
command -v cmake >/dev/null || need="$need cmake"
ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 || need="$need libclang-dev"
command -v rdma >/dev/null || need="$need iproute2"
if [ -n "$need" ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends $need >/dev/null
fi

# Kernel: Debian's linux-image (modules: nvme), uncompressed to an ELF vmlinux.
KPKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
KV=${KPKG#linux-image-}
if [ ! -f "$CACHE/$KV/vmlinux" ]; then
  rm -rf "$CACHE/$KV.tmp" && mkdir -p "$CACHE/$KV.tmp" && (cd "$CACHE/$KV.tmp" && timeout 600 apt-get download "$KPKG" >/dev/null 2>&1)
  dpkg-deb -x "$CACHE/$KV.tmp"/*.deb "$CACHE/$KV.tmp/root"
  busybox depmod -b "$CACHE/$KV.tmp/root" "$KV"
  python3 - "$CACHE/$KV.tmp/root/boot/vmlinuz-$KV" "$CACHE/$KV.tmp/vmlinux" <<'PY'
import lzma, sys
d = open(sys.argv[1], "rb").read(); i = d.find(b"\xfd7zXZ\x00")
open(sys.argv[2], "wb").write(lzma.LZMADecompressor().decompress(d[i:]))
PY
  rm -f "$CACHE/$KV.tmp"/*.deb && rm -rf "$CACHE/$KV" && mv "$CACHE/$KV.tmp" "$CACHE/$KV"
fi
K=$CACHE/$KV

# The test binaries (dynamically linked against the host's glibc, which goes into the initramfs), from
# one release build of the whole workspace with the rdma feature: the same build (features, target) as
# CI's release phase, the README walk's and the bench's, so nothing here compiles twice.
FEAT=${UBDIRECT_RELEASE_FEATURES:-ubdirect-bench/rdma}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
(cd "$ROOT" && cargo build -q --release --workspace --features "$FEAT" --bins --examples)
# The suites run in the guest: net's transport conformance and SMC suites over RDMA, the Source
# conformance suites of nvme (NvmeSource on the ext4 namespace) and net (RemoteSource over RDMA).
SUITES=$(cd "$ROOT" && cargo test -q --release --workspace --features "$FEAT" --no-run --message-format=json \
    --test conformance --test source_conformance --test smc |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("profile", {}).get("test"):
        print(m["package_id"].split("#")[0].rsplit("/", 1)[-1].split("@")[0].split(":")[0], m["target"]["name"], m["executable"])')
suite() { awk -v p="$1" -v t="$2" '$1 == p && $2 == t {print $3}' <<<"$SUITES"; }
CONF=$(suite net conformance)
SRCCONF=$(suite nvme source_conformance)
SMCT=$(suite net smc)
NETSRC=$(suite net source_conformance)
for s in CONF SRCCONF SMCT NETSRC; do [ -x "${!s}" ] || { echo "guest: no test binary for $s in: $SUITES"; exit 1; }; done
BIN=$TARGET/release/examples/guest_nvme
UBD=$TARGET/release/ubdirect
UBB=$TARGET/release/ubdirect-bench

# Disk image: 64 MiB, block n starts with "LBA%08u", then bytes (i + n) & 0xff.
python3 - "$W/disk.img" <<'PY'
import sys
bs = 512
with open(sys.argv[1], "wb") as f:
    for lba in range((64 << 20) // bs):
        b = bytearray((i + lba) & 0xff for i in range(bs)); b[0:16] = (b"LBA%08u" % lba).ljust(16, b"\0")
        f.write(b)
PY

# Second disk: an MBR partition at 1 MiB holding ext4 with generated shards (the extent path is
# tested against the file path on it).
rm -rf "$W/fs" && mkdir -p "$W/fs/raw" "$W/fs/megatron" "$W/fs/conf" && "$UBD" gen --out "$W/fs/raw" --format raw --samples 3000 --shards 3 >/dev/null && "$UBD" gen --out "$W/fs/megatron" --format megatron --samples 2000 --shards 2 >/dev/null
# The conformance shard: random bytes, a 1 MiB hole, more random bytes and a ragged tail.
python3 - "$W/fs/conf/shard.bin" <<'PY'
import random, sys
r = random.Random(12)
with open(sys.argv[1], "wb") as f:
    f.write(r.randbytes(3 << 20)); f.seek(1 << 20, 1); f.write(r.randbytes((1 << 20) + 777))
PY
python3 - "$W/ext4.img" <<'PY'
import struct, sys
size = 96 << 20
with open(sys.argv[1], "wb") as f:
    f.truncate(size)
    start, count = 2048, size // 512 - 2048
    entry = bytes([0, 0, 0, 0, 0x83, 0, 0, 0]) + struct.pack("<II", start, count)
    f.seek(446); f.write(entry); f.seek(510); f.write(b"\x55\xaa")
PY
mke2fs -q -t ext4 -F -E offset=1048576 -d "$W/fs" "$W/ext4.img" $(( (96 - 1) * 1024 ))k

ST=$W/stage; rm -rf "$ST"; MD=$K/root/lib/modules/$KV
mkdir -p "$ST"/{bin,sbin,proc,sys,dev,tmp,mnt,cfg,lib64,lib/x86_64-linux-gnu,lib/modules/$KV}
cp "$(command -v busybox)" "$ST/bin/"; cp "$BIN" "$ST/bin/guest_nvme"; cp "$UBD" "$ST/bin/ubdirect"; cp "$UBB" "$ST/bin/ubdirect-bench"
cp "$CONF" "$ST/bin/conformance"; cp "$SRCCONF" "$ST/bin/source_conformance"; cp "$(command -v rdma)" "$ST/bin/rdma-tool"
cp "$NETSRC" "$ST/bin/net_source_conformance"; cp "$SMCT" "$ST/bin/smc_suite"
# Verbs userspace: libibverbs (linked), the rxe provider it loads, and the provider's config.
PROV=/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so
mkdir -p "$ST/usr/lib/x86_64-linux-gnu/libibverbs" "$ST/etc/libibverbs.d"
cp -L "$PROV" "$ST/usr/lib/x86_64-linux-gnu/libibverbs/"; cp /etc/libibverbs.d/rxe.driver "$ST/etc/libibverbs.d/"
ldd "$BIN" "$UBD" "$UBB" "$CONF" "$SRCCONF" "$PROV" "$(command -v rdma)" | awk '/=>/{print $3}' | sort -u | xargs -I{} cp -L {} "$ST/lib/x86_64-linux-gnu/"
ldd "$NETSRC" "$SMCT" | awk '/=>/{print $3}' | sort -u | xargs -I{} cp -L {} "$ST/lib/x86_64-linux-gnu/"
cp -L /lib/x86_64-linux-gnu/libgcc_s.so.1 "$ST/lib/x86_64-linux-gnu/"
for fmt in raw megatron; do for io in file nvme; do cat > "$ST/cfg/$fmt-$io.toml" <<CFG
[dataset]
format = "$fmt"
dir = "/mnt/$fmt"
generate = false
record_len = 2048
[loader]
batch_size = 32
seed = 9
[device]
select = "host"
[engine]
io = "$io"
[pool]
staging_blocks = 16
CFG
done; done
cp -L /lib64/ld-linux-x86-64.so.2 "$ST/lib64/"
# Remote configs: the same shards through `ubdirect serve` over RDMA.
cat > "$ST/cfg/serve.toml" <<CFG
[serve]
listen = "192.0.2.1:7447"
token = "guest-rdma-token-0123456789"
rdma_device = "rxe0"
max_request = "1MiB"
blocks = 32
[serve.roots]
data = "/mnt"
CFG
for fmt in raw megatron; do
  if [ $fmt = raw ]; then P=$(cd "$W/fs" && ls raw/*.bin | sed 's|^|"ub://192.0.2.1:7447/data/|; s|$|"|' | paste -sd, -)
  else P=$(cd "$W/fs" && ls megatron/*.idx | sed 's|\.idx$||; s|^|"ub://192.0.2.1:7447/data/|; s|$|"|' | paste -sd, -); fi
  sed -e "s|^dir = .*|paths = [$P]|" "$ST/cfg/$fmt-file.toml" > "$ST/cfg/$fmt-rdma.toml"
  printf '[remote]\ntoken = "guest-rdma-token-0123456789"\ntransport = "rdma"\nrdma_device = "rxe0"\ndeadline_ms = 60000\n' >> "$ST/cfg/$fmt-rdma.toml"
done
for m in nvme crct10dif_generic crc64_rocksoft_generic ext4 crc32c_generic crc32_generic virtio_pci virtio_net rdma_rxe ib_uverbs rdma_ucm; do
  for f in $(grep -E "/$m\.ko[^:]*:" "$MD/modules.dep" | cut -d: -f1); do
    mkdir -p "$ST/lib/modules/$KV/$(dirname "$f")"; cp -n "$MD/$f" "$ST/lib/modules/$KV/$f"
    for d in $(grep -E "^$f:" "$MD/modules.dep" | cut -d: -f2); do mkdir -p "$ST/lib/modules/$KV/$(dirname "$d")"; cp -n "$MD/$d" "$ST/lib/modules/$KV/$d"; done
  done
done
busybox depmod -b "$ST" "$KV"
cat > "$ST/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin; ln -s /bin/busybox /sbin/modprobe
export PATH=/bin:/sbin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
modprobe nvme; modprobe crc32c_generic; modprobe ext4
for i in $(seq 100); do [ -e /dev/ng1n1 ] && [ -e /dev/ng0n1 ] && break; sleep 0.1; done
for i in $(seq 50); do ls /dev/nvme*n1p1 >/dev/null 2>&1 && break; sleep 0.1; done
ulimit -l unlimited
for c in /sys/class/nvme/nvme*; do [ "$(cat $c/serial | tr -d ' ')" = deadbeef ] && export UB_NVME=${c#/sys/class/nvme/nvme}; done
/bin/guest_nvme
echo "GUEST EXIT $?"
P=$(ls /dev/nvme*n1p1 | head -1)
mount -t ext4 -o ro $P /mnt && echo "PASS: mounted $P (ext4 on a partition of the second namespace)" || echo "FAIL: mount $P"
mount -o remount,rw /mnt && mkdir -p /mnt/scratch
UBDIRECT_TEST_NVME_FILE=/mnt/conf/shard.bin UBDIRECT_TEST_NVME_DIR=/mnt/scratch /bin/source_conformance --nocapture --test-threads 1 > /tmp/srcconf.log 2>&1
rm -rf /mnt/scratch; mount -o remount,ro /mnt
grep -a "^conformance \[nvme" /tmp/srcconf.log | sed 's/^/CONFORMANCE /'
R=$(grep "test result" /tmp/srcconf.log)
case "$R" in *" 0 failed"*) echo "PASS: source conformance, NvmeSource on /mnt/conf/shard.bin (URING_CMD, fixed buffers): $R";; *) echo "FAIL: source conformance (nvme)"; tail -30 /tmp/srcconf.log;; esac
for fmt in raw megatron; do
  ubdirect run --config /cfg/$fmt-file.toml --json --dump-samples /tmp/$fmt-file.jsonl > /tmp/$fmt-file.json 2>/tmp/$fmt-file.err
  ubdirect run --config /cfg/$fmt-nvme.toml --json --dump-samples /tmp/$fmt-nvme.jsonl > /tmp/$fmt-nvme.json 2>/tmp/$fmt-nvme.err
  N=$(wc -l < /tmp/$fmt-nvme.jsonl)
  if [ "$N" -gt 0 ] && cmp -s /tmp/$fmt-file.jsonl /tmp/$fmt-nvme.jsonl && grep -q "NVMe passthrough" /tmp/$fmt-nvme.json; then
    echo "PASS: $fmt epoch with io = nvme delivers the same $N sample CRCs as io = file"
  else
    echo "FAIL: $fmt epoch io = nvme vs file ($N lines)"; cat /tmp/$fmt-nvme.err /tmp/$fmt-file.err | head -5; grep io_path /tmp/$fmt-nvme.json
  fi
done
ubdirect doctor --path /mnt | grep -E "nvme |O_DIRECT|WARNING" | sed 's/^/DOCTOR /'
ubdirect-bench --quick --runs 1 --dir /tmp/bench nvme 2>&1 | grep -E "nvme:|O_DIRECT|passthrough|error" | sed 's/^/BENCH /'

# RDMA: Soft-RoCE on the virtio NIC.
for m in crc32_generic virtio_pci virtio_net rdma_rxe ib_uverbs rdma_ucm; do modprobe $m || echo "FAIL: modprobe $m"; done
ip link set lo up
ETH=$(ls /sys/class/net | grep -v '^lo$' | head -1)
ip link set $ETH up && ip addr add 192.0.2.1/24 dev $ETH
rdma-tool link add rxe0 type rxe netdev $ETH && echo "PASS: rxe0 on $ETH" || echo "FAIL: rdma link add rxe0"
for i in $(seq 50); do [ -e /dev/infiniband/uverbs0 ] && break; sleep 0.1; done
sleep 1
UBDIRECT_TEST_TRANSPORT=rdma RUST_TEST_THREADS=1 /bin/conformance > /tmp/conf.log 2>&1
R=$(grep "test result" /tmp/conf.log)
case "$R" in *" 0 failed"*) echo "PASS: conformance suite over RDMA (rxe0): $R";; *) echo "FAIL: conformance over RDMA"; tail -30 /tmp/conf.log;; esac
UBDIRECT_TEST_TRANSPORT=rdma RUST_TEST_THREADS=1 /bin/net_source_conformance --nocapture > /tmp/netsrc.log 2>&1
grep -a "^conformance \[ub://" /tmp/netsrc.log | sed 's/^/CONFORMANCE /'
R=$(grep "test result" /tmp/netsrc.log)
case "$R" in *" 0 failed"*) echo "PASS: source conformance, RemoteSource over RDMA (rxe0): $R";; *) echo "FAIL: source conformance over RDMA (RemoteSource)"; tail -30 /tmp/netsrc.log;; esac
UBDIRECT_TEST_TRANSPORT=rdma RUST_TEST_THREADS=1 /bin/smc_suite > /tmp/smc.log 2>&1
R=$(grep "test result" /tmp/smc.log)
case "$R" in *" 0 failed"*) echo "PASS: SMC suite over RDMA (rxe0; faults by RDMA READ, barriers by RDMA WRITE): $R";; *) echo "FAIL: SMC suite over RDMA"; grep -a -E "panicked|FAILED|failed" /tmp/smc.log | head -20; tail -30 /tmp/smc.log;; esac
ubdirect-bench --quick --runs 1 --dir /tmp/bench smc 2>&1 | grep -E "rdma|skip|error" | sed 's/^/BENCH /'
ubdirect serve --config /cfg/serve.toml > /tmp/serve.log 2>&1 &
SP=$!
sleep 1
for fmt in raw megatron; do
  ubdirect run --config /cfg/$fmt-rdma.toml --json --dump-samples /tmp/$fmt-rdma.jsonl > /tmp/$fmt-rdma.json 2>/tmp/$fmt-rdma.err
  N=$(wc -l < /tmp/$fmt-rdma.jsonl)
  # The same samples and CRCs in the same order; only the shard field differs (a ub:// URL).
  sed 's/,"shard":"[^"]*"//' /tmp/$fmt-file.jsonl > /tmp/$fmt-file.cmp; sed 's/,"shard":"[^"]*"//' /tmp/$fmt-rdma.jsonl > /tmp/$fmt-rdma.cmp
  if [ "$N" -gt 0 ] && cmp -s /tmp/$fmt-file.cmp /tmp/$fmt-rdma.cmp && grep -q "RDMA WRITE" /tmp/$fmt-rdma.json && ! grep -q rdma_unregistered /tmp/$fmt-rdma.json; then
    echo "PASS: $fmt epoch from ubdirect serve over RDMA delivers the same $N sample CRCs as the local read"
  else
    echo "FAIL: $fmt epoch over RDMA ($N lines)"; head -5 /tmp/$fmt-rdma.err; grep -E "io_path|fallback" /tmp/$fmt-rdma.json; tail -5 /tmp/serve.log
  fi
done
kill $SP
ubdirect-bench --quick --runs 1 --dir /tmp/bench remote 2>&1 | grep -E "remote:|TCP|RDMA|error" | sed 's/^/BENCH /'

poweroff -f
INIT
chmod +x "$ST/init"
(cd "$ST" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1) > "$W/initrd.gz"

timeout 600 qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 1G -nographic -no-reboot \
  -kernel "$K/vmlinux" -initrd "$W/initrd.gz" -append "console=ttyS0 quiet panic=-1" \
  -drive file="$W/disk.img",if=none,id=nvm,format=raw -device nvme,serial=deadbeef,drive=nvm \
  -drive file="$W/ext4.img",if=none,id=nvm2,format=raw -device nvme,serial=ub-ext4,drive=nvm2 \
  -netdev hubport,id=n0,hubid=0 -device virtio-net-pci,netdev=n0 \
  2>&1 | tr -d '\r' | tee "$W/guest.log" | grep -a -E '(PASS|FAIL|GUEST|DOCTOR|BENCH|CONFORMANCE)' || true
grep -q "GUEST RESULT: [0-9]* passed, 0 failed" "$W/guest.log"
! grep -a -q "^FAIL" "$W/guest.log"
[ "$(grep -a -c '^PASS: .* epoch with io = nvme' "$W/guest.log")" = 2 ]
grep -a -q "^PASS: conformance suite over RDMA" "$W/guest.log"
grep -a -q "^PASS: source conformance, NvmeSource" "$W/guest.log"
grep -a -q "^PASS: source conformance, RemoteSource over RDMA" "$W/guest.log"
grep -a -q "^PASS: SMC suite over RDMA" "$W/guest.log"
[ "$(grep -a -c '^PASS: .* epoch from ubdirect serve over RDMA' "$W/guest.log")" = 2 ]
