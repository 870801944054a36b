//! The run summary as text: the lines `ubdirect run` prints after its epochs (`--json` prints the
//! same [`RunReport`] as data).

use ubdirect_loader::RunReport;

/// Prints a summary for people.
pub fn print_summary(s: &RunReport) {
    println!("ubdirect run summary");
    if let Some(g) = &s.generated {
        println!("  GENERATED    {g}");
    }
    println!(
        "  dataset      {} — {} shard(s), {} samples; rank {}/{}",
        s.format, s.shards, s.dataset_samples, s.rank, s.world_size
    );
    println!("  device       {} — {}", s.device, s.device_reason);
    print_gpt(s);
    println!("  delivered to {}", s.delivered_to);
    println!("  io path      {} ({})", s.io_path, s.engine);
    println!(
        "  delivered    {} epoch(s), {} batches, {} samples, {} sample bytes in {:.2} s",
        s.epochs, s.batches, s.samples, s.sample_bytes, s.seconds
    );
    println!(
        "  throughput   {:.0} samples/s, {:.3} GB/s delivered, {:.3} GB/s read",
        s.samples_per_s, s.gb_per_s, s.read_gb_per_s
    );
    println!(
        "  end to end   first batch after {:.2} s; {:.3} GB/s wall (start-up included); last epoch {:.3} GB/s",
        s.time_to_first_batch_s, s.wall_gb_per_s, s.last_epoch_gb_per_s
    );
    println!(
        "  data stall   {:.3} s waiting for batches that were not ready ({:.1} % of the epochs' time; metric ubdirect_loader_data_wait_microseconds_total)",
        s.data_wait_s,
        100.0 * s.data_stall_fraction
    );
    println!(
        "  start-up     {}",
        s.startup_s
            .iter()
            .map(|(n, t)| format!("{n} {t:.3} s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for r in &s.resolved {
        println!("  resolved     {} = {} ({})", r.key, r.value, r.why);
    }
    println!("  shut down    {:.3} s after the last batch", s.teardown_s);
    println!("  cpu          {:.3} s per GB", s.cpu_s_per_gb);
    print_page_cache(s);
    print_reads(s);
    println!(
        "  registered   {} registration(s), all at pool creation: {}",
        s.registrations,
        s.registered_with.join(", ")
    );
    if s.padded_per_epoch + s.dropped_per_epoch > 0 {
        println!(
            "  remainder    {} padded, {} dropped per epoch (all ranks)",
            s.padded_per_epoch, s.dropped_per_epoch
        );
    }
    if s.crc_checked > 0 {
        println!(
            "  crc          {} samples checked against sidecars",
            s.crc_checked
        );
    }
    print_object_store_and_fallbacks(s);
}

/// The summary's GPT lines.
fn print_gpt(s: &RunReport) {
    if let Some(g) = &s.gpt {
        println!(
            "  gpt          samples of {} {} tokens, {} order, {} per epoch; index cache {}",
            g.tokens,
            g.dtype,
            g.order,
            g.samples,
            g.index_cache.join(", ")
        );
        if let Some(n) = &g.num_samples_note {
            println!("  num_samples  {n}");
        }
        for (i, b) in g.blend.iter().enumerate() {
            println!(
                "  blend        dataset {i} (weight {:.4}, {}): {} samples",
                b.weight,
                b.paths.join(", "),
                b.samples
            );
        }
    }
}

/// The summary's page-cache lines.
fn print_page_cache(s: &RunReport) {
    match &s.page_cache {
        Some(p) => {
            println!(
                "  page cache   {} shard(s) mapped, {} bytes PINNED of a {} byte budget ({}); {} registration(s) in {:.2} s ({} in the background; pool.page_cache_register = {}); unregistered warm reads copied by {} thread(s)",
                p.mapped_shards,
                p.pinned_bytes,
                p.budget_bytes,
                p.budget,
                p.registrations,
                p.register_s,
                p.background_registrations,
                p.policy,
                s.copy_threads
            );
            if p.object_chunks_mapped + p.object_chunks_unmapped + p.object_chunks_staged > 0 {
                println!(
                    "  object cache {} object(s) mapped from their chunk files (cache hits copied out of the mapping), {} unmapped again after a chunk was evicted, {} object-epoch(s) read by the copy threads out of the chunk files' mapping before it was registered ({} of them out of the epoch before's mapping, checked again)",
                    p.object_chunks_mapped,
                    p.object_chunks_unmapped,
                    p.object_chunks_staged,
                    p.object_chunks_staged_kept
                );
            }
        }
        None => println!(
            "  page cache   not mapped (pool.page_cache_budget = 0, host zero-copy batches, or engine.direct = \"on\")"
        ),
    }
    println!(
        "  placement    {}",
        s.numa_placement.as_deref().unwrap_or(
            "left to the kernel (one NUMA node, no GPU, or a platform that does not say where the GPU is; pool.numa_node binds by hand)"
        )
    );
    if s.cold_staging_epochs > 0 {
        println!(
            "  staging      {} of {} blocks cycled in {} epoch(s) read mostly cold with O_DIRECT (pool.cold_staging_blocks), all {} in the others",
            s.cold_staging_blocks, s.staging_blocks, s.cold_staging_epochs, s.staging_blocks
        );
    }
    if s.read_devices > 0 {
        println!(
            "  devices      reads balanced over {} local devices (engine.balance_devices): {} given a staging block ahead of an earlier read of the plan",
            s.read_devices, s.reads_ahead
        );
    }
    if let Some(p) = s
        .page_cache
        .as_ref()
        .filter(|p| p.cold_filled + p.cold_direct > 0)
    {
        println!(
            "  cold shards  {} read through the page cache to fill it (the run reads them again), {} read O_DIRECT and left out of it (a single pass); counted per epoch",
            p.cold_filled, p.cold_direct
        );
    }
}

/// The summary's read lines: counts, over-read, read ahead, sizes, paths.
fn print_reads(s: &RunReport) {
    let delivered_read = s.read_bytes.saturating_sub(s.prefetched_unused_bytes);
    println!(
        "  reads        {} (mean {} B), {} short, {} retried{}",
        s.reads,
        s.mean_read_bytes,
        s.short_reads,
        s.retries,
        match s.unregistered_reads {
            0 => String::new(),
            n => format!(", {n} into unregistered (pageable) pools by address"),
        }
    );
    println!(
        "  over-read    {} bytes ({:.1} % of the bytes read for delivered batches): gaps between samples bridged by one read (loader.max_gap), 4 KiB alignment, and short reads widened toward loader.min_read — fewer, larger reads at the cost of bytes nobody uses",
        s.wasted_bytes,
        if delivered_read > 0 {
            100.0 * s.wasted_bytes as f64 / delivered_read as f64
        } else {
            0.0
        },
    );
    if s.prefetched_unused_bytes > 0 {
        println!(
            "  read ahead   {} bytes read for batches never delivered (prefetch past the stop: --max-batches, or an iterator dropped early); not waste of the plan",
            s.prefetched_unused_bytes
        );
    }
    for h in &s.read_sizes {
        println!("    {:>18}  {}", h.range, h.reads);
    }
    let paths: Vec<String> = s
        .bytes_per_path
        .iter()
        .map(|p| format!("{} {}", p.path, p.bytes))
        .collect();
    println!("  bytes/path   {}", paths.join(", "));
    if s.epoch_bytes_per_path.len() > 1 {
        // Each epoch's shares: where the first pass and the ramp went.
        let epochs: Vec<String> = s
            .epoch_bytes_per_path
            .iter()
            .enumerate()
            .map(|(e, rows)| {
                let total = rows.iter().map(|r| r.bytes).sum::<u64>().max(1);
                let parts: Vec<String> = rows
                    .iter()
                    .map(|r| format!("{} {:.0}%", r.path, 100.0 * r.bytes as f64 / total as f64))
                    .collect();
                format!("{}: {}", e + 1, parts.join(" "))
            })
            .collect();
        println!("  per epoch    {}", epochs.join(" | "));
    }
}

/// Bytes from the store ÷ bytes delivered, and the cache hint.
fn store_ratio_line(s: &RunReport, o: &ubdirect_loader::objstore::StatsSnapshot) -> Option<String> {
    let ratio = s.store_per_delivered?;
    let hint = s
        .store_hint
        .as_ref()
        .map(|h| format!("; {h}"))
        .unwrap_or_default();
    Some(format!(
        "{ratio:.2}× ({} bytes from the store for {} delivered){hint}",
        o.bytes_from_store, s.sample_bytes
    ))
}

/// The object store's cost, predicted before each epoch beside the realised: requests and bytes
/// (and the difference), the model's time, and the price.
fn store_cost_line(c: &ubdirect_loader::objstore::CostReport) -> String {
    let diff = |real: u64, pred: u64| {
        if pred == 0 {
            String::new()
        } else {
            format!(" ({:+.1} %)", (real as f64 / pred as f64 - 1.0) * 100.0)
        }
    };
    let p = &c.predicted;
    let pending = match c.pending {
        0 => String::new(),
        n => format!(" ({n} epoch(s) not yet replayed)"),
    };
    format!(
        "predicted {} requests, {} bytes for {} delivered over {} epoch(s){pending}: {:.1} s at {} ms a request × {} in flight and {} GB/s, ${:.4}; realised {} requests{}, {} bytes{}, ${:.4}",
        p.requests,
        p.bytes,
        p.delivered,
        c.epochs,
        c.predicted_s,
        c.request_ms,
        c.in_flight,
        c.gbps,
        c.predicted_usd,
        c.realised_requests,
        diff(c.realised_requests, p.requests),
        c.realised_bytes,
        diff(c.realised_bytes, p.bytes),
        c.realised_usd
    )
}

/// The summary's object-store line and its fallbacks.
fn print_object_store_and_fallbacks(s: &RunReport) {
    if let Some(o) = &s.object_store {
        println!(
            "  object store {} requests, {} bytes from the store, {} from the cache; {} retries, {} throttled; chunks: {} fetched, {} evicted, {} bypassed; prefetch: {} chunks ({} bytes), {} hits, {} failed",
            o.requests,
            o.bytes_from_store,
            o.bytes_from_cache,
            o.retries,
            o.throttled,
            o.chunks_fetched,
            o.chunks_evicted,
            o.cache_bypassed,
            o.chunks_prefetched,
            o.bytes_prefetched,
            o.prefetch_hits,
            o.prefetch_failed
        );
        if let Some(line) = store_ratio_line(s, o) {
            println!("  store/deliv  {line}");
        }
    }
    if let Some(c) = &s.store_cost {
        println!("  store cost   {}", store_cost_line(c));
    }
    if s.fallbacks.is_empty() {
        println!("  fallbacks    none");
    } else {
        for f in &s.fallbacks {
            // Each reason is said once: the device line above already gives the no-GPU one.
            if f.detail == s.device_reason {
                println!(
                    "  fallback     {} ×{} (the device line's reason)",
                    f.kind, f.count
                );
            } else {
                println!("  fallback     {} ×{}: {}", f.kind, f.count, f.detail);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use ubdirect_loader::objstore::{CostReport, Estimate};

    #[test]
    fn the_store_cost_line_puts_the_prediction_beside_the_realised() {
        let c = CostReport {
            predicted: Estimate {
                requests: 60,
                bytes: 1_000_000,
                delivered: 400_000,
                reads: 1000,
                replayed: 1000,
            },
            epochs: 2,
            pending: 1,
            realised_requests: 66,
            realised_bytes: 950_000,
            request_ms: 20.0,
            gbps: 1.0,
            in_flight: 16,
            predicted_s: 0.075,
            predicted_usd: 0.000024,
            realised_usd: 0.0000264,
        };
        let l = super::store_cost_line(&c);
        for want in [
            "predicted 60 requests, 1000000 bytes for 400000 delivered over 2 epoch(s) (1 epoch(s) not yet replayed)",
            "0.1 s at 20 ms a request × 16 in flight and 1 GB/s",
            "realised 66 requests (+10.0 %), 950000 bytes (-5.0 %)",
        ] {
            assert!(l.contains(want), "{l}\nlacks: {want}");
        }
    }
}
