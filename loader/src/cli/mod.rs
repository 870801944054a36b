//! `ubdirect`: the loader's command line (`run gen index doctor serve`), kept out of the library.

mod doctor;
mod dump;
mod replay;
mod run;
mod serve;
mod summary;
mod sys;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use run::RunOptions;
use summary::print_summary;
use ubdirect_loader::RunConfig;

#[derive(Parser, Debug)]
#[command(
    name = "ubdirect",
    version,
    about = "Training data from storage into GPU memory, the short way"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Runs the loader from a TOML config (the embedded configs/default.toml when none is given).
    Run {
        /// Config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// A config key for this run, `KEY=VALUE` (`--set pool.staging_blocks=32`); repeatable.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Epochs (overrides loader.epochs).
        #[arg(long)]
        epochs: Option<u64>,
        /// Stop each epoch after this many batches.
        #[arg(long)]
        max_batches: Option<u64>,
        /// Print the summary as JSON on stdout.
        #[arg(long)]
        json: bool,
        /// Write one JSON line per delivered sample (epoch, rank, position, sample, shard, len, crc32).
        #[arg(long)]
        dump_samples: Option<PathBuf>,
        /// Record every step's samples (provenance) as Arrow IPC, one record batch per step;
        /// `FILE.rank{R}` per rank when WORLD_SIZE > 1. Read back by `ubdirect replay`.
        #[arg(long)]
        record: Option<PathBuf>,
    },
    /// Delivers one recorded step's samples again (at this run's world size: RANK/WORLD_SIZE),
    /// from a `ubdirect run --record` file.
    Replay {
        /// The run's config (the same dataset and GPT settings).
        #[arg(long)]
        config: Option<PathBuf>,
        /// A config key for this run, `KEY=VALUE` (`--set pool.staging_blocks=32`); repeatable.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// The record (`FILE`, or the `FILE.rank{R}` files beside it).
        #[arg(long)]
        record: PathBuf,
        /// The step (global batch index).
        #[arg(long)]
        step: u64,
        /// The epoch (needed only when the record holds the step in several epochs).
        #[arg(long)]
        epoch: Option<u64>,
        /// Write one JSON line per delivered sample (as `run --dump-samples`).
        #[arg(long)]
        dump_samples: Option<PathBuf>,
    },
    /// Writes a synthetic dataset.
    Gen {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// raw, megatron, npy, arrow, webdataset, or all (one subdirectory each).
        #[arg(long, default_value = "all")]
        format: String,
        /// Samples.
        #[arg(long, default_value_t = 4096)]
        samples: u64,
        /// Shards.
        #[arg(long, default_value_t = 4)]
        shards: u32,
    },
    /// Writes per-sample CRC-32 sidecars (`<shard>.crc32`) for the config's dataset.
    Index {
        /// Config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// A config key for this run, `KEY=VALUE` (`--set pool.staging_blocks=32`); repeatable.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// What this machine offers the loader (NVMe, GPUs, RDMA, io_uring, memlock, O_DIRECT and cuFile
    /// on a path) and the path the loader would take there, with warnings.
    Doctor {
        /// Where the dataset lives.
        #[arg(long, default_value = ".")]
        path: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Serves root directories read-only to `ub://` clients (one server per storage node).
    Serve {
        /// Serve config (configs/serve.toml).
        #[arg(long)]
        config: PathBuf,
    },
    /// Prints the embedded default config.
    DefaultConfig,
}

fn report(e: &dyn std::error::Error) -> ExitCode {
    report_at("", e)
}

/// [`report`] with what the error is about first (`serve.listen 127.0.0.1:7447: `).
fn report_at(context: &str, e: &dyn std::error::Error) -> ExitCode {
    let mut msg = format!("error: {context}{e}");
    let mut src = e.source();
    while let Some(s) = src {
        // A cause whose words the lines above already say (an error that prints its source) is
        // said once.
        let line = s.to_string();
        if !msg.contains(&line) {
            msg.push_str(&format!("\n  caused by: {line}"));
        }
        src = s.source();
    }
    eprintln!("{msg}");
    ExitCode::FAILURE
}

/// The command line's entry point.
pub fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("UBDIRECT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: piped or redirected stderr stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Doctor { path, json } => doctor_cmd(&path, json),
        Cmd::Serve { config } => {
            let cfg = match serve::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return report(&e),
            };
            let mut roots: Vec<String> = cfg
                .roots
                .iter()
                .map(|(k, v)| format!("{k}={}", v.display()))
                .collect();
            roots.extend(cfg.regions.iter().map(|r| {
                format!(
                    "smc region {} {} MiB {}",
                    r.name,
                    r.size >> 20,
                    if r.writable { "rw" } else { "ro" }
                )
            }));
            if let Some(d) = &cfg.rdma_device {
                roots.push(format!(
                    "rdma on {}",
                    if d.is_empty() { "first device" } else { d }
                ));
            }
            let listen = cfg.listen;
            match rt.block_on(ubdirect_net::Server::start(cfg)) {
                Ok(s) => {
                    eprintln!(
                        "ubdirect serve: listening on {} ({})",
                        s.local_addr(),
                        roots.join(", ")
                    );
                    rt.block_on(async {
                        let _ = tokio::signal::ctrl_c().await;
                    });
                    ExitCode::SUCCESS
                }
                // "Address already in use" and its kin name the address and the key that set it.
                Err(e) => report_at(&format!("serve.listen {listen}: "), &e),
            }
        }
        Cmd::DefaultConfig => {
            print!("{}", ubdirect_loader::config::DEFAULT_CONFIG);
            ExitCode::SUCCESS
        }
        cmd => loader_cmd(cmd),
    }
}

