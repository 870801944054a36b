//! `ubdirect doctor`: what this machine offers the loader — NVMe controllers, GPUs, RDMA devices,
//! io_uring, memlock, O_DIRECT and cuFile on a path — and the path the loader would take, with
//! warnings. Reads sysfs; never panics; says what is absent.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// One NVMe controller.
#[derive(Debug, Clone, Serialize)]
pub struct NvmeCtrl {
    pub name: String,
    pub model: String,
    pub serial: String,
    pub firmware: String,
    pub pci: Option<String>,
    pub numa_node: Option<i32>,
    pub link: Option<String>,
    pub link_max: Option<String>,
    pub namespaces: Vec<String>,
}

/// One GPU.
#[derive(Debug, Clone, Serialize)]
pub struct Gpu {
    pub name: String,
    pub pci: Option<String>,
    pub numa_node: Option<i32>,
    pub via: String,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub nvme: Vec<NvmeCtrl>,
    pub gpus: Vec<Gpu>,
    pub rdma: Vec<String>,
    pub io_uring: Vec<(String, bool, String)>,
    pub memlock_bytes: Option<u64>,
    pub cap_ipc_lock: bool,
    pub path: String,
    pub path_direct_io: String,
    pub path_io: String,
    pub cufile: String,
    pub device_path: String,
    /// NUMA nodes, GPUs, drives and RDMA NICs with their NUMA nodes, CPUs and PCIe switches.
    pub topology: ubdirect_ub::topology::Topology,
    /// The layout for people: one line per node and per GPU (what shares its switch and node).
    pub layout: Vec<String>,
    /// This rank's placement (`LOCAL_RANK`, default 0): its GPU, node and CPUs.
    pub placement: String,
    pub warnings: Vec<String>,
}

fn read(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn numa(dev: &Path) -> Option<i32> {
    read(dev.join("numa_node"))
        .and_then(|s| s.parse().ok())
        .filter(|n: &i32| *n >= 0)
}

fn pci_of(dev: &Path) -> Option<(String, PathBuf)> {
    let real = std::fs::canonicalize(dev).ok()?;
    let name = real.file_name()?.to_string_lossy().to_string();
    name.contains(':').then_some((name, real))
}

fn nvme_ctrls() -> Vec<NvmeCtrl> {
    let mut v = Vec::new();
    let Ok(rd) = std::fs::read_dir("/sys/class/nvme") else {
        return v;
    };
    let mut names: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    names.sort();
    for c in names {
        let dev = c.join("device");
        let pci = pci_of(&dev);
        let pdev = pci.as_ref().map(|p| p.1.clone()).unwrap_or(dev.clone());
        let link = match (
            read(pdev.join("current_link_speed")),
            read(pdev.join("current_link_width")),
        ) {
            (Some(s), Some(w)) => Some(format!("{s} x{w}")),
            _ => None,
        };
        let link_max = match (
            read(pdev.join("max_link_speed")),
            read(pdev.join("max_link_width")),
        ) {
            (Some(s), Some(w)) => Some(format!("{s} x{w}")),
            _ => None,
        };
        let mut namespaces: Vec<String> = std::fs::read_dir(&c)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .filter(|n| {
                        n.contains('n') && n.starts_with("nvme") && n.matches('n').count() >= 2
                    })
                    .collect()
            })
            .unwrap_or_default();
        namespaces.sort();
        v.push(NvmeCtrl {
            name: c
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default(),
            model: read(c.join("model")).unwrap_or_default(),
            serial: read(c.join("serial")).unwrap_or_default(),
            firmware: read(c.join("firmware_rev")).unwrap_or_default(),
            pci: pci.map(|p| p.0),
            numa_node: numa(&pdev),
            link,
            link_max,
            namespaces,
        });
    }
    v
}

