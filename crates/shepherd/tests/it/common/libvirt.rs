//! libvirt domains for the bare-metal tests: machines with blank disks and nothing else, which
//! sushy-tools' libvirt driver turns into Redfish systems (power, boot override, virtual
//! media), as Ironic's and Metal3's CI do. Started by `scripts/test-deps.sh`; guests run
//! under TCG, with QEMU's user-mode network (`restrict=on`): they reach nothing but their
//! forwarded sshd, `shepherd server` and the test's image server, so all traffic stays on this
//! host.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::vm::{IMAGES_IN_GUEST, SERVER_IN_GUEST};

/// libvirt's URI the tests and sushy-tools use.
const URI: &str = "qemu:///system";

/// Runs `virsh` with `args`; its stdout, or a panic with its stderr.
pub fn virsh(args: &[&str]) -> String {
    let out = Command::new("virsh")
        .args(["-c", URI])
        .args(args)
        .output()
        .expect("virsh is missing: run scripts/test-deps.sh");
    assert!(
        out.status.success(),
        "virsh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// How a domain is made.
pub struct DomainSpec {
    /// Its index, for its name and MAC address.
    pub index: u8,
    /// The size of its blank disk (`/dev/vda` in the guest).
    pub disk_bytes: u64,
    /// The size of a second blank disk, if it has one: a SCSI disk (`/dev/sda` in the guest,
    /// behind virtio-scsi), named before the virtual CD (`/dev/sr0`) as a server's disks are.
    pub second_disk_bytes: Option<u64>,
    /// What it boots by.
    pub firmware: Firmware,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// The loopback port of `shepherd server`, forwarded to [`SERVER_IN_GUEST`].
    pub server_port: u16,
    /// The loopback port of the test's image server, forwarded to [`IMAGES_IN_GUEST`].
    pub images_port: u16,
}

/// What a domain boots by.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Firmware {
    /// SeaBIOS.
    Bios,
    /// Debian's OVMF, Secure Boot off.
    Uefi,
    /// Debian's OVMF with Secure Boot on and Microsoft's keys enrolled, as a server ships:
    /// it starts only loaders signed by Microsoft's UEFI CA (Debian's shim is), and tries the
    /// next boot option when one is refused.
    SecureBoot,
}

impl Firmware {
    /// The domain's `<loader>` and `<nvram>` (OVMF keeps its variables, boot entries among
    /// them, in a copy of its template at `vars`), and the features it needs.
    fn loader_and_features(self, vars: &Path) -> (String, &'static str) {
        let ovmf = |code: &str, secure: &str, template: &str| {
            format!(
                "<loader readonly='yes' secure='{secure}' type='pflash'>/usr/share/OVMF/{code}</loader>\
                 <nvram template='/usr/share/OVMF/{template}'>{}</nvram>",
                vars.display()
            )
        };
        match self {
            Firmware::Bios => (String::new(), ""),
            Firmware::Uefi => (ovmf("OVMF_CODE_4M.fd", "no", "OVMF_VARS_4M.fd"), ""),
            Firmware::SecureBoot => (
                ovmf("OVMF_CODE_4M.secboot.fd", "yes", "OVMF_VARS_4M.ms.fd"),
                "<smm state='on'/>",
            ),
        }
    }

    /// How the installed test OS names it on its console (`booted by …`).
    pub fn shown(self) -> &'static str {
        match self {
            Firmware::Bios => "BIOS",
            Firmware::Uefi | Firmware::SecureBoot => "UEFI",
        }
    }
}

/// A defined (not started) domain with a blank disk and an empty SATA bus for virtual media;
/// destroyed and undefined on drop, with the virtual media sushy-tools put into libvirt's
/// `default` pool for it.
pub struct Domain {
    /// Its name (`shepherd-test-PID-N`).
    pub name: String,
    /// Its UUID: its Redfish system id.
    pub uuid: String,
    /// Its disk.
    pub disk: PathBuf,
    /// The serial its disk shows the guest (`/sys/block/vda/serial`).
    pub disk_serial: String,
    /// Its second disk, if it has one, and that disk's serial.
    pub second_disk: Option<(PathBuf, String)>,
    /// Its serial console's log.
    pub serial: PathBuf,
    /// The loopback port forwarded to its sshd.
    pub ssh_port: u16,
    /// Its NIC's MAC address.
    pub mac: String,
    /// What it boots by: by UEFI, it has an NVRAM file to undefine with it.
    pub firmware: Firmware,
}

