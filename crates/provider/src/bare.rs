//! Machines that come bare (design.md §21): what an inventory entry's `Bare` says (the OS image to
//! install, the disk, whether it may be overwritten, the live environment's network), checked
//! when the inventory is read, and the config drive each machine's live environment reads:
//! OpenStack's config-2 layout (`meta_data.json` with the SSH keys and the agent's settings,
//! `network_data.json`), which the media server splices into the live image.

use std::net::Ipv4Addr;

use serde::Deserialize;
use shepherd_disks::{DiskChoice, ImageFormat};

use crate::settings::InvalidSetting;

/// Longest text a config drive file may have: the live image's slots are 16 KiB.
pub const MAX_CONFIG_FILE_BYTES: usize = 16 << 10;

/// An inventory entry's `Bare`: the machine has a Redfish BMC and nothing else yet, and this
/// is what goes onto it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
pub struct BareEntry {
    /// The OS image to write onto the disk, as the machine reaches it (http or https): raw,
    /// raw compressed with gzip, xz or zstd, or qcow2.
    #[serde(rename = "ImageURL")]
    pub image_url: String,
    /// Its sha256 as served, 64 hex digits: the agent checks every byte it received against it.
    #[serde(rename = "ImageSHA256")]
    pub image_sha256: String,
    /// The disk the image goes onto, as written: a device path as the live environment's
    /// kernel names it (`"/dev/nvme0n1"`), or root device hints in Ironic's vocabulary
    /// (`{"serial": "S3YJNX0K"}`, `{"size": ">= 400", "rotational": false}`). Only a whole disk
    /// counts, and hints must match exactly one ([`BareEntry::disk_choice`]).
    pub disk: serde_json::Value,
    /// The image's format (`raw`, `gzip`, `xz`, `zstd`); left out, the agent tells it by its
    /// first bytes. Named, an image of another format is refused before anything is written.
    pub format: Option<String>,
    /// Whether the disk may be overwritten although it holds a partition table or a file
    /// system (without it, and without an operator's reimage that allows it, the agent
    /// refuses to write such a disk).
    #[serde(default)]
    pub wipe: bool,
    /// The live environment's network: a static address on a BMC network without DHCP.
    /// Left out, every NIC asks DHCP. The installed OS's config drive carries it too.
    pub network: Option<BareNetwork>,
    /// Whether the agent adds a config drive to the installed disk after the image: a
    /// partition labelled `config-2` at the disk's end with Shepherd's SSH keys, the network
    /// and `UserData`, which cloud-init in a stock cloud image reads. `false` for an image that
    /// brings its own way in. Left out: true.
    #[serde(default = "config_drive_by_default")]
    pub config_drive: bool,
    /// cloud-init user data for the installed OS (`#cloud-config …`), on its config drive.
    pub user_data: Option<String>,
    /// The firmware boot mode every boot override asks for (`"UEFI"` or `"Legacy"`); left
    /// out, the system's own.
    pub boot_mode: Option<BootMode>,
}

/// A system's firmware boot mode (`BootSourceOverrideMode`), as an entry's `BootMode` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum BootMode {
    /// UEFI.
    #[serde(rename = "UEFI")]
    Uefi,
    /// A BIOS, or UEFI's compatibility module.
    Legacy,
}

impl BootMode {
    /// Its name in Redfish.
    pub fn redfish(self) -> &'static str {
        match self {
            BootMode::Uefi => "UEFI",
            BootMode::Legacy => "Legacy",
        }
    }
}

impl std::fmt::Display for BootMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.redfish())
    }
}

/// An entry that says nothing of `ConfigDrive` gets one.
fn config_drive_by_default() -> bool {
    true
}

/// The most user data an entry may carry, as OpenStack allows.
pub const MAX_USER_DATA_BYTES: usize = 65535;

/// A static IPv4 network for the live environment.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
pub struct BareNetwork {
    /// Address and prefix, `10.0.0.7/24`.
    pub address: String,
    /// The default route's gateway.
    pub gateway: Option<String>,
    /// Name servers.
    #[serde(rename = "DNS", default)]
    pub dns: Vec<String>,
    /// The NIC to configure, by MAC address; left out, the first NIC with a link.
    #[serde(rename = "MAC")]
    pub mac: Option<String>,
}