fn gpus() -> Vec<Gpu> {
    let mut v = Vec::new();
    if ubdirect_ub::cuda_driver_present()
        && let Ok(d) = ubdirect_ub::CudaDevice::new(0)
    {
        use ubdirect_ub::Device;
        let i = d.info();
        v.push(Gpu {
            name: i.name.clone(),
            pci: i.pci_bus_id.clone(),
            numa_node: i.numa_node,
            via: "CUDA driver".into(),
        });
        return v;
    }
    let Ok(rd) = std::fs::read_dir("/sys/bus/pci/devices") else {
        return v;
    };
    for e in rd.filter_map(|e| e.ok()) {
        let p = e.path();
        let class = read(p.join("class")).unwrap_or_default();
        let vendor = read(p.join("vendor")).unwrap_or_default();
        if vendor == "0x10de" && (class.starts_with("0x0302") || class.starts_with("0x0300")) {
            v.push(Gpu {
                name: "NVIDIA GPU (driver not usable)".into(),
                pci: Some(e.file_name().to_string_lossy().to_string()),
                numa_node: numa(&p),
                via: "sysfs".into(),
            });
        }
    }
    v
}

fn rdma() -> Vec<String> {
    let Ok(rd) = std::fs::read_dir("/sys/class/infiniband") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .map(|e| {
            let p = e.path();
            let state = read(p.join("ports/1/state")).unwrap_or_else(|| "?".into());
            format!(
                "{} ({}, port 1 {})",
                e.file_name().to_string_lossy(),
                read(p.join("node_type")).unwrap_or_default(),
                state
            )
        })
        .collect()
}

/// Builds the report for `path` (where the dataset lives).
pub fn run(path: &Path) -> Report {
    let mut warnings = Vec::new();
    let nvme = nvme_ctrls();
    let gpus = gpus();
    let rdma = rdma();
    let io_uring = match ubdirect_nvme::probe::io_uring_support() {
        Ok(v) => v
            .into_iter()
            .map(|c| (c.name.to_string(), c.ok, c.detail))
            .collect(),
        Err(e) => {
            warnings.push(format!("io_uring unavailable: {e} — the loader cannot run"));
            Vec::new()
        }
    };
    for (n, ok, d) in &io_uring {
        if !ok && (n == "op READ_FIXED" || n == "register sparse buffers") {
            warnings.push(format!(
                "io_uring lacks {n} ({d}): kernel too old (need ≥ 5.13)"
            ));
        }
    }
    let memlock = super::sys::memlock_limit();
    let root = super::sys::is_root();
    if !root && memlock.is_some_and(|m| m < 1 << 30) {
        warnings.push(format!("RLIMIT_MEMLOCK is {} bytes and this is not root: pools larger than that fail; raise it (ulimit -l unlimited, LimitMEMLOCK=infinity)", memlock.unwrap_or(0)));
    }
    // O_DIRECT and the I/O path on `path`.
    let (path_direct_io, path_io) = probe_path(path, &mut warnings);
    let cufile = match ubdirect_ub::cufile_probe(path) {
        Ok(d) => format!("usable: {d}"),
        Err(e) => {
            if !gpus.is_empty() {
                warnings.push(format!("cuFile unusable on {}: {e}", path.display()));
            }
            format!("unusable: {e}")
        }
    };
    let device_path = match ubdirect_ub::select_device(ubdirect_ub::DeviceSelection::Auto, 0) {
        Ok(s) => {
            if s.device.info().kind == ubdirect_ub::DeviceKind::Cuda {
                format!(
                    "{} → pinned staging (cuMemHostRegister) → cuMemcpyHtoDAsync → {}",
                    path_io,
                    s.device.info().name
                )
            } else {
                format!("{} → host memory (no GPU: {})", path_io, s.reason)
            }
        }
        Err(e) => format!("no device: {e}"),
    };
    topology_warnings(&nvme, &gpus, &mut warnings);
    if nvme.is_empty() {
        warnings.push(
            "no NVMe controllers: the NVMe passthrough path (io = \"nvme\") is unavailable here"
                .into(),
        );
    }
    let topology = ubdirect_ub::topology::Topology::probe();
    let layout = layout_lines(&topology);
    let placement = rank_placement(&topology, &gpus);
    Report {
        topology,
        layout,
        placement,
        nvme,
        gpus,
        rdma,
        io_uring,
        memlock_bytes: memlock,
        cap_ipc_lock: root,
        path: path.display().to_string(),
        path_direct_io,
        path_io,
        cufile,
        device_path,
        warnings,
    }
}