/// The commands that read a dataset: `gen`, `index`, `run`, `replay`.
fn loader_cmd(cmd: Cmd) -> ExitCode {
    match cmd {
        Cmd::Gen {
            out,
            format,
            samples,
            shards,
        } => gen_cmd(&out, &format, samples, shards),
        Cmd::Index { config, set } => index_cmd(config.as_deref(), &set),
        Cmd::Run {
            config,
            set,
            epochs,
            max_batches,
            json,
            dump_samples,
            record,
        } => run_cmd(
            config.as_deref(),
            &set,
            RunOptions {
                epochs,
                max_batches,
                dump_samples,
                record,
                progress: !json,
            },
            json,
        ),
        Cmd::Replay {
            config,
            set,
            record,
            step,
            epoch,
            dump_samples,
        } => replay_cmd(config.as_deref(), &set, &record, epoch, step, dump_samples),
        Cmd::Doctor { .. } | Cmd::Serve { .. } | Cmd::DefaultConfig => ExitCode::from(2),
    }
}

/// The config at `path` (the embedded default when none), or the error printed, with the command
/// that makes one when the file is missing.
fn load_config(path: Option<&std::path::Path>, sets: &[String]) -> Result<RunConfig, ExitCode> {
    RunConfig::load_with(path, sets).map_err(|e| {
        eprintln!("error: {e}");
        if let Some(p) = path.filter(|p| !p.exists()) {
            eprintln!(
                "hint: `ubdirect default-config > {}` writes the default config there to edit",
                p.display()
            );
        }
        ExitCode::from(2)
    })
}

/// `ubdirect replay`
fn replay_cmd(
    config: Option<&std::path::Path>,
    sets: &[String],
    record: &std::path::Path,
    epoch: Option<u64>,
    step: u64,
    dump_samples: Option<PathBuf>,
) -> ExitCode {
    let cfg = match load_config(config, sets) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match replay::replay(&cfg, record, epoch, step, dump_samples.as_deref()) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => report(&e),
    }
}

/// `ubdirect doctor`
fn doctor_cmd(path: &std::path::Path, json: bool) -> ExitCode {
    let r = doctor::run(path);
    if json {
        match serde_json::to_string_pretty(&r) {
            Ok(j) => println!("{j}"),
            Err(e) => return report(&e),
        }
    } else {
        doctor::print(&r);
    }
    ExitCode::SUCCESS
}

/// `ubdirect gen`
fn gen_cmd(out: &std::path::Path, format: &str, samples: u64, shards: u32) -> ExitCode {
    use ubdirect_loader::formats::Format;
    let formats: Vec<Format> = if format == "all" {
        Format::ALL.to_vec()
    } else {
        match serde::Deserialize::deserialize(serde::de::value::StrDeserializer::<
            serde::de::value::Error,
        >::new(format))
        {
            Ok(f) => vec![f],
            Err(e) => {
                eprintln!("error: --format {format:?}: {e}");
                return ExitCode::from(2);
            }
        }
    };
    for f in formats {
        let dir = if format == "all" {
            out.join(f.name())
        } else {
            out.to_path_buf()
        };
        let cfg = ubdirect_loader::config::DatasetSection::default();
        match ubdirect_loader::dataset::generate(&dir, f, samples, shards.max(1), &cfg) {
            Ok(files) => println!("{f}: {} shard(s) in {}", files.len(), dir.display()),
            Err(e) => return report(&e),
        }
    }
    ExitCode::SUCCESS
}

/// `ubdirect index`
fn index_cmd(config: Option<&std::path::Path>, sets: &[String]) -> ExitCode {
    let cfg = match load_config(config, sets) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match ubdirect_loader::dataset::open(&cfg.dataset)
        .and_then(|idx| ubdirect_loader::formats::crc::write_sidecars(&idx))
    {
        Ok(n) => {
            println!("wrote CRC-32 sidecars for {n} samples");
            println!(
                "next: set dataset.verify_crc = true to check every sample against them as it is delivered"
            );
            ExitCode::SUCCESS
        }
        Err(e) => report(&e),
    }
}

/// `ubdirect run`
fn run_cmd(
    config: Option<&std::path::Path>,
    sets: &[String],
    opts: RunOptions,
    json: bool,
) -> ExitCode {
    let cfg = match load_config(config, sets) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let record = opts.record.clone();
    match run::run(&cfg, &opts) {
        Ok(s) => {
            if json {
                match serde_json::to_string_pretty(&s) {
                    Ok(j) => println!("{j}"),
                    Err(e) => return report(&e),
                }
            } else {
                print_summary(&s);
            }
            if let Some(r) = record {
                let (rank, world) = (s.rank, s.world_size);
                eprintln!(
                    "recorded every step's samples in {} (read back: ubdirect replay --record {} --step N)",
                    ubdirect_loader::record::rank_path(&r, rank, world).display(),
                    r.display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => report(&e),
    }
}
