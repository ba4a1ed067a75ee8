//! What the bare-metal loop asks of a BMC besides a power cycle (design.md §21): its virtual CD
//! (under the system, as Redfish 1.x BMCs put it, else under the system's managers, as older
//! ones do), inserting and ejecting an image, a one-time boot override, and powering the
//! system on or off with the new state confirmed. Each call is one step the loop fences by its
//! lease; the BMC's answer is the cause when one fails.

use serde::Deserialize;

use crate::bare::BootMode;
use crate::redfish::{Bmc, BmcError, Collection, OdataId, System};

/// A system's virtual CD and what is in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualCd {
    /// Its Redfish path.
    pub path: String,
    /// The image URL it holds, if any.
    pub image: Option<String>,
    /// Whether the image is inserted, if the BMC says (`Inserted` is optional in Redfish's
    /// schema, and many BMCs leave it out).
    pub inserted: Option<bool>,
    insert: Option<String>,
    eject: Option<String>,
}

impl VirtualCd {
    /// The CD at `path`, as the BMC describes it in `media`.
    fn read(path: String, media: Media) -> VirtualCd {
        VirtualCd {
            path,
            image: media.image.filter(|i| !i.is_empty()),
            inserted: media.inserted,
            insert: media.actions.insert.map(|t| t.target),
            eject: media.actions.eject.map(|t| t.target),
        }
    }

    /// Whether it holds `url`: it names that image, and does not say it is not inserted.
    pub fn holds(&self, url: &str) -> bool {
        self.inserted != Some(false) && self.image.as_deref() == Some(url)
    }

    /// Whether it holds nothing: it names no image (or says it is not inserted), and does not
    /// say something is inserted.
    pub fn is_empty(&self) -> bool {
        match self.inserted {
            Some(inserted) => !inserted,
            None => self.image.is_none(),
        }
    }
}

/// How many times, a second apart, a CD is read back after an insert until it shows the image.
const INSERT_SHOWN_READS: u32 = 5;

/// Where the system boots from next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootTarget {
    /// Its virtual CD, once (the live environment).
    Cd,
    /// Its disk, from now on (the installed OS): every later boot, the recoverer's power
    /// cycles and a power failure's included, starts the installed OS, whatever the
    /// firmware's own order (often the network first, or the CD drive).
    Hdd,
}

/// The `BootSourceOverrideMode` to send, if any, for a boot in mode `wanted` (the entry's)
/// on a system that shows mode `shown`, and the history's words for the mode. The mode is
/// written only when it changes what the system shows, as Ironic's `sync_boot_mode` does:
/// some BMCs rebuild the firmware's setup on every write of it (sushy-tools' libvirt driver
/// replaces the loader and its variables, Secure Boot's keys among them), and one that shows
/// no mode may not take the property at all.
fn boot_mode_to_send(wanted: Option<BootMode>, shown: Option<&str>) -> (Option<BootMode>, String) {
    match (wanted, shown) {
        (Some(want), Some(now)) if now == want.redfish() => {
            (None, format!("in {want} mode, as the system is"))
        }
        (Some(want), Some(now)) => (Some(want), format!("in {want} mode, changed from {now}")),
        (Some(want), None) => (
            Some(want),
            format!("in {want} mode (the BMC showed no mode)"),
        ),
        (None, Some(now)) => (None, format!("in the system's {now} mode")),
        (None, None) => (
            None,
            "in the firmware's own mode (the BMC shows none)".to_string(),
        ),
    }
}

impl BootTarget {
    fn redfish(self) -> &'static str {
        match self {
            BootTarget::Cd => "Cd",
            BootTarget::Hdd => "Hdd",
        }
    }

    /// `BootSourceOverrideEnabled`: once for the CD, continuous for the disk.
    fn enabled(self) -> &'static str {
        match self {
            BootTarget::Cd => "Once",
            BootTarget::Hdd => "Continuous",
        }
    }
}

