//! The hardware report, read from /proc, /sys and DMI. Whatever cannot be read (inside VMs
//! and containers, or without root) becomes a warning rather than a failure.

use std::collections::BTreeMap;
use std::path::Path;

use shepherd_proto::agent::{
    block_device, cpu, BlockDevice, Cpu, EfiSupport, NetworkInterface, Node,
};
use shepherd_proto::bmaas::AgentHardwareReport;

fn read(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn read_num(path: impl AsRef<Path>) -> Option<i64> {
    read(path)?.parse().ok()
}

/// Reads the report from the live system.
pub fn report() -> AgentHardwareReport {
    report_from(Path::new("/"))
}

/// Reads the report from a root directory (tests point it at a fake tree).
pub fn report_from(root: &Path) -> AgentHardwareReport {
    let mut warnings = Vec::new();
    let mut node = Node::default();
    let dmi = root.join("sys/class/dmi/id");
    for (field, file) in [
        (&mut node.manufacturer, "sys_vendor"),
        (&mut node.product, "product_name"),
        (&mut node.serial_number, "product_serial"),
    ] {
        match read(dmi.join(file)) {
            Some(v) => *field = v,
            None => warnings.push(format!("DMI {file} unreadable")),
        }
    }
    memory(root, &mut node, &mut warnings);
    node.cpu = cpus(root, &mut warnings);
    node.block_device = block_devices(root, &mut warnings);
    node.network_interface = network_interfaces(root, &mut warnings);
    node.efi_support = if root.join("sys/firmware/efi").exists() {
        EfiSupport::Enabled as i32
    } else {
        EfiSupport::Unknown as i32
    };
    AgentHardwareReport {
        report: Some(node),
        warning: warnings,
    }
}

fn memory(root: &Path, node: &mut Node, warnings: &mut Vec<String>) {
    let total_kib = read(root.join("proc/meminfo")).and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
    });
    let blocks = root.join("sys/devices/system/memory");
    let block_size =
        read(blocks.join("block_size_bytes")).and_then(|h| i64::from_str_radix(&h, 16).ok());
    // Online blocks only, as upstream counts: an offlined block is not memory the OS has.
    let block_count = std::fs::read_dir(&blocks).ok().map(|d| {
        d.filter_map(|e| e.ok())
            .filter(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with("memory")
                    && n[6..].chars().all(|c| c.is_ascii_digit())
                    && read(e.path().join("online")).as_deref() != Some("0")
            })
            .count() as i64
    });
    let usable = total_kib.map(|k| k * 1024);
    let installed = match (block_size, block_count) {
        (Some(size), Some(count)) if count > 0 => Some(size * count),
        _ => {
            warnings
                .push("memory blocks unreadable; installed memory approximated by MemTotal".into());
            usable
        }
    };
    match (installed, usable) {
        (Some(i), Some(u)) if i > 0 => {
            node.memory_installed_bytes = i;
            node.memory_usable_ratio = (u as f64 / i as f64) as f32;
        }
        (Some(i), _) => node.memory_installed_bytes = i,
        _ => warnings.push("memory size unreadable".into()),
    }
}

fn cpus(root: &Path, warnings: &mut Vec<String>) -> Vec<Cpu> {
    let Some(info) = read(root.join("proc/cpuinfo")) else {
        warnings.push("/proc/cpuinfo unreadable".into());
        return Vec::new();
    };
    // One entry per logical CPU; group them into sockets by "physical id".
    let mut sockets: BTreeMap<String, (Cpu, i32)> = BTreeMap::new();
    for block in info.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let field = |name: &str| {
            block.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == name).then(|| v.trim().to_string())
            })
        };
        let socket = field("physical id").unwrap_or_else(|| "0".into());
        let num = |name: &str| field(name).and_then(|v| v.parse::<i32>().ok()).unwrap_or(0);
        let entry = sockets.entry(socket).or_insert_with(|| {
            let vendor = field("vendor_id").unwrap_or_default();
            (
                Cpu {
                    architecture: (!vendor.is_empty()).then(|| {
                        cpu::Architecture::X8664(cpu::X8664 {
                            family: num("cpu family"),
                            model: num("model"),
                            stepping: num("stepping"),
                        })
                    }),
                    cores: num("cpu cores"),
                    hardware_threads: 0,
                    vendor,
                    model: field("model name").unwrap_or_default(),
                },
                0,
            )
        });
        entry.1 += 1;
    }
    sockets
        .into_values()
        .map(|(mut c, threads)| {
            c.hardware_threads = threads;
            if c.cores == 0 {
                c.cores = threads;
            }
            c
        })
        .collect()
}