/// O_DIRECT and the I/O path on `path`: (what direct I/O does there, the path reads take).
fn probe_path(path: &Path, warnings: &mut Vec<String>) -> (String, String) {
    // Never written through a planted name (a symlink at a fixed name in a shared directory
    // would have a root `doctor` overwrite its target): an unnamed O_TMPFILE, or a new name
    // created with O_EXCL | O_NOFOLLOW, removed when dropped.
    let probe_file = ubdirect_ub::ProbeFile::create(path, ".ubdirect-doctor-probe", 8192).ok();
    let written = probe_file.is_some();
    let probe = probe_file
        .as_ref()
        .map_or_else(PathBuf::new, |p| p.path().to_path_buf());
    // A read-only path: probe with a file that is already there.
    let existing = (!written)
        .then(|| {
            std::fs::read_dir(path)
                .ok()?
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .find(|p| {
                    p.is_file()
                        || p.is_dir()
                            && std::fs::read_dir(p)
                                .ok()
                                .and_then(|mut r| r.next())
                                .is_some()
                })
        })
        .flatten()
        .and_then(|p| {
            if p.is_dir() {
                std::fs::read_dir(&p)
                    .ok()?
                    .filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .find(|q| q.is_file())
            } else {
                Some(p)
            }
        });
    let target = if written {
        Some(probe.clone())
    } else {
        existing
    };
    match target {
        None => (
            "cannot write a probe file and found no file to probe (read-only, empty?)".into(),
            "unknown".into(),
        ),
        Some(probe_file) => {
            let probe = probe_file;
            let r = match ubdirect_nvme::Engine::new(ubdirect_nvme::EngineConfig::default())
                .and_then(|e| {
                    e.open(&probe)
                        .map(|f| (f.is_direct(), f.io_path().to_string(), f.offset_align()))
                }) {
                Ok((true, p, a)) => (format!("supported (alignment {a} B)"), p),
                Ok((false, p, _)) => {
                    warnings.push(format!(
                        "{} has no direct I/O: reads go through the page cache (fallback)",
                        path.display()
                    ));
                    ("not supported (fallback to buffered reads)".into(), p)
                }
                Err(e) => (format!("probe failed: {e}"), "unknown".into()),
            };
            drop(probe);
            r
        }
    }
}

/// Topology: GPU and drives on the same NUMA node; links at their maximum.
fn topology_warnings(nvme: &[NvmeCtrl], gpus: &[Gpu], warnings: &mut Vec<String>) {
    // Topology: GPU and drives on the same NUMA node; links at their maximum.
    for c in nvme {
        if let (Some(l), Some(m)) = (&c.link, &c.link_max)
            && l != m
        {
            warnings.push(format!(
                "{} runs its PCIe link at {l}, below its maximum {m}",
                c.name
            ));
        }
        for g in gpus {
            if let (Some(a), Some(b)) = (c.numa_node, g.numa_node)
                && a != b
            {
                warnings.push(format!("{} (NUMA {a}) and GPU {} (NUMA {b}) are on different NUMA nodes: staging memory should sit on one; expect cross-socket traffic", c.name, g.pci.clone().unwrap_or_default()));
            }
        }
    }
}

/// The host's layout, one line per NUMA node and per GPU.
fn layout_lines(t: &ubdirect_ub::topology::Topology) -> Vec<String> {
    use ubdirect_ub::topology::{PciKind, format_cpulist};
    let mut out: Vec<String> = t
        .nodes
        .iter()
        .map(|n| format!("NUMA node {}: CPUs {}", n.id, format_cpulist(&n.cpus)))
        .collect();
    let names = |v: Vec<&ubdirect_ub::topology::PciDevice>| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.iter()
                .map(|d| d.address.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        }
    };
    for (i, g) in t.gpus().enumerate() {
        out.push(format!(
            "GPU {i} {}: NUMA {} CPUs {}; switch {} with GPUs [{}] NVMe [{}] NICs [{}]; on its node NVMe [{}] NICs [{}]",
            g.address,
            g.numa_node.map_or("?".into(), |n| n.to_string()),
            if g.local_cpus.is_empty() {
                "?".into()
            } else {
                format_cpulist(&g.local_cpus)
            },
            g.switch().unwrap_or("none (on a root port)"),
            names(t.same_switch(g, PciKind::Gpu).collect()),
            names(t.same_switch(g, PciKind::Nvme).collect()),
            names(t.same_switch(g, PciKind::Rdma).collect()),
            names(t.same_node(g, PciKind::Nvme).collect()),
            names(t.same_node(g, PciKind::Rdma).collect()),
        ));
    }
    out
}