#[derive(Deserialize)]
struct SystemLinks {
    #[serde(rename = "VirtualMedia")]
    virtual_media: Option<OdataId>,
    #[serde(rename = "Links", default)]
    links: ManagedBy,
}

#[derive(Deserialize, Default)]
struct ManagedBy {
    #[serde(rename = "ManagedBy", default)]
    managed_by: Vec<OdataId>,
}

#[derive(Deserialize)]
struct Manager {
    #[serde(rename = "VirtualMedia")]
    virtual_media: Option<OdataId>,
}

#[derive(Deserialize)]
struct Target {
    target: String,
}

#[derive(Deserialize, Default)]
struct MediaActions {
    #[serde(rename = "#VirtualMedia.InsertMedia")]
    insert: Option<Target>,
    #[serde(rename = "#VirtualMedia.EjectMedia")]
    eject: Option<Target>,
}

#[derive(Deserialize)]
struct Media {
    #[serde(rename = "MediaTypes", default)]
    media_types: Vec<String>,
    #[serde(rename = "Image", default)]
    image: Option<String>,
    #[serde(rename = "Inserted", default)]
    inserted: Option<bool>,
    #[serde(rename = "Actions", default)]
    actions: MediaActions,
}

impl BmcError {
    /// Whether the failure is the configuration's (the inventory entry, the credentials, what
    /// the BMC offers, a request it refuses as such): trying again changes nothing until an
    /// operator does. Else it is the BMC's answer of the moment (unreachable, a timeout, a
    /// 5xx, 409 or 429), which the machine backs off on.
    pub fn is_configuration(&self) -> bool {
        if let BmcError::Status { status, .. } = self {
            return crate::redfish::lasting(*status);
        }
        matches!(
            self,
            BmcError::Entry(_)
                | BmcError::Trust(_)
                | BmcError::Client { .. }
                | BmcError::CredentialsRefused { .. }
                | BmcError::WhichSystem { .. }
                | BmcError::NoPowerCycle { .. }
                | BmcError::NoVirtualMedia { .. }
                | BmcError::NoMediaAction { .. }
                | BmcError::NoPowerChange { .. }
        )
    }
}

impl Bmc {
    /// The system's virtual CD: the first virtual media device whose media types include a
    /// CD or a DVD, under the system or else under the managers that manage it.
    pub async fn virtual_cd(&self) -> Result<VirtualCd, BmcError> {
        let system = self.system_path().await?;
        let links: SystemLinks = self.get(&system).await?;
        let mut collections: Vec<String> = links.virtual_media.map(|m| m.id).into_iter().collect();
        if collections.is_empty() {
            for manager in &links.links.managed_by {
                let manager: Manager = self.get(&manager.id).await?;
                collections.extend(manager.virtual_media.map(|m| m.id));
            }
        }
        for collection in collections {
            let devices: Collection = self.get(&collection).await?;
            for device in devices.members {
                let media: Media = self.get(&device.id).await?;
                let cd = media
                    .media_types
                    .iter()
                    .any(|t| t.eq_ignore_ascii_case("CD") || t.eq_ignore_ascii_case("DVD"));
                if cd {
                    return Ok(VirtualCd::read(device.id, media));
                }
            }
        }
        Err(BmcError::NoVirtualMedia {
            base: self.base().to_string(),
            path: system,
        })
    }

