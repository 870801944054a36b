//! The host's layout as the loader needs it: NUMA nodes and their CPUs, and where each GPU, NVMe
//! controller and RDMA NIC sits — its NUMA node, the CPUs local to it, and its PCIe path from the
//! root port down, so devices behind one PCIe switch can be told apart from devices that only share
//! a socket. Read from sysfs (`/sys/devices/system/node`, `/sys/bus/pci/devices`); a root other than
//! `/` can be given, which is how the tests read a recorded tree. Nothing here needs a driver.

use std::path::Path;

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NumaNode {
    /// Node id.
    pub id: u32,
    /// Its CPUs.
    pub cpus: Vec<usize>,
}

/// What a PCI device is to the loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PciKind {
    /// An NVIDIA GPU (3D or VGA controller of vendor 0x10de).
    Gpu,
    /// An NVMe controller (class 0x0108 02).
    Nvme,
    /// A network controller with an RDMA device (`infiniband/` below it).
    Rdma,
}

/// One device of interest on the PCI tree.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PciDevice {
    /// What it is.
    pub kind: PciKind,
    /// Its address (`0000:1b:00.0`).
    pub address: String,
    /// Its NUMA node (`None`: the platform does not say, a single-node machine usually).
    pub numa_node: Option<u32>,
    /// CPUs local to it (`local_cpulist`).
    pub local_cpus: Vec<usize>,
    /// Bridges from the root port down to it (addresses), the device excluded.
    pub path: Vec<String>,
}

impl PciDevice {
    /// The first bridge below the root port on its path (a PCIe switch's upstream port), if any:
    /// devices that share it share a switch.
    pub fn switch(&self) -> Option<&str> {
        self.path.get(1).map(String::as_str)
    }
}

/// The host's layout.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Topology {
    /// NUMA nodes (empty when sysfs has none: one node, as far as the loader is concerned).
    pub nodes: Vec<NumaNode>,
    /// GPUs, NVMe controllers and RDMA NICs, by address.
    pub devices: Vec<PciDevice>,
}