impl BareEntry {
    /// Checks the entry without fetching anything.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let bad =
            |field: &str, problem: String| InvalidSetting::new(format!("Bare.{field}"), problem);
        let url = url::Url::parse(&self.image_url).map_err(|e| {
            let shown = shepherd_disks::url_shown(&self.image_url);
            bad("ImageURL", format!("{shown:?}: {e}"))
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad("ImageURL", "must be http(s)".into()));
        }
        let sha = &self.image_sha256;
        if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("ImageSHA256", format!("{sha:?} is not 64 hex digits")));
        }
        self.disk_choice()?;
        self.image_format()?;
        if let Some(n) = &self.network {
            n.parsed()
                .map_err(|(field, problem)| bad(&format!("Network.{field}"), problem))?;
        }
        match &self.user_data {
            Some(u) if u.len() > MAX_USER_DATA_BYTES => Err(bad(
                "UserData",
                format!("is {} bytes, more than {MAX_USER_DATA_BYTES}", u.len()),
            )),
            Some(_) if !self.config_drive => Err(bad(
                "UserData",
                "reaches the installed OS on its config drive, which ConfigDrive false turns off"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    /// The disk the entry names, parsed.
    pub fn disk_choice(&self) -> Result<DiskChoice, InvalidSetting> {
        DiskChoice::from_value(&self.disk)
            .map_err(|e| InvalidSetting::new("Bare.Disk", e.to_string()))
    }

    /// The format the entry names, if it names one.
    pub fn image_format(&self) -> Result<Option<ImageFormat>, InvalidSetting> {
        self.format
            .as_deref()
            .map(|f| {
                ImageFormat::parse(f).map_err(|e| InvalidSetting::new("Bare.Format", e.to_string()))
            })
            .transpose()
    }
}

/// A [`BareNetwork`] checked: address, prefix length, gateway, name servers, MAC.
struct ParsedNetwork {
    address: Ipv4Addr,
    prefix: u8,
    gateway: Option<Ipv4Addr>,
    dns: Vec<Ipv4Addr>,
    mac: Option<String>,
}

impl BareNetwork {
    fn parsed(&self) -> Result<ParsedNetwork, (&'static str, String)> {
        let (addr, prefix) = self.address.split_once('/').ok_or((
            "Address",
            format!("{:?} is not ADDRESS/PREFIX", self.address),
        ))?;
        let address: Ipv4Addr = addr
            .parse()
            .map_err(|_| ("Address", format!("{addr:?} is not an IPv4 address")))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| (1..=32).contains(p))
            .ok_or(("Address", format!("prefix {prefix:?} is not 1 to 32")))?;
        let ip = |field, text: &str| {
            text.parse::<Ipv4Addr>()
                .map_err(|_| (field, format!("{text:?} is not an IPv4 address")))
        };
        let gateway = self
            .gateway
            .as_deref()
            .map(|g| ip("Gateway", g))
            .transpose()?;
        let dns = self
            .dns
            .iter()
            .map(|d| ip("DNS", d))
            .collect::<Result<Vec<_>, _>>()?;
        let mac = match &self.mac {
            None => None,
            Some(m) => {
                let lower = m.to_ascii_lowercase();
                let octets: Vec<&str> = lower.split(':').collect();
                if octets.len() != 6
                    || !octets
                        .iter()
                        .all(|o| o.len() == 2 && o.bytes().all(|b| b.is_ascii_hexdigit()))
                {
                    return Err((
                        "MAC",
                        format!("{m:?} is not a MAC address like 52:54:00:12:34:56"),
                    ));
                }
                Some(lower)
            }
        };
        Ok(ParsedNetwork {
            address,
            prefix,
            gateway,
            dns,
            mac,
        })
    }
}

/// The netmask of an IPv4 prefix length.
fn netmask(prefix: u8) -> Ipv4Addr {
    Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0))
}

/// What a machine's live environment is told, besides its network.
#[derive(Debug, Clone)]
pub struct LiveFacts<'a> {
    /// The machine's BMDB id (the config drive's `uuid`).
    pub machine: uuid::Uuid,
    /// Its host name in the live environment.
    pub hostname: &'a str,
    /// The SSH public keys root accepts (Shepherd's), OpenSSH lines.
    pub public_keys: &'a [String],
    /// The agent's settings, as `SHEPHERD_*` variables of the SSH sessions that start it.
    pub agent_env: &'a [(String, String)],
}

