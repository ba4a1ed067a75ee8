//! A network interface's supported link speeds, from the kernel's ethtool interface
//! (`SIOCETHTOOL` with `ETHTOOL_GLINKSETTINGS`), as upstream's agent reports them. sysfs has
//! only the current speed. Interfaces without link modes (virtio, veth) report none.

/// `ETHTOOL_GLINKSETTINGS`.
const GLINKSETTINGS: u32 = 0x4c;

/// Most 32-bit words of one link-mode mask the kernel may ask for (it uses 3 today).
const MAX_MASK_WORDS: usize = 127;

/// `struct ethtool_link_settings` followed by room for its three link-mode masks.
#[repr(C)]
struct LinkSettings {
    cmd: u32,
    speed: u32,
    duplex: u8,
    port: u8,
    phy_address: u8,
    autoneg: u8,
    mdio_support: u8,
    eth_tp_mdix: u8,
    eth_tp_mdix_ctrl: u8,
    link_mode_masks_nwords: i8,
    transceiver: u8,
    master_slave_cfg: u8,
    master_slave_state: u8,
    rate_matching: u8,
    reserved: [u32; 7],
    masks: [u32; 3 * MAX_MASK_WORDS],
}

/// Link speed in Mbit/s of each `ETHTOOL_LINK_MODE_*_BIT` that is a speed (pause, FEC and
/// port bits are 0), up to bit 48 (5000baseT); higher modes are 25 G and more and are listed
/// in `HIGHER_MODES`.
const MODE_MBPS: [u32; 49] = [
    10, 10, 100, 100, 1000, 1000, 0, 0, 0, 0, 0, 0, 10_000, 0, 0, 2500, 0, 1000, 10_000, 10_000, 0,
    20_000, 20_000, 40_000, 40_000, 40_000, 40_000, 56_000, 56_000, 56_000, 56_000, 25_000, 25_000,
    25_000, 50_000, 50_000, 100_000, 100_000, 100_000, 100_000, 50_000, 1000, 10_000, 10_000,
    10_000, 10_000, 10_000, 2500, 5000,
];

/// Link modes after bit 48 that are speeds: (bit, Mbit/s).
const HIGHER_MODES: &[(usize, u32)] = &[
    (52, 50_000),
    (53, 50_000),
    (54, 50_000),
    (55, 50_000),
    (56, 50_000),
    (57, 100_000),
    (58, 100_000),
    (59, 100_000),
    (60, 100_000),
    (61, 100_000),
    (62, 200_000),
    (63, 200_000),
    (64, 200_000),
    (65, 200_000),
    (66, 200_000),
    (67, 100),
    (68, 1000),
    (69, 400_000),
    (70, 400_000),
    (71, 400_000),
    (72, 400_000),
    (73, 400_000),
];

/// The distinct speeds of a supported-link-modes mask, in bytes per second, slowest first.
pub fn speeds_of(mask: &[u32]) -> Vec<i64> {
    let set = |bit: usize| {
        mask.get(bit / 32)
            .is_some_and(|w| w & (1 << (bit % 32)) != 0)
    };
    let mut mbps: Vec<u32> = MODE_MBPS
        .iter()
        .enumerate()
        .filter(|(bit, speed)| **speed > 0 && set(*bit))
        .map(|(_, speed)| *speed)
        .chain(
            HIGHER_MODES
                .iter()
                .filter(|(bit, _)| set(*bit))
                .map(|(_, speed)| *speed),
        )
        .collect();
    mbps.sort_unstable();
    mbps.dedup();
    mbps.into_iter()
        .map(|m| i64::from(m) * 1_000_000 / 8)
        .collect()
}

/// The supported speeds of interface `name` in bytes per second; empty when the kernel has no
/// link modes for it or the call fails.
pub fn supported_speeds(name: &str) -> Vec<i64> {
    supported_mask(name).map_or_else(Vec::new, |m| speeds_of(&m))
}

/// The supported-link-modes mask of `name`: the kernel first answers how many words a mask
/// has (as a negative count), then fills them.
fn supported_mask(name: &str) -> Option<Vec<u32>> {
    if name.len() >= libc::IFNAMSIZ {
        return None;
    }
    // SAFETY: a datagram socket only to address the ioctl; closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    let mut settings = LinkSettings {
        cmd: GLINKSETTINGS,
        speed: 0,
        duplex: 0,
        port: 0,
        phy_address: 0,
        autoneg: 0,
        mdio_support: 0,
        eth_tp_mdix: 0,
        eth_tp_mdix_ctrl: 0,
        link_mode_masks_nwords: 0,
        transceiver: 0,
        master_slave_cfg: 0,
        master_slave_state: 0,
        rate_matching: 0,
        reserved: [0; 7],
        masks: [0; 3 * MAX_MASK_WORDS],
    };
    let call = |settings: &mut LinkSettings| {
        // SAFETY: ifreq is plain data; its name is NUL-terminated (checked length above) and
        // its data pointer points at `settings`, which outlives the call and is large enough
        // for the header and three masks of the word count we pass.
        unsafe {
            let mut req: libc::ifreq = std::mem::zeroed();
            for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
                *dst = src as libc::c_char;
            }
            req.ifr_ifru.ifru_data = (settings as *mut LinkSettings).cast();
            libc::ioctl(fd, libc::SIOCETHTOOL as _, &mut req) == 0
        }
    };
    let mut mask = None;
    if call(&mut settings) && settings.link_mode_masks_nwords < 0 {
        let words = settings.link_mode_masks_nwords.unsigned_abs() as usize;
        if words <= MAX_MASK_WORDS {
            settings.cmd = GLINKSETTINGS;
            settings.link_mode_masks_nwords = words as i8;
            if call(&mut settings) {
                mask = Some(settings.masks[..words].to_vec());
            }
        }
    }
    // SAFETY: fd is ours and open.
    unsafe { libc::close(fd) };
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    const GBIT: i64 = 125_000_000;

    #[test]
    fn masks_become_distinct_speeds() {
        // An Intel X710: 1000baseT_Full (5), 10000baseT_Full (12), 1000baseKX (17),
        // 10000baseKR (19), plus autoneg (6) and pause (13), which are no speeds.
        let x710 = [
            1 << 5 | 1 << 6 | 1 << 12 | 1 << 13 | 1 << 17 | 1 << 19,
            0,
            0,
        ];
        assert_eq!(speeds_of(&x710), [GBIT, 10 * GBIT]);
        // A ConnectX-5: 25000baseCR (31), 25000baseSR (33), 100000baseCR4 (38).
        let cx5 = [1 << 31, 1 << 1 | 1 << 6, 0];
        assert_eq!(speeds_of(&cx5), [25 * GBIT, 100 * GBIT]);
        // 200000baseCR4 is bit 66, in the third word.
        assert_eq!(speeds_of(&[0, 0, 1 << 2]), [200 * GBIT]);
        assert!(speeds_of(&[]).is_empty());
    }

    #[test]
    fn interfaces_without_link_modes_have_no_speeds() {
        assert!(supported_speeds("lo").is_empty());
        assert!(supported_speeds("no-such-interface0").is_empty());
        assert!(supported_speeds(&"x".repeat(40)).is_empty());
    }
}