/// The entries of sysfs directory `dir` under `root`; none, with a warning, if it is unreadable.
fn sys_entries(root: &Path, dir: &str, warnings: &mut Vec<String>) -> Vec<std::fs::DirEntry> {
    match std::fs::read_dir(root.join(dir)) {
        Ok(entries) => entries.filter_map(|e| e.ok()).collect(),
        Err(_) => {
            warnings.push(format!("/{dir} unreadable"));
            Vec::new()
        }
    }
}

fn block_devices(root: &Path, warnings: &mut Vec<String>) -> Vec<BlockDevice> {
    let mut devices = Vec::new();
    for entry in sys_entries(root, "sys/block", warnings) {
        let name = entry.file_name().to_string_lossy().to_string();
        if ["loop", "ram", "zram", "dm-", "sr"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            continue;
        }
        let p = entry.path();
        let vendor = read(p.join("device/vendor")).unwrap_or_default();
        let protocol = if name.starts_with("nvme") {
            block_device::Protocol::Nvme
        } else if name.starts_with("mmcblk") {
            block_device::Protocol::Mmc
        } else if name.starts_with("sd") && vendor == "ATA" {
            // libata disks sit behind the SCSI layer and name their vendor "ATA".
            block_device::Protocol::Ata
        } else if name.starts_with("sd") {
            block_device::Protocol::Scsi
        } else {
            block_device::Protocol::Unknown
        };
        let wwid = read(p.join("wwid")).or_else(|| read(p.join("device/wwid")));
        devices.push(BlockDevice {
            vendor,
            device_model: read(p.join("device/model")).unwrap_or_default(),
            serial_number: read(p.join("device/serial")).unwrap_or_default(),
            wwn: wwid.as_deref().map(wwn_bytes).unwrap_or_default(),
            rotational: read_num(p.join("queue/rotational")) == Some(1),
            capacity_bytes: read_num(p.join("size")).unwrap_or(0) * 512,
            logical_block_size_bytes: read_num(p.join("queue/logical_block_size")).unwrap_or(0)
                as i32,
            physical_block_size_bytes: read_num(p.join("queue/physical_block_size")).unwrap_or(0)
                as i32,
            protocol: protocol as i32,
            ..Default::default()
        });
    }
    devices.sort_by(|a, b| a.serial_number.cmp(&b.serial_number));
    devices
}

/// The identifier bytes of a sysfs `wwid`, as upstream stores a WWN: the hex digits of an
/// NAA (`naa.5000c500a1b2c3d4`) or EUI (`eui.0025388b71b0e5f1`) designator. Other forms
/// (`t10.` vendor text, `nvme.` composites) carry no binary identifier and give none.
fn wwn_bytes(wwid: &str) -> Vec<u8> {
    let Some(hex) = wwid
        .strip_prefix("naa.")
        .or_else(|| wwid.strip_prefix("eui."))
    else {
        return Vec::new();
    };
    if hex.len() % 2 != 0 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Vec::new();
    }
    (0..hex.len())
        .step_by(2)
        .filter_map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect()
}

fn parse_mac(s: &str) -> Option<Vec<u8>> {
    s.split(':')
        .map(|h| u8::from_str_radix(h, 16).ok())
        .collect()
}