/// Why a config drive could not be made.
#[derive(Debug, thiserror::Error)]
#[error("the config drive's {file} is {bytes} bytes, more than the live image's {MAX_CONFIG_FILE_BYTES}-byte slot")]
pub struct ConfigTooLarge {
    /// Which file.
    pub file: &'static str,
    /// Its size.
    pub bytes: usize,
}

/// The config drive of a machine: a JSON object of its files by name (`meta_data.json`,
/// `network_data.json`), each a JSON text in OpenStack's config-2 format.
pub fn config_drive(facts: &LiveFacts<'_>, entry: &BareEntry) -> Result<String, ConfigTooLarge> {
    let keys = public_keys(facts.public_keys);
    let meta: serde_json::Map<String, serde_json::Value> = facts
        .agent_env
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::from(v.as_str())))
        .collect();
    let meta_data = serde_json::json!({
        "uuid": facts.machine.to_string(),
        "hostname": facts.hostname,
        "name": facts.hostname,
        "public_keys": keys,
        "meta": meta,
    });
    let network_data = network_data(entry.network.as_ref());
    let mut files = serde_json::Map::new();
    for (file, value) in [
        ("meta_data.json", meta_data),
        ("network_data.json", network_data),
    ] {
        let text = value.to_string();
        if text.len() > MAX_CONFIG_FILE_BYTES {
            return Err(ConfigTooLarge {
                file,
                bytes: text.len(),
            });
        }
        files.insert(file.to_string(), serde_json::Value::from(text));
    }
    Ok(serde_json::Value::Object(files).to_string())
}

/// The vendor data (`vendor_data.json`'s `cloud-init`) of an installed OS that Shepherd logs
/// in to as root: a stock cloud image's cloud-init gives the config drive's keys to its
/// default user (`debian`, `ubuntu`) and, with `disable_root` (Debian's and Ubuntu's
/// default), refuses them for root. Vendor data is what the provider of a machine says; the
/// entry's user data, which cloud-init merges over it, still has the last word.
pub const ROOT_LOGIN_VENDOR_DATA: &str =
    "#cloud-config\n# Shepherd logs in as root with the keys of meta_data.json.\ndisable_root: false\n";

/// `public_keys` of `meta_data.json`: Shepherd's keys, each named.
fn public_keys(keys: &[String]) -> serde_json::Map<String, serde_json::Value> {
    keys.iter()
        .enumerate()
        .map(|(i, k)| (format!("shepherd-{i}"), serde_json::Value::from(k.as_str())))
        .collect()
}

/// The installed OS's config drive (design.md §21): OpenStack's config-2 files the agent adds
/// to the installed disk, by path: `meta_data.json` with the machine's id and name and
/// Shepherd's keys (and nothing of the live environment's: no agent settings, no proof),
/// `network_data.json` when the entry names a static network (without it cloud-init asks
/// DHCP), [`ROOT_LOGIN_VENDOR_DATA`] when Shepherd logs in as `user` root, and the entry's
/// `user_data`. None when the entry turns it off.
pub fn installed_config_drive(
    machine: uuid::Uuid,
    hostname: &str,
    keys: &[String],
    user: &str,
    entry: &BareEntry,
) -> Vec<(String, Vec<u8>)> {
    if !entry.config_drive {
        return Vec::new();
    }
    let meta_data = serde_json::json!({
        "uuid": machine.to_string(),
        "hostname": hostname,
        "name": hostname,
        "public_keys": public_keys(keys),
    });
    let mut files = vec![("meta_data.json", meta_data.to_string().into_bytes())];
    if entry.network.is_some() {
        let network = network_data(entry.network.as_ref()).to_string();
        files.push(("network_data.json", network.into_bytes()));
    }
    if user == "root" {
        let vendor_data = serde_json::json!({ "cloud-init": ROOT_LOGIN_VENDOR_DATA });
        files.push(("vendor_data.json", vendor_data.to_string().into_bytes()));
    }
    if let Some(user_data) = &entry.user_data {
        files.push(("user_data", user_data.clone().into_bytes()));
    }
    files
        .into_iter()
        .map(|(name, content)| (format!("openstack/latest/{name}"), content))
        .collect()
}

