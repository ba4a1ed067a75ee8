//! The NIC each static network of the installed OS's `network_data.json` is on, by its MAC.
//! cloud-init applies a static address only to a NIC that a link names by its MAC
//! (`ethernet_mac_address`), and refuses a link without one ("No mac_address or name entry"),
//! leaving the machine without its address. An inventory entry need not name the MAC: the live
//! environment put the address on one of its NICs, so before anything is written the agent
//! completes each link that names none with the MAC of the NIC that holds the link's address.

use std::net::Ipv4Addr;

/// A NIC of the live environment, with the IPv4 addresses it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// Its kernel name.
    pub name: String,
    /// Its MAC, `52:54:00:12:34:56`.
    pub mac: String,
    /// Its IPv4 addresses.
    pub addresses: Vec<Ipv4Addr>,
}

/// Why a `network_data.json` could not be completed. Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NicError {
    /// It is not JSON of the expected shape.
    #[error("the installed OS's network_data.json: {0}")]
    Malformed(String),
    /// No NIC holds the address of a link that names no MAC.
    #[error("no NIC of the live environment holds {address}, the address of the installed OS's link {link}; the NICs: {nics}; name the NIC's MAC in the entry (Bare.Network.MAC)")]
    NotHeld {
        /// The link's id.
        link: String,
        /// Its address.
        address: String,
        /// Every NIC seen, with its addresses.
        nics: String,
    },
}

/// `network_data` with a MAC on each link that named none, taken from the NIC in `nics` that
/// holds the link's address; `None` if no link needed one.
pub fn complete(network_data: &[u8], nics: &[Nic]) -> Result<Option<Vec<u8>>, NicError> {
    let malformed = |why: &str| NicError::Malformed(why.to_string());
    let mut json: serde_json::Value =
        serde_json::from_slice(network_data).map_err(|e| malformed(&e.to_string()))?;
    let networks = json["networks"].as_array().cloned().unwrap_or_default();
    let Some(links) = json["links"].as_array_mut() else {
        return Ok(None);
    };
    let mut changed = false;
    for link in links
        .iter_mut()
        .filter(|l| l["ethernet_mac_address"].is_null())
    {
        let id = link["id"]
            .as_str()
            .ok_or_else(|| malformed("a link without an id"))?;
        // The link's first address (cloud-init names a NIC once, whatever it holds).
        let address = networks
            .iter()
            .filter(|n| n["link"].as_str() == Some(id))
            .find_map(|n| n["ip_address"].as_str());
        let Some(address) = address else { continue };
        let ip: Ipv4Addr = address
            .parse()
            .map_err(|_| malformed(&format!("{address:?} is not an IPv4 address")))?;
        let Some(nic) = nics.iter().find(|n| n.addresses.contains(&ip)) else {
            return Err(NicError::NotHeld {
                link: id.to_string(),
                address: address.to_string(),
                nics: listed(nics),
            });
        };
        link["ethernet_mac_address"] = nic.mac.clone().into();
        changed = true;
    }
    Ok(changed.then(|| json.to_string().into_bytes()))
}

/// `eth0 52:54:00:12:34:56 (10.0.0.7)`, for each NIC.
fn listed(nics: &[Nic]) -> String {
    if nics.is_empty() {
        return "none".into();
    }
    let each: Vec<String> = nics
        .iter()
        .map(|n| {
            let addresses: Vec<String> = n.addresses.iter().map(ToString::to_string).collect();
            format!("{} {} ({})", n.name, n.mac, addresses.join(", "))
        })
        .collect();
    each.join("; ")
}

/// The live environment's NICs: each interface with a MAC in sysfs (`root` is `/sys/class/net`),
/// with the IPv4 addresses the kernel gives it.
pub fn live_nics(root: &std::path::Path) -> Vec<Nic> {
    let addresses = ipv4_addresses();
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut nics: Vec<Nic> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let mac = std::fs::read_to_string(entry.path().join("address")).ok()?;
            let mac = mac.trim().to_ascii_lowercase();
            (mac.len() == 17 && mac != "00:00:00:00:00:00").then(|| Nic {
                addresses: addresses
                    .iter()
                    .filter(|(n, _)| *n == name)
                    .map(|(_, a)| *a)
                    .collect(),
                name,
                mac,
            })
        })
        .collect();
    nics.sort_by(|a, b| a.name.cmp(&b.name));
    nics
}

