//! `ubdirect`: the loader's command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ubdirect_loader::{RunConfig, RunSummary};

#[derive(Parser, Debug)]
#[command(
    name = "ubdirect",
    version,
    about = "Storage → register-once pinned buffers → GPU, the short way"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Runs a pipeline from a TOML config (the embedded configs/default.toml when none is given).
    Run {
        /// Config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override source.passes.
        #[arg(long)]
        passes: Option<u32>,
        /// Print the summary as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Prints the embedded default config.
    DefaultConfig,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("UBDIRECT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::DefaultConfig => {
            print!("{}", ubdirect_loader::config::DEFAULT_CONFIG);
            ExitCode::SUCCESS
        }
        Cmd::Run {
            config,
            passes,
            json,
        } => {
            let mut cfg = match RunConfig::load(config.as_deref()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            if let Some(p) = passes {
                cfg.source.passes = p.max(1);
            }
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(ubdirect_loader::run(&cfg, !json)) {
                Ok(s) => {
                    if json {
                        match serde_json::to_string_pretty(&s) {
                            Ok(j) => println!("{j}"),
                            Err(e) => eprintln!("error: {e}"),
                        }
                    } else {
                        print_summary(&s);
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    let mut msg = format!("error: {e}");
                    let mut src = std::error::Error::source(&e);
                    while let Some(s) = src {
                        msg.push_str(&format!("\n  caused by: {s}"));
                        src = s.source();
                    }
                    eprintln!("{msg}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn print_summary(s: &RunSummary) {
    println!("ubdirect run summary");
    println!(
        "  file         {} ({} bytes, {} B per read, {} passes)",
        s.path.display(),
        s.file_bytes,
        s.read_size,
        s.passes
    );
    println!("  device       {} — {}", s.device, s.device_reason);
    println!("  delivered to {}", s.delivered_to);
    println!(
        "  io path      {} ({} ring(s), queue depth {}, sqpoll {})",
        s.io_path,
        s.rings,
        s.queue_depth,
        if s.sqpoll { "on" } else { "off" }
    );
    let passes: Vec<String> = s.pass_gb_per_s.iter().map(|r| format!("{r:.2}")).collect();
    println!(
        "  throughput   {:.2} GB/s over {:.2} s (per pass: {} GB/s)",
        s.gb_per_s,
        s.seconds,
        passes.join(", ")
    );
    println!("  cpu          {:.3} s per GB", s.cpu_s_per_gb);
    println!(
        "  reads        {} ({} short, {} retried)",
        s.reads, s.short_reads, s.retries
    );
    println!(
        "  registered   {} registration(s), all at pool creation: {}",
        s.staging_registrations,
        s.registered_with.join(", ")
    );
    println!("  acquire wait max {:.2} ms", s.max_acquire_wait_ms);
    println!(
        "  verified     {}",
        if s.verified {
            "every block's CRC-32 equals the file's"
        } else {
            "no (source.verify = false)"
        }
    );
    if s.fallbacks.is_empty() {
        println!("  fallbacks    none");
    } else {
        for f in &s.fallbacks {
            println!("  fallback     {} ×{}: {}", f.kind, f.count, f.detail);
        }
    }
}
