set -u
D=/tmp/ubdirect-bench/epoch-4096
mkdir -p $D
for i in 0 1 2 3 4 5 6 7; do f=$D/shard-0000$i.bin; [ -s $f ] || dd if=/dev/zero of=$f bs=16M count=32 status=none; done
for f in $D/*.bin; do cat $f > /dev/null; done
run() { # name rings qd prefetch threads max_read [async_buffered]
cat > /tmp/v.toml <<EOT
[dataset]
format = "raw"
dir = "$D"
generate = false
dtype = "u8"
record_len = 262144
[loader]
batch_size = 32
min_read = "4MiB"
max_read = "$6"
prefetch = $4
threads = $5
[device]
select = "cuda"
[engine]
rings = $2
queue_depth = $3
direct = "off"
async_buffered = ${7:-false}
[pool]
staging_block_size = "$(( $(echo $6 | sed 's/MiB//') * 1048576 + 65536 ))"
staging_blocks = 128
batch_block_size = "32MiB"
EOT
r=""; for k in 1 2 3; do r="$r $(.dev/gpu/ubdirect run --config /tmp/v.toml --json | python3 -c 'import sys,json; print(round(json.load(sys.stdin)["gb_per_s"],2))')"; done
echo "$1 rings=$2 qd=$3 prefetch=$4 threads=$5 max_read=$6 async=${7:-false}: $r"
}
run r16p32m4 16 8 32 8 4MiB
run async-r1 1 32 32 8 4MiB true
run async-r2 2 32 32 8 4MiB true
run async-r4 4 16 32 8 4MiB true
run async-r8 8 16 64 8 4MiB true
run async-r16 16 8 32 8 4MiB true