/// `network_data.json`: nothing (DHCP on every NIC), or the static network on one link.
fn network_data(network: Option<&BareNetwork>) -> serde_json::Value {
    let Some(parsed) = network.and_then(|n| n.parsed().ok()) else {
        return serde_json::json!({ "links": [], "networks": [], "services": [] });
    };
    let mut link = serde_json::json!({ "id": "bare0", "type": "phy" });
    if let Some(mac) = &parsed.mac {
        link["ethernet_mac_address"] = mac.as_str().into();
    }
    let routes: Vec<serde_json::Value> = parsed
        .gateway
        .iter()
        .map(|g| serde_json::json!({ "network": "0.0.0.0", "netmask": "0.0.0.0", "gateway": g.to_string() }))
        .collect();
    let services: Vec<serde_json::Value> = parsed
        .dns
        .iter()
        .map(|d| serde_json::json!({ "type": "dns", "address": d.to_string() }))
        .collect();
    serde_json::json!({
        "links": [link],
        "networks": [{
            "id": "bare0-ipv4", "link": "bare0", "type": "ipv4",
            "ip_address": parsed.address.to_string(),
            "netmask": netmask(parsed.prefix).to_string(),
            "routes": routes,
        }],
        "services": services,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> BareEntry {
        BareEntry {
            image_url: "https://images.example/debian.img".into(),
            image_sha256: "a".repeat(64),
            disk: "/dev/nvme0n1".into(),
            format: None,
            wipe: false,
            network: None,
            config_drive: true,
            user_data: None,
            boot_mode: None,
        }
    }

    /// A static network on the NIC of a MAC, with a gateway and a name server.
    fn fixed_network() -> BareNetwork {
        BareNetwork {
            address: "10.0.0.7/22".into(),
            gateway: Some("10.0.0.1".into()),
            dns: vec!["10.0.0.2".into()],
            mac: Some("52:54:00:AB:CD:01".into()),
        }
    }

    /// `BootMode` is UEFI or Legacy, as Redfish spells them; anything else is refused when
    /// the inventory is read.
    #[test]
    fn a_boot_mode_is_uefi_or_legacy() {
        let parse = |mode: &str| {
            serde_json::from_value::<BareEntry>(serde_json::json!({
                "ImageURL": "https://images.example/os.img", "ImageSHA256": "a".repeat(64),
                "Disk": "/dev/vda", "BootMode": mode}))
        };
        assert_eq!(parse("UEFI").unwrap().boot_mode, Some(BootMode::Uefi));
        assert_eq!(parse("Legacy").unwrap().boot_mode, Some(BootMode::Legacy));
        let bios = parse("BIOS").unwrap_err().to_string();
        assert!(bios.contains("expected `UEFI` or `Legacy`"), "{bios}");
    }

    #[test]
    fn entries_are_checked_field_by_field() {
        entry().validate().unwrap();
        let cases: Vec<(BareEntry, &str)> = vec![
            (
                BareEntry {
                    image_url: "ftp://x/y".into(),
                    ..entry()
                },
                "Bare.ImageURL: must be http(s)",
            ),
            (
                BareEntry {
                    image_url: "nope".into(),
                    ..entry()
                },
                "Bare.ImageURL",
            ),
            (
                BareEntry {
                    image_sha256: "abc".into(),
                    ..entry()
                },
                "Bare.ImageSHA256",
            ),
            (
                BareEntry {
                    disk: "sda".into(),
                    ..entry()
                },
                "Bare.Disk",
            ),
            (
                BareEntry {
                    disk: "/dev/../etc/passwd".into(),
                    ..entry()
                },
                "Bare.Disk",
            ),
            (
                BareEntry {
                    disk: "/dev/sda; rm -rf /".into(),
                    ..entry()
                },
                "Bare.Disk",
            ),
            (
                BareEntry {
                    disk: serde_json::json!({"serial": "s>= x", "color": "red"}),
                    ..entry()
                },
                "Bare.Disk: root device hint color: is not a hint",
            ),
            (
                BareEntry {
                    disk: serde_json::json!({"size": "s== 10"}),
                    ..entry()
                },
                "Bare.Disk: root device hint size: operator s== does not apply",
            ),
            (
                BareEntry {
                    disk: serde_json::json!(["/dev/sda"]),
                    ..entry()
                },
                "Bare.Disk",
            ),
            (
                BareEntry {
                    format: Some("vmdk".into()),
                    ..entry()
                },
                "Bare.Format: \"vmdk\" is not a format; the formats are raw, gzip, xz, zstd, qcow2",
            ),
        ];
        let net = |address: &str, gateway: Option<&str>, mac: Option<&str>| BareEntry {
            network: Some(BareNetwork {
                address: address.into(),
                gateway: gateway.map(Into::into),
                dns: vec![],
                mac: mac.map(Into::into),
            }),
            ..entry()
        };
        let cases = cases.into_iter().chain([
            (net("10.0.0.7", None, None), "Bare.Network.Address"),
            (net("10.0.0.7/33", None, None), "Bare.Network.Address"),
            (net("fe80::1/64", None, None), "Bare.Network.Address"),
            (net("10.0.0.7/24", Some("gw"), None), "Bare.Network.Gateway"),
            (
                net("10.0.0.7/24", None, Some("52:54:00")),
                "Bare.Network.MAC",
            ),
        ]);
        for (bad, want) in cases {
            let text = bad.validate().unwrap_err().to_string();
            assert!(text.contains(want), "want {want:?} in {text:?}");
        }
        net("10.0.0.7/24", Some("10.0.0.1"), Some("52:54:00:AB:cd:01"))
            .validate()
            .unwrap();
    }

    #[test]
    fn the_config_drive_says_keys_network_and_agent_settings() {
        let keys = vec!["ssh-ed25519 AAAA shepherd".to_string()];
        let env = vec![(
            "SHEPHERD_AGENT_HEARTBEAT_INTERVAL".to_string(),
            "2s".to_string(),
        )];
        let facts = LiveFacts {
            machine: uuid::Uuid::nil(),
            hostname: "r1-u07",
            public_keys: &keys,
            agent_env: &env,
        };
        let files: serde_json::Value =
            serde_json::from_str(&config_drive(&facts, &entry()).unwrap()).unwrap();
        let meta: serde_json::Value =
            serde_json::from_str(files["meta_data.json"].as_str().unwrap()).unwrap();
        assert_eq!(
            meta["public_keys"]["shepherd-0"],
            "ssh-ed25519 AAAA shepherd"
        );
        assert_eq!(meta["meta"]["SHEPHERD_AGENT_HEARTBEAT_INTERVAL"], "2s");
        assert_eq!(meta["hostname"], "r1-u07");
        let dhcp: serde_json::Value =
            serde_json::from_str(files["network_data.json"].as_str().unwrap()).unwrap();
        assert_eq!(
            dhcp["networks"],
            serde_json::json!([]),
            "no network: DHCP everywhere"
        );

        let fixed = BareEntry {
            network: Some(fixed_network()),
            ..entry()
        };
        let files: serde_json::Value =
            serde_json::from_str(&config_drive(&facts, &fixed).unwrap()).unwrap();
        let net: serde_json::Value =
            serde_json::from_str(files["network_data.json"].as_str().unwrap()).unwrap();
        assert_eq!(net["links"][0]["ethernet_mac_address"], "52:54:00:ab:cd:01");
        assert_eq!(net["networks"][0]["type"], "ipv4");
        assert_eq!(net["networks"][0]["ip_address"], "10.0.0.7");
        assert_eq!(net["networks"][0]["netmask"], "255.255.252.0");
        assert_eq!(net["networks"][0]["routes"][0]["gateway"], "10.0.0.1");
        assert_eq!(net["services"][0]["address"], "10.0.0.2");

        let many: Vec<String> = (0..200)
            .map(|i| format!("ssh-ed25519 {}", "A".repeat(80 + i)))
            .collect();
        let facts = LiveFacts {
            public_keys: &many,
            ..facts
        };
        let err = config_drive(&facts, &entry()).unwrap_err().to_string();
        assert!(
            err.contains("meta_data.json") && err.contains("slot"),
            "{err}"
        );
    }

    /// cloud-init's own code (Debian's package, as a stock cloud image runs it; from
    /// scripts/test-deps.sh) reads the installed OS's config drive as Shepherd means it: the
    /// machine's id and name, Shepherd's key, the user data, and the static network on the NIC
    /// of the entry's MAC.
    #[test]
    fn cloud_init_reads_the_installed_config_drive_as_meant() {
        let keys = vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBfake shepherd".to_string()];
        let id = uuid::Uuid::from_u128(7);
        let entry = BareEntry {
            network: Some(fixed_network()),
            user_data: Some("#cloud-config\npackages: [htop]\n".into()),
            ..entry()
        };
        let files = installed_config_drive(id, "r1-u07", &keys, "root", &entry);
        let read = crate::testing::cloud_init::read(&files, &[("52:54:00:ab:cd:01", "enp1s0")]);
        assert_eq!(read["vendor_data"], ROOT_LOGIN_VENDOR_DATA, "{read}");
        assert_eq!(read["instance_id"], id.to_string(), "{read}");
        assert_eq!(read["hostname"], "r1-u07", "{read}");
        assert_eq!(read["public_keys"], serde_json::json!(keys), "{read}");
        assert_eq!(
            read["user_data"], "#cloud-config\npackages: [htop]\n",
            "{read}"
        );
        let nic = &read["network"]["config"][0];
        assert_eq!(
            (&nic["name"], &nic["type"]),
            (&"enp1s0".into(), &"physical".into()),
            "{read}"
        );
        let subnet = &nic["subnets"][0];
        assert_eq!(subnet["type"], "static", "{read}");
        assert_eq!(subnet["address"], "10.0.0.7", "{read}");
        assert_eq!(subnet["netmask"], "255.255.252.0", "{read}");
        assert_eq!(subnet["routes"][0]["gateway"], "10.0.0.1", "{read}");
        assert!(
            read["network"].to_string().contains("\"10.0.0.2\""),
            "{read}"
        );
    }

    /// The installed OS's config drive: the machine's id and name and Shepherd's keys, none of
    /// the live environment's settings, the network only when the entry names one, the user
    /// data; nothing when the entry turns it off, and user data it cannot carry is refused.
    #[test]
    fn the_installed_config_drive_says_keys_network_and_user_data_and_nothing_of_the_live_one() {
        let keys = vec!["ssh-ed25519 AAAA shepherd".to_string()];
        let id = uuid::Uuid::from_u128(7);
        let files = |e: &BareEntry| -> Vec<(String, serde_json::Value)> {
            installed_config_drive(id, "r1-u07", &keys, "debian", e)
                .into_iter()
                .map(|(path, bytes)| {
                    let text = String::from_utf8(bytes).unwrap();
                    let value = serde_json::from_str(&text).unwrap_or(text.into());
                    (path, value)
                })
                .collect()
        };
        let dhcp = files(&entry());
        let [(path, meta)] = dhcp.as_slice() else {
            panic!("{dhcp:?}")
        };
        assert_eq!(path, "openstack/latest/meta_data.json");
        assert_eq!(
            *meta,
            serde_json::json!({"uuid": id.to_string(), "hostname": "r1-u07", "name": "r1-u07",
                "public_keys": {"shepherd-0": "ssh-ed25519 AAAA shepherd"}}),
            "no agent settings, no proof: those are the live environment's"
        );
        let full = BareEntry {
            network: Some(BareNetwork {
                address: "10.0.0.7/24".into(),
                gateway: None,
                dns: vec![],
                mac: Some("52:54:00:ab:cd:01".into()),
            }),
            user_data: Some("#cloud-config\npackages: [htop]\n".into()),
            ..entry()
        };
        let paths: Vec<String> = files(&full).into_iter().map(|(p, _)| p).collect();
        assert_eq!(
            paths,
            [
                "openstack/latest/meta_data.json",
                "openstack/latest/network_data.json",
                "openstack/latest/user_data"
            ]
        );
        assert_eq!(files(&full)[2].1, "#cloud-config\npackages: [htop]\n");
        let off = BareEntry {
            config_drive: false,
            ..entry()
        };
        assert!(files(&off).is_empty());
        let refused = |e: BareEntry| e.validate().unwrap_err().to_string();
        let no_drive = refused(BareEntry {
            user_data: Some("x".into()),
            ..off
        });
        assert!(
            no_drive.contains("Bare.UserData") && no_drive.contains("ConfigDrive"),
            "{no_drive}"
        );
        let huge = refused(BareEntry {
            user_data: Some("x".repeat(MAX_USER_DATA_BYTES + 1)),
            ..entry()
        });
        assert!(huge.contains("65535"), "{huge}");
    }
}