/// Parses a kernel CPU list (`0-3,8,10-11`); malformed parts are skipped.
pub fn parse_cpulist(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>())
                    && a <= b
                    && b - a < 1 << 16
                {
                    out.extend(a..=b);
                }
            }
            None => {
                if let Ok(a) = part.trim().parse() {
                    out.push(a);
                }
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// A CPU list in the kernel's form (`0-3,8`).
pub fn format_cpulist(cpus: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

fn kind_of(dev: &Path) -> Option<PciKind> {
    let class = read(&dev.join("class"))?;
    let vendor = read(&dev.join("vendor")).unwrap_or_default();
    if vendor == "0x10de" && (class.starts_with("0x0302") || class.starts_with("0x0300")) {
        return Some(PciKind::Gpu);
    }
    if class.starts_with("0x010802") {
        return Some(PciKind::Nvme);
    }
    if class.starts_with("0x02") && dev.join("infiniband").is_dir() {
        return Some(PciKind::Rdma);
    }
    None
}

/// PCI addresses look like `dddd:bb:dd.f`.
fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

impl Topology {
    /// The layout of this host.
    pub fn probe() -> Topology {
        Self::probe_at(Path::new("/"))
    }

    /// The layout under `root` (a sysfs tree recorded elsewhere, for tests).
    pub fn probe_at(root: &Path) -> Topology {
        let mut t = Topology::default();
        let nodes = root.join("sys/devices/system/node");
        if let Ok(rd) = std::fs::read_dir(&nodes) {
            for e in rd.filter_map(|e| e.ok()) {
                let name = e.file_name().to_string_lossy().to_string();
                let Some(id) = name.strip_prefix("node").and_then(|n| n.parse().ok()) else {
                    continue;
                };
                let cpus = read(&e.path().join("cpulist"))
                    .map(|s| parse_cpulist(&s))
                    .unwrap_or_default();
                t.nodes.push(NumaNode { id, cpus });
            }
        }
        t.nodes.sort_by_key(|n| n.id);
        let devs = root.join("sys/bus/pci/devices");
        if let Ok(rd) = std::fs::read_dir(&devs) {
            for e in rd.filter_map(|e| e.ok()) {
                let p = e.path();
                let Some(kind) = kind_of(&p) else { continue };
                let address = e.file_name().to_string_lossy().to_string();
                // The device's place in the tree: /sys/devices/pci0000:00/<root port>/<switch>/…/<dev>.
                let real = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
                let path: Vec<String> = real
                    .iter()
                    .map(|c| c.to_string_lossy().to_string())
                    .filter(|c| is_pci_address(c) && *c != address)
                    .collect();
                t.devices.push(PciDevice {
                    kind,
                    numa_node: read(&p.join("numa_node"))
                        .and_then(|s| s.parse::<i64>().ok())
                        .and_then(|n| u32::try_from(n).ok()),
                    local_cpus: read(&p.join("local_cpulist"))
                        .map(|s| parse_cpulist(&s))
                        .unwrap_or_default(),
                    address,
                    path,
                });
            }
        }
        t.devices.sort_by(|a, b| a.address.cmp(&b.address));
        t
    }

    /// The GPUs, in PCI bus order (CUDA's order with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and the
    /// default order on machines of identical GPUs).
    pub fn gpus(&self) -> impl Iterator<Item = &PciDevice> {
        self.devices.iter().filter(|d| d.kind == PciKind::Gpu)
    }

    /// The device at PCI address `address` (case-insensitive; CUDA writes `00000000:1B:00.0`).
    pub fn device(&self, address: &str) -> Option<&PciDevice> {
        let a = address.to_ascii_lowercase();
        let a = a
            .strip_prefix("0000")
            .filter(|r| r.len() == 12)
            .unwrap_or(&a);
        self.devices.iter().find(|d| d.address == a)
    }

    /// Devices of `kind` behind the same PCIe switch as `dev` (not `dev` itself).
    pub fn same_switch<'a>(
        &'a self,
        dev: &'a PciDevice,
        kind: PciKind,
    ) -> impl Iterator<Item = &'a PciDevice> + 'a {
        self.peers(dev, kind, |d| d.switch().map(str::to_string))
    }

    /// Devices of `kind` on the same NUMA node as `dev` (not `dev` itself).
    pub fn same_node<'a>(
        &'a self,
        dev: &'a PciDevice,
        kind: PciKind,
    ) -> impl Iterator<Item = &'a PciDevice> + 'a {
        self.peers(dev, kind, |d| d.numa_node.map(|n| n.to_string()))
    }

    /// Devices of `kind` (not `dev`) whose `key` is known and equal to `dev`'s.
    fn peers<'a>(
        &'a self,
        dev: &'a PciDevice,
        kind: PciKind,
        key: fn(&PciDevice) -> Option<String>,
    ) -> impl Iterator<Item = &'a PciDevice> + 'a {
        let want = key(dev);
        self.devices.iter().filter(move |d| {
            d.kind == kind && d.address != dev.address && want.is_some() && key(d) == want
        })
    }

    /// Where a rank's memory and threads belong: the NUMA node of `gpu` and its CPUs, when the
    /// host has more than one node and the platform says which (`None`: nothing to choose).
    pub fn placement(&self, gpu: &PciDevice) -> Option<(u32, Vec<usize>)> {
        if self.nodes.len() < 2 {
            return None;
        }
        let node = gpu.numa_node?;
        let cpus = if gpu.local_cpus.is_empty() {
            self.nodes.iter().find(|n| n.id == node)?.cpus.clone()
        } else {
            gpu.local_cpus.clone()
        };
        Some((node, cpus))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_parse_and_format_back() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(parse_cpulist(""), Vec::<usize>::new());
        assert_eq!(parse_cpulist("5-2,x,7"), vec![7]);
        assert_eq!(parse_cpulist("0-4294967295"), Vec::<usize>::new());
    }

    /// A recorded two-socket tree: GPUs 1b and 1c behind one switch with NVMe 1d, GPU 9b on the
    /// other socket, an RDMA NIC on the first.
    #[test]
    fn a_two_socket_tree_groups_devices_by_switch_and_node() {
        let root = std::env::temp_dir().join(format!("ubdirect-topo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let sys = root.join("sys");
        let mk = |rel: &str, files: &[(&str, &str)]| {
            let d = sys.join(rel);
            std::fs::create_dir_all(&d).expect("dir");
            for (f, v) in files {
                std::fs::write(d.join(f), v).expect("write");
            }
            d
        };
        mk("devices/system/node/node0", &[("cpulist", "0-7\n")]);
        mk("devices/system/node/node1", &[("cpulist", "8-15\n")]);
        let sw = "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0";
        let gpu = |node: &str, cpus: &str| -> Vec<(String, String)> {
            vec![
                ("class".into(), "0x030200\n".into()),
                ("vendor".into(), "0x10de\n".into()),
                ("numa_node".into(), format!("{node}\n")),
                ("local_cpulist".into(), format!("{cpus}\n")),
            ]
        };
        let add = |tree: String, addr: &str, files: Vec<(String, String)>| {
            let f: Vec<(&str, &str)> = files
                .iter()
                .map(|(a, b)| (a.as_str(), b.as_str()))
                .collect();
            let d = mk(&format!("{tree}/{addr}"), &f);
            std::fs::create_dir_all(sys.join("bus/pci/devices")).expect("dir");
            std::os::unix::fs::symlink(&d, sys.join("bus/pci/devices").join(addr)).expect("link");
            d
        };
        add(sw.into(), "0000:1b:00.0", gpu("0", "0-7"));
        add(sw.into(), "0000:1c:00.0", gpu("0", "0-7"));
        add(
            sw.into(),
            "0000:1d:00.0",
            vec![
                ("class".into(), "0x010802\n".into()),
                ("vendor".into(), "0x144d\n".into()),
                ("numa_node".into(), "0\n".into()),
            ],
        );
        add(
            "devices/pci0000:80/0000:80:01.0/0000:81:00.0".into(),
            "0000:9b:00.0",
            gpu("1", "8-15"),
        );
        let nic = add(
            "devices/pci0000:00/0000:00:03.0".into(),
            "0000:05:00.0",
            vec![
                ("class".into(), "0x020700\n".into()),
                ("vendor".into(), "0x15b3\n".into()),
                ("numa_node".into(), "0\n".into()),
            ],
        );
        std::fs::create_dir_all(nic.join("infiniband/mlx5_0")).expect("dir");

        let t = Topology::probe_at(&root);
        assert_eq!(t.nodes.len(), 2);
        assert_eq!(t.nodes[1].cpus, (8..16).collect::<Vec<_>>());
        let gpus: Vec<&str> = t.gpus().map(|g| g.address.as_str()).collect();
        assert_eq!(gpus, ["0000:1b:00.0", "0000:1c:00.0", "0000:9b:00.0"]);
        let g0 = t
            .device("00000000:1B:00.0")
            .expect("CUDA's form of the address");
        assert_eq!(g0.switch(), Some("0000:01:00.0"));
        let peers: Vec<&str> = t
            .same_switch(g0, PciKind::Gpu)
            .map(|d| d.address.as_str())
            .collect();
        assert_eq!(peers, ["0000:1c:00.0"]);
        let drives: Vec<&str> = t
            .same_switch(g0, PciKind::Nvme)
            .map(|d| d.address.as_str())
            .collect();
        assert_eq!(drives, ["0000:1d:00.0"]);
        let nics: Vec<&str> = t
            .same_node(g0, PciKind::Rdma)
            .map(|d| d.address.as_str())
            .collect();
        assert_eq!(nics, ["0000:05:00.0"]);
        let g2 = t.device("0000:9b:00.0").expect("gpu 2");
        assert_eq!(t.same_switch(g2, PciKind::Gpu).count(), 0);
        assert_eq!(t.placement(g2), Some((1, (8..16).collect())));
        // One node: nothing to place.
        let one = Topology {
            nodes: vec![t.nodes[0].clone()],
            devices: t.devices.clone(),
        };
        assert_eq!(one.placement(g0), None);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn this_host_probes_without_panicking() {
        let t = Topology::probe();
        // Every node lists CPUs; every device has an address and a path of PCI addresses.
        assert!(t.nodes.iter().all(|n| !n.cpus.is_empty()), "{t:?}");
        assert!(
            t.devices.iter().all(|d| is_pci_address(&d.address)),
            "{t:?}"
        );
    }
}