/// Network interfaces. Supported speeds come from the kernel (ethtool), so only for the live
/// system; a fake tree has none.
fn network_interfaces(root: &Path, warnings: &mut Vec<String>) -> Vec<NetworkInterface> {
    let live = root == Path::new("/");
    let mut nics = Vec::new();
    for entry in sys_entries(root, "sys/class/net", warnings) {
        let p = entry.path();
        // Only physical interfaces have a device; skip lo, bridges, veths.
        if !p.join("device").exists() {
            continue;
        }
        let speed_mbps = read_num(p.join("speed")).filter(|s| *s > 0).unwrap_or(0);
        nics.push(NetworkInterface {
            mac: read(p.join("address"))
                .and_then(|m| parse_mac(&m))
                .unwrap_or_default(),
            driver: std::fs::read_link(p.join("device/driver"))
                .ok()
                .and_then(|l| l.file_name().map(|n| n.to_string_lossy().to_string()))
                .unwrap_or_default(),
            supported_speed_bytes: if live {
                crate::ethtool::supported_speeds(&entry.file_name().to_string_lossy())
            } else {
                Vec::new()
            },
            link_up: read_num(p.join("carrier")) == Some(1),
            current_speed_bytes: speed_mbps * 1_000_000 / 8,
        });
    }
    nics
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(root: &Path, rel: &str, content: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }

    #[test]
    fn reads_a_fake_machine() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        for (path, text) in [
            ("sys/class/dmi/id/sys_vendor", "Acme\n"),
            ("sys/class/dmi/id/product_name", "Rack 9000\n"),
            (
                "proc/meminfo",
                "MemTotal:       8000000 kB\nMemFree: 1 kB\n",
            ),
            ("sys/devices/system/memory/block_size_bytes", "8000000\n"),
            ("sys/block/nvme0n1/size", "2000"),
            ("sys/block/nvme0n1/queue/rotational", "0"),
            ("sys/block/nvme0n1/device/serial", "S123"),
            ("sys/block/nvme0n1/wwid", "eui.0025388b71b0e5f1"),
            ("sys/block/sda/size", "4000"),
            ("sys/block/sda/device/vendor", "ATA     "),
            ("sys/block/sda/device/serial", "S200"),
            ("sys/block/sda/device/wwid", "naa.5000c500a1b2c3d4"),
            ("sys/block/sdb/size", "4000"),
            ("sys/block/sdb/device/vendor", "SEAGATE"),
            ("sys/block/sdb/device/serial", "S300"),
            ("sys/block/sdb/device/wwid", "t10.SEAGATE ST4000NM0025 Z1Z0"),
            ("sys/block/loop0/size", "1"),
            ("sys/class/net/eth0/address", "aa:bb:cc:00:11:22"),
            ("sys/class/net/eth0/carrier", "1"),
            ("sys/class/net/eth0/speed", "1000"),
        ] {
            put(r, path, text);
        }
        // 64 blocks online, and two more offlined: not installed memory the OS has.
        for i in 0..66 {
            let online = if i < 64 { "1" } else { "0" };
            put(
                r,
                &format!("sys/devices/system/memory/memory{i}/online"),
                online,
            );
        }
        let cpu = |n, phys| {
            format!("processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\nmodel name\t: Xeon\nstepping\t: 7\nphysical id\t: {phys}\ncpu cores\t: 2\n\n")
        };
        put(
            r,
            "proc/cpuinfo",
            &[cpu(0, 0), cpu(1, 0), cpu(2, 1), cpu(3, 1)].concat(),
        );
        std::fs::create_dir_all(r.join("sys/class/net/eth0/device")).unwrap();
        std::fs::create_dir_all(r.join("sys/class/net/lo")).unwrap();

        let report = report_from(r);
        let node = report.report.unwrap();
        assert_eq!(
            (node.manufacturer.as_str(), node.product.as_str()),
            ("Acme", "Rack 9000")
        );
        assert_eq!(node.memory_installed_bytes, 64 * 0x8000000);
        assert!((node.memory_usable_ratio - 8_192_000_000.0 / (64.0 * 134_217_728.0)).abs() < 1e-4);
        assert_eq!(node.cpu.len(), 2);
        assert_eq!((node.cpu[0].cores, node.cpu[0].hardware_threads), (2, 2));
        assert!(matches!(
            node.cpu[0].architecture,
            Some(cpu::Architecture::X8664(cpu::X8664 {
                family: 6,
                model: 85,
                stepping: 7
            }))
        ));
        assert_eq!(node.block_device.len(), 3, "loop devices are skipped");
        let disk = |serial: &str| {
            node.block_device
                .iter()
                .find(|b| b.serial_number == serial)
                .unwrap()
        };
        let nvme = disk("S123");
        assert_eq!(nvme.capacity_bytes, 2000 * 512);
        assert_eq!(nvme.protocol, block_device::Protocol::Nvme as i32);
        assert_eq!(nvme.wwn, [0x00, 0x25, 0x38, 0x8b, 0x71, 0xb0, 0xe5, 0xf1]);
        let ata = disk("S200");
        assert_eq!(ata.protocol, block_device::Protocol::Ata as i32);
        assert_eq!(ata.wwn, [0x50, 0x00, 0xc5, 0x00, 0xa1, 0xb2, 0xc3, 0xd4]);
        let sas = disk("S300");
        assert_eq!(sas.protocol, block_device::Protocol::Scsi as i32);
        assert!(
            sas.wwn.is_empty(),
            "a t10 designator has no identifier bytes"
        );
        assert_eq!(node.network_interface.len(), 1, "lo is skipped");
        assert_eq!(
            node.network_interface[0].mac,
            vec![0xaa, 0xbb, 0xcc, 0, 0x11, 0x22]
        );
        assert_eq!(node.network_interface[0].current_speed_bytes, 125_000_000);
        assert!(node.network_interface[0].link_up);
        // product_serial is missing: a warning, not a failure.
        assert!(
            report.warning.iter().any(|w| w.contains("product_serial")),
            "{:?}",
            report.warning
        );
    }

    /// One `/proc/cpuinfo` entry as Linux prints it on x86_64.
    #[allow(clippy::too_many_arguments)]
    fn cpuinfo_entry(
        processor: usize,
        vendor: &str,
        (family, model, stepping): (u32, u32, u32),
        name: &str,
        physical: usize,
        siblings: usize,
        core: usize,
        cores: usize,
    ) -> String {
        format!(
            "processor\t: {processor}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n\
             model\t\t: {model}\nmodel name\t: {name}\nstepping\t: {stepping}\n\
             microcode\t: 0x1000065\ncpu MHz\t\t: 2800.000\ncache size\t: 512 KB\n\
             physical id\t: {physical}\nsiblings\t: {siblings}\ncore id\t\t: {core}\n\
             cpu cores\t: {cores}\napicid\t\t: {processor}\ninitial apicid\t: {processor}\n\
             fpu\t\t: yes\nfpu_exception\t: yes\ncpuid level\t: 13\nwp\t\t: yes\n\
             flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov\n\
             bugs\t\t: sysret_ss_attrs spectre_v1 spectre_v2\nbogomips\t: 5600.00\n\
             TLB size\t: 3072 4K pages\nclflush size\t: 64\ncache_alignment\t: 64\n\
             address sizes\t: 43 bits physical, 48 bits virtual\npower management: ts ttp\n\n"
        )
    }

    fn cpus_of(cpuinfo: &str) -> Vec<Cpu> {
        let dir = tempfile::tempdir().unwrap();
        put(dir.path(), "proc/cpuinfo", cpuinfo);
        let mut warnings = vec![];
        let cpus = cpus(dir.path(), &mut warnings);
        assert!(warnings.is_empty(), "{warnings:?}");
        cpus
    }

    fn x86(family: i32, model: i32, stepping: i32) -> Option<cpu::Architecture> {
        Some(cpu::Architecture::X8664(cpu::X8664 {
            family,
            model,
            stepping,
        }))
    }

    /// Realistic `/proc/cpuinfo` files: a 1-vCPU QEMU guest, a two-socket AMD EPYC 7402
    /// (24 cores, 48 threads per socket) and a hybrid Intel i9-12900K (8 performance cores with
    /// two threads and 8 efficiency cores with one: 16 cores, 24 threads).
    #[test]
    fn cpuinfo_of_real_machines() {
        let qemu = cpuinfo_entry(
            0,
            "GenuineIntel",
            (6, 6, 3),
            "QEMU Virtual CPU version 2.5+",
            0,
            1,
            0,
            1,
        );
        assert_eq!(
            cpus_of(&qemu),
            [Cpu {
                vendor: "GenuineIntel".into(),
                model: "QEMU Virtual CPU version 2.5+".into(),
                cores: 1,
                hardware_threads: 1,
                architecture: x86(6, 6, 3),
            }]
        );

        // Linux numbers the first thread of every core, socket by socket, then the second.
        let epyc: String = (0..96)
            .map(|p| {
                let socket = (p / 24) % 2;
                let core = p % 24;
                cpuinfo_entry(
                    p,
                    "AuthenticAMD",
                    (23, 49, 0),
                    "AMD EPYC 7402 24-Core Processor",
                    socket,
                    48,
                    core,
                    24,
                )
            })
            .collect();
        let socket = Cpu {
            vendor: "AuthenticAMD".into(),
            model: "AMD EPYC 7402 24-Core Processor".into(),
            cores: 24,
            hardware_threads: 48,
            architecture: x86(23, 49, 0),
        };
        assert_eq!(cpus_of(&epyc), [socket.clone(), socket]);

        let i9: String = (0..24)
            .map(|p| {
                // Threads 0-15: the P-cores' two threads each; 16-23: the E-cores.
                let core = if p < 16 { p / 2 * 4 } else { 32 + p - 16 };
                cpuinfo_entry(
                    p,
                    "GenuineIntel",
                    (6, 151, 2),
                    "12th Gen Intel(R) Core(TM) i9-12900K",
                    0,
                    24,
                    core,
                    16,
                )
            })
            .collect();
        assert_eq!(
            cpus_of(&i9),
            [Cpu {
                vendor: "GenuineIntel".into(),
                model: "12th Gen Intel(R) Core(TM) i9-12900K".into(),
                cores: 16,
                hardware_threads: 24,
                architecture: x86(6, 151, 2),
            }]
        );
    }

    #[test]
    fn an_empty_system_gives_warnings_not_errors() {
        let dir = tempfile::tempdir().unwrap();
        let report = report_from(dir.path());
        assert!(report.warning.len() >= 5, "{:?}", report.warning);
    }
}