    /// Inserts the image at `url` into `cd`, write-protected (the BMC fetches it from there),
    /// then reads the CD back until it shows the image: a BMC may accept the insert and fail
    /// to fetch the image, which a boot would find out only as a live environment that never
    /// answered.
    pub async fn insert_media(&self, cd: &VirtualCd, url: &str) -> Result<(), BmcError> {
        let target = self.media_action(cd, cd.insert.as_deref(), "VirtualMedia.InsertMedia")?;
        let body = serde_json::json!({ "Image": url, "Inserted": true, "WriteProtected": true });
        self.request(reqwest::Method::POST, target, Some(body))
            .await?;
        let mut read = 1;
        loop {
            let now = VirtualCd::read(cd.path.clone(), self.get(&cd.path).await?);
            if now.holds(url) {
                return Ok(());
            }
            if read == INSERT_SHOWN_READS {
                return Err(BmcError::NotShown {
                    base: self.base().to_string(),
                    path: now.path,
                    seconds: INSERT_SHOWN_READS - 1,
                    image: now.image,
                    inserted: now.inserted,
                });
            }
            read += 1;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }

    /// Ejects whatever `cd` holds.
    pub async fn eject_media(&self, cd: &VirtualCd) -> Result<(), BmcError> {
        let target = self.media_action(cd, cd.eject.as_deref(), "VirtualMedia.EjectMedia")?;
        self.request(reqwest::Method::POST, target, Some(serde_json::json!({})))
            .await
            .map(drop)
    }

    fn media_action<'a>(
        &self,
        cd: &VirtualCd,
        target: Option<&'a str>,
        action: &'static str,
    ) -> Result<&'a str, BmcError> {
        target.ok_or_else(|| BmcError::NoMediaAction {
            base: self.base().to_string(),
            path: cd.path.clone(),
            action,
        })
    }

    /// Has the system boot from `target`: the CD at its next boot only, the disk from now on;
    /// in boot mode `mode` (the entry's) when it names one, else in the system's. Returns the
    /// mode as the history says it.
    pub async fn boot_from(
        &self,
        target: BootTarget,
        mode: Option<BootMode>,
    ) -> Result<String, BmcError> {
        let system = self.system_path().await?;
        let shown: System = self.get(&system).await?;
        let (send, said) = boot_mode_to_send(mode, shown.boot.mode.as_deref());
        let mut boot = serde_json::json!({
            "BootSourceOverrideTarget": target.redfish(),
            "BootSourceOverrideEnabled": target.enabled(),
        });
        if let Some(mode) = send {
            boot["BootSourceOverrideMode"] = mode.redfish().into();
        }
        let body = serde_json::json!({ "Boot": boot });
        self.request(reqwest::Method::PATCH, &system, Some(body))
            .await?;
        Ok(said)
    }

    /// Starts the system: powers it on if it is off (and waits until it reports On), else
    /// power-cycles it ([`Bmc::reset`]), so that it boots either way. Returns what was done.
    pub async fn power_on(&self) -> Result<&'static str, BmcError> {
        let path = self.system_path().await?;
        let system: System = self.get(&path).await?;
        if system.power_state.as_deref() != Some("Off") {
            return self.reset().await;
        }
        self.power(&path, system, "On", "On").await?;
        Ok("On")
    }

    /// Stops the system at once (`ForceOff`, waiting until it reports Off), unless it is off.
    /// Returns what was done.
    pub async fn power_off(&self) -> Result<&'static str, BmcError> {
        let path = self.system_path().await?;
        let system: System = self.get(&path).await?;
        if system.power_state.as_deref() == Some("Off") {
            return Ok("nothing: it was off");
        }
        self.power(&path, system, "ForceOff", "Off").await?;
        Ok("ForceOff")
    }

    /// Posts reset type `reset` and waits until the system reports `want`.
    async fn power(
        &self,
        path: &str,
        system: System,
        reset: &'static str,
        want: &'static str,
    ) -> Result<(), BmcError> {
        let refused = |allowed: Vec<String>| BmcError::NoPowerChange {
            base: self.base().to_string(),
            path: path.to_string(),
            want: reset,
            allowed,
        };
        let action = system.actions.reset.ok_or_else(|| refused(vec![]))?;
        if !action.allowed.is_empty() && !action.allowed.iter().any(|a| a == reset) {
            return Err(refused(action.allowed));
        }
        let body = serde_json::json!({ "ResetType": reset });
        self.request(reqwest::Method::POST, &action.target, Some(body))
            .await?;
        self.wait_for_power(path, want).await
    }
}