/// Where this rank (`LOCAL_RANK`, 0 when unset) goes: the GPU of that CUDA ordinal (PCI order
/// without the driver), its NUMA node and CPUs, and what the loader does with them.
fn rank_placement(t: &ubdirect_ub::topology::Topology, gpus: &[Gpu]) -> String {
    let local: usize = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    // The CUDA driver names device 0 only here; other ordinals follow PCI order.
    let cuda = (local == 0)
        .then(|| gpus.iter().find(|g| g.via == "CUDA driver"))
        .flatten()
        .and_then(|g| g.pci.as_deref())
        .and_then(|a| t.device(a));
    let Some(gpu) = cuda.or_else(|| t.gpus().nth(local)) else {
        return format!("LOCAL_RANK {local}: no GPU of that ordinal; batches stay in host memory");
    };
    match t.placement(gpu) {
        Some((node, cpus)) => format!(
            "LOCAL_RANK {local} → GPU {} on NUMA node {node}: host pools placed on node {node} (preferred), loader threads on CPUs {}",
            gpu.address,
            ubdirect_ub::topology::format_cpulist(&cpus)
        ),
        None => format!(
            "LOCAL_RANK {local} → GPU {}: {} NUMA node(s){}, placement left to the kernel",
            gpu.address,
            t.nodes.len().max(1),
            if gpu.numa_node.is_none() {
                " and the platform does not say the GPU's"
            } else {
                ""
            }
        ),
    }
}

/// Prints the report for people.
pub fn print(r: &Report) {
    println!("ubdirect doctor");
    for l in &r.layout {
        println!("  layout      {l}");
    }
    println!("  placement   {}", r.placement);
    if r.nvme.is_empty() {
        println!("  nvme        none found (/sys/class/nvme)");
    }
    for c in &r.nvme {
        println!(
            "  nvme        {} {:?} sn {:?} fw {:?} pci {} numa {} link {} (max {}) namespaces {}",
            c.name,
            c.model,
            c.serial,
            c.firmware,
            c.pci.as_deref().unwrap_or("?"),
            c.numa_node.map_or("?".into(), |n| n.to_string()),
            c.link.as_deref().unwrap_or("?"),
            c.link_max.as_deref().unwrap_or("?"),
            c.namespaces.join(",")
        );
    }
    if r.gpus.is_empty() {
        println!("  gpu         none found");
    }
    for g in &r.gpus {
        println!(
            "  gpu         {} pci {} numa {} (via {})",
            g.name,
            g.pci.as_deref().unwrap_or("?"),
            g.numa_node.map_or("?".into(), |n| n.to_string()),
            g.via
        );
    }
    println!(
        "  rdma        {}",
        if r.rdma.is_empty() {
            "none found (/sys/class/infiniband)".into()
        } else {
            r.rdma.join("; ")
        }
    );
    let ok: Vec<&str> = r
        .io_uring
        .iter()
        .filter(|c| c.1)
        .map(|c| c.0.as_str())
        .collect();
    let no: Vec<String> = r
        .io_uring
        .iter()
        .filter(|c| !c.1)
        .map(|c| format!("{} ({})", c.0, c.2))
        .collect();
    println!("  io_uring    supported: {}", ok.join(", "));
    if !no.is_empty() {
        println!("  io_uring    missing: {}", no.join(", "));
    }
    println!(
        "  memlock     {} {}",
        r.memlock_bytes.map_or("?".into(), |m| if m == u64::MAX {
            "unlimited".into()
        } else {
            format!("{m} bytes")
        }),
        if r.cap_ipc_lock {
            "(root: not binding)"
        } else {
            ""
        }
    );
    println!("  path        {}", r.path);
    println!("  O_DIRECT    {}", r.path_direct_io);
    println!("  cuFile      {}", r.cufile);
    println!("  loader path {}", r.device_path);
    for w in &r.warnings {
        println!("  WARNING     {w}");
    }
}
