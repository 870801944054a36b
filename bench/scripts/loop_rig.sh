#!/usr/bin/env bash
# A "disk" faster than the VMs' virtio one, for cold-read benchmarks: ext4 on loop devices whose
# backing files live in tmpfs (/dev/shm). `drop_caches` empties ext4's page cache while the backing
# files stay in RAM, so a cold read goes through the block layer, the loop driver and ext4 at
# memory speed. The loop workers copy with the CPU where real NVMe would DMA: cold figures here spend
# CPU that a real array would not (docs/benchmarks.md says how that shifts them).
#
#   bench/scripts/loop_rig.sh up DEVICES GIB_PER_DEVICE   # prints one mount point per line
#   bench/scripts/loop_rig.sh down                         # unmounts, detaches, deletes
#   READ_AHEAD_KB=4096 bench/scripts/loop_rig.sh up …       # with the devices' read-ahead set
#
# Root only. Everything lives under $RIG (default /dev/shm/ubdirect-rig) and /mnt/ubdirect-rig-N;
# `down` removes exactly what `up` made (it reads the list `up` wrote), also after a failed `up`.
set -euo pipefail
RIG=${RIG:-/dev/shm/ubdirect-rig}
STATE=$RIG/state

die() { echo "loop_rig: $*" >&2; exit 2; }

down() {
    [ -f "$STATE" ] || return 0
    while read -r kind what; do
        case $kind in
            mount) umount "$what" 2>/dev/null || umount -l "$what" 2>/dev/null || true; rmdir "$what" 2>/dev/null || true ;;
            loop) losetup -d "$what" 2>/dev/null || true ;;
        esac
    done < <(tac "$STATE")
    rm -rf "$RIG"
}

up() {
    local n=$1 gib=$2
    [ "$(id -u)" = 0 ] || die "needs root (losetup, mkfs.ext4, mount)"
    command -v losetup >/dev/null && command -v mkfs.ext4 >/dev/null || die "needs losetup and mkfs.ext4 (util-linux, e2fsprogs)"
    [ -e "$STATE" ] && die "a rig is up already ($STATE): run '$0 down' first"
    local free_kib
    free_kib=$(df -k --output=avail /dev/shm | tail -1)
    [ $(( n * gib * 1024 * 1024 )) -lt $(( free_kib * 9 / 10 )) ] || die "/dev/shm has $((free_kib / 1024 / 1024)) GiB free, the rig needs $((n * gib)) GiB"
    mkdir -p "$RIG"
    : > "$STATE"
    trap 'echo "loop_rig: up failed, cleaning up" >&2; down' ERR
    for i in $(seq 0 $((n - 1))); do
        local img=$RIG/d$i.img mnt=/mnt/ubdirect-rig-$i dev
        truncate -s "${gib}G" "$img"
        dev=$(losetup -f --show --direct-io=off "$img")
        echo "loop $dev" >> "$STATE"
        mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
        mkdir -p "$mnt"
        mount -o noatime "$dev" "$mnt"
        echo "mount $mnt" >> "$STATE"
        # The device's read-ahead (a real array's is often raised): READ_AHEAD_KB, else the kernel's.
        if [ -n "${READ_AHEAD_KB:-}" ]; then
            echo "$READ_AHEAD_KB" > "/sys/block/$(basename "$dev")/queue/read_ahead_kb"
        fi
        echo "$mnt"
    done
    trap - ERR
}

case "${1:-}" in
    up) [ $# -eq 3 ] || die "usage: $0 up DEVICES GIB_PER_DEVICE"; up "$2" "$3" ;;
    down) down ;;
    *) die "usage: $0 up DEVICES GIB_PER_DEVICE | down" ;;
esac