/// Every interface's IPv4 addresses, from `getifaddrs`.
fn ipv4_addresses() -> Vec<(String, Ipv4Addr)> {
    let mut found = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills in a list it allocates; it is freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return found;
    }
    let mut at = list;
    while !at.is_null() {
        // SAFETY: `at` is an entry of the list getifaddrs made, not yet freed.
        let entry = unsafe { &*at };
        if !entry.ifa_addr.is_null() && !entry.ifa_name.is_null() {
            // SAFETY: a non-null ifa_addr points to a sockaddr whose family says its type, and
            // ifa_name to a NUL-terminated name.
            let (family, name) = unsafe {
                (
                    (*entry.ifa_addr).sa_family,
                    std::ffi::CStr::from_ptr(entry.ifa_name),
                )
            };
            if i32::from(family) == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(entry.ifa_addr as *const libc::sockaddr_in) };
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                found.push((name.to_string_lossy().into_owned(), ip));
            }
        }
        at = entry.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The installed OS's config drive as Shepherd writes it for an entry with a static
    /// network and no MAC.
    fn no_mac() -> Vec<(String, Vec<u8>)> {
        let entry = shepherd_provider::bare::BareEntry {
            network: Some(shepherd_provider::bare::BareNetwork {
                address: "10.0.0.7/24".into(),
                gateway: Some("10.0.0.1".into()),
                dns: vec!["10.0.0.2".into()],
                mac: None,
            }),
            ..serde_json::from_value(serde_json::json!({
                "ImageURL": "https://images.example/os.img", "ImageSHA256": "a".repeat(64),
                "Disk": "/dev/vda"}))
            .unwrap()
        };
        let keys = ["ssh-ed25519 AAAA shepherd".to_string()];
        shepherd_provider::bare::installed_config_drive(
            uuid::Uuid::nil(),
            "r1",
            &keys,
            "root",
            &entry,
        )
    }

    /// The live environment's NICs: MAC, name, the address it holds.
    const NICS: [(&str, &str, Option<&str>); 2] = [
        ("52:54:00:00:00:01", "eno1", None),
        ("52:54:00:00:00:02", "eno2", Some("10.0.0.7")),
    ];

    fn nics() -> Vec<Nic> {
        NICS.iter()
            .map(|(mac, name, address)| Nic {
                name: name.to_string(),
                mac: mac.to_string(),
                addresses: address.iter().map(|a| a.parse().unwrap()).collect(),
            })
            .collect()
    }

    /// The config drive `files` with its network_data.json completed for `nics`.
    fn completed(files: &[(String, Vec<u8>)], nics: &[Nic]) -> Vec<(String, Vec<u8>)> {
        files
            .iter()
            .map(
                |(path, content)| match path.ends_with("network_data.json") {
                    true => (path.clone(), complete(content, nics).unwrap().unwrap()),
                    false => (path.clone(), content.clone()),
                },
            )
            .collect()
    }

    fn network_data(files: &[(String, Vec<u8>)]) -> Vec<u8> {
        let network = files.iter().find(|(p, _)| p.ends_with("network_data.json"));
        network.unwrap().1.clone()
    }

    #[test]
    fn a_link_without_a_mac_gets_the_mac_of_the_nic_holding_its_address() {
        // cloud-init refuses the link as Shepherd wrote it: the machine would get no address.
        let macs: Vec<(&str, &str)> = NICS.iter().map(|(mac, name, _)| (*mac, *name)).collect();
        let refused = shepherd_provider::testing::cloud_init::read(&no_mac(), &macs);
        let error = refused["network_error"].as_str().unwrap_or_default();
        assert!(error.contains("No mac_address"), "{refused}");
        let read =
            shepherd_provider::testing::cloud_init::read(&completed(&no_mac(), &nics()), &macs);
        let config = &read["network"]["config"];
        assert_eq!(config[0]["type"], "physical", "{read}");
        assert_eq!(config[0]["name"], "eno2", "{read}");
        assert_eq!(config[0]["mac_address"], "52:54:00:00:00:02", "{read}");
        let subnet = &config[0]["subnets"][0];
        assert_eq!(
            (&subnet["type"], &subnet["address"], &subnet["netmask"]),
            (
                &"static".into(),
                &"10.0.0.7".into(),
                &"255.255.255.0".into()
            ),
            "{read}"
        );
        assert_eq!(subnet["routes"][0]["gateway"], "10.0.0.1", "{read}");
        assert!(read["network"].to_string().contains("10.0.0.2"), "{read}");
    }

    #[test]
    fn a_link_that_names_its_mac_or_no_address_is_left_alone() {
        let no_mac = String::from_utf8(network_data(&no_mac())).unwrap();
        let named = no_mac.replace(
            r#""type":"phy""#,
            r#""type":"phy","ethernet_mac_address":"52:54:00:00:00:01""#,
        );
        assert_eq!(complete(named.as_bytes(), &nics()), Ok(None));
        let dhcp = br#"{"links":[],"networks":[],"services":[]}"#;
        assert_eq!(complete(dhcp, &nics()), Ok(None));
    }

    #[test]
    fn an_address_no_nic_holds_fails_listing_the_nics() {
        let err = complete(&network_data(&no_mac()), &nics()[..1])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no NIC of the live environment holds 10.0.0.7")
                && err.contains("eno1 52:54:00:00:00:01 ()")
                && err.contains("Bare.Network.MAC"),
            "{err}"
        );
        assert!(complete(b"not json", &nics()).is_err());
    }

    #[test]
    fn the_live_nics_are_read_from_sysfs_with_their_addresses() {
        let dir = tempfile::tempdir().unwrap();
        for (name, mac) in [("lo", "00:00:00:00:00:00"), ("eno1", "52:54:00:AB:00:01")] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
            std::fs::write(dir.path().join(name).join("address"), format!("{mac}\n")).unwrap();
        }
        let nics = live_nics(dir.path());
        assert_eq!(nics.len(), 1, "{nics:?}");
        assert_eq!(nics[0].mac, "52:54:00:ab:00:01");
        // The loopback interface holds 127.0.0.1 on any machine: getifaddrs is read.
        assert!(ipv4_addresses().contains(&("lo".to_string(), Ipv4Addr::LOCALHOST)));
    }
}