impl Domain {
    /// Defines a domain in `dir` as `spec` says.
    pub fn define(dir: &Path, spec: &DomainSpec) -> Domain {
        let name = format!("shepherd-test-{}-{}", std::process::id(), spec.index);
        let uuid = uuid::Uuid::new_v4().to_string();
        let disk = dir.join(format!("{name}.img"));
        std::fs::File::create(&disk)
            .unwrap()
            .set_len(spec.disk_bytes)
            .unwrap();
        let disk_serial = format!("SHEPHERD-{}-A", spec.index);
        let second_disk = spec.second_disk_bytes.map(|bytes| {
            let path = dir.join(format!("{name}-b.img"));
            std::fs::File::create(&path)
                .unwrap()
                .set_len(bytes)
                .unwrap();
            (path, format!("SHEPHERD-{}-B", spec.index))
        });
        let more_disks = match &second_disk {
            Some((path, serial)) => format!(
                "\n    <controller type='scsi' index='0' model='virtio-scsi'/>\
                 <disk type='file' device='disk'><driver name='qemu' type='raw'/>\
                 <source file='{}'/><target dev='sda' bus='scsi'/><serial>{serial}</serial></disk>",
                path.display()
            ),
            None => String::new(),
        };
        let serial = dir.join(format!("{name}.serial"));
        let ssh_port = super::free_port();
        let mac = format!("52:54:00:5e:01:{:02x}", spec.index);
        let netdev = format!(
            "user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:{ssh_port}-:22,\
             guestfwd=tcp:{SERVER_IN_GUEST}-cmd:socat STDIO TCP:127.0.0.1:{},\
             guestfwd=tcp:{IMAGES_IN_GUEST}-cmd:socat STDIO TCP:127.0.0.1:{}",
            spec.server_port, spec.images_port
        );
        let (loader, features) = spec
            .firmware
            .loader_and_features(&dir.join(format!("{name}_VARS.fd")));
        let template = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/bare-domain.xml");
        let xml = std::fs::read_to_string(template)
            .unwrap()
            .replace("@NAME@", &name)
            .replace("@UUID@", &uuid)
            .replace("@MEMORY_MIB@", &spec.memory_mib.to_string())
            .replace("@DISK@", &disk.display().to_string())
            .replace("@DISK_SERIAL@", &disk_serial)
            .replace("@MORE_DISKS@", &more_disks)
            .replace("@LOADER@", &loader)
            .replace("@FEATURES@", features)
            .replace("@SERIAL@", &serial.display().to_string())
            .replace("@NETDEV@", &netdev)
            .replace("@MAC@", &mac);
        let file = dir.join(format!("{name}.xml"));
        std::fs::write(&file, xml).unwrap();
        virsh(&["define", file.to_str().unwrap()]);
        Domain {
            name,
            uuid,
            disk,
            disk_serial,
            second_disk,
            serial,
            ssh_port,
            mac,
            firmware: spec.firmware,
        }
    }

    /// Its definition as libvirt has it now (`virsh dumpxml --inactive`).
    pub fn xml(&self) -> String {
        virsh(&["dumpxml", "--inactive", &self.name])
    }

    /// Whether it runs.
    pub fn is_running(&self) -> bool {
        virsh(&["domstate", &self.name]).trim() == "running"
    }

    /// What its serial console printed so far, over every boot.
    pub fn serial_log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.serial).unwrap_or_default()).into_owned()
    }

    /// `127.0.0.1:PORT` of its sshd.
    pub fn ssh_addr(&self) -> String {
        format!("127.0.0.1:{}", self.ssh_port)
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        let quiet = |args: &[&str]| {
            let _ = Command::new("virsh").args(["-c", URI]).args(args).output();
        };
        quiet(&["destroy", &self.name]);
        match self.firmware {
            Firmware::Bios => quiet(&["undefine", &self.name]),
            Firmware::Uefi | Firmware::SecureBoot => quiet(&["undefine", "--nvram", &self.name]),
        }
        // sushy-tools names each image it puts into the pool after the domain's UUID.
        if let Ok(out) = Command::new("virsh")
            .args(["-c", URI, "vol-list", "default"])
            .output()
        {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some(vol) = line
                    .split_whitespace()
                    .next()
                    .filter(|v| v.contains(&self.uuid))
                {
                    quiet(&["vol-delete", "--pool", "default", vol]);
                }
            }
        }
    }
}
