//! The parts of the Equinix Metal API's JSON that Shepherd reads and writes (field names as the
//! API spells them; unknown fields are ignored, as the API adds fields over time).

use serde::{Deserialize, Serialize};

/// A reference to another object (`{"id": …, "href": …}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Ref {
    /// The object's id, when the API includes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The object's path, e.g. `/metal/v1/hardware-reservations/…`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub href: Option<String>,
}

impl Ref {
    /// The id, or the last path segment of the href.
    pub fn id(&self) -> Option<&str> {
        self.id
            .as_deref()
            .or_else(|| self.href.as_deref().and_then(|h| h.rsplit('/').next()))
            .filter(|s| !s.is_empty())
    }
}

/// A named place (`{"code": "da11"}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Place {
    /// Short code.
    #[serde(default)]
    pub code: String,
}

/// One address of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpAddress {
    /// The address, without prefix length.
    pub address: String,
    /// 4 or 6.
    pub address_family: u8,
    /// Reachable from the internet.
    #[serde(default)]
    pub public: bool,
}

/// A device (a server).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// Device id (a UUID).
    pub id: String,
    /// Hostname; ours start with the configured prefix.
    #[serde(default)]
    pub hostname: String,
    /// `queued`, `provisioning`, `active`, `failed`, `inactive`, …
    #[serde(default)]
    pub state: String,
    /// Its addresses.
    #[serde(default)]
    pub ip_addresses: Vec<IpAddress>,
    /// The hardware reservation it was created from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware_reservation: Option<Ref>,
    /// Metro it is in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metro: Option<Place>,
    /// Facility it is in (older API responses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facility: Option<Place>,
}

impl Device {
    /// First public IPv4 address, else first public IPv6 (design.md §14).
    pub fn address(&self) -> Option<String> {
        let public = |family| {
            self.ip_addresses
                .iter()
                .find(|a| a.public && a.address_family == family)
                .map(|a| a.address.clone())
        };
        public(4).or_else(|| public(6))
    }

    /// Metro code, else facility code.
    pub fn location(&self) -> Option<String> {
        self.metro
            .as_ref()
            .or(self.facility.as_ref())
            .map(|p| p.code.clone())
            .filter(|c| !c.is_empty())
    }
}

/// A device plan (`{"slug": "c3.small.x86"}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Plan {
    /// Plan slug.
    #[serde(default)]
    pub slug: String,
}

/// A hardware reservation: capacity that becomes a device when one is created from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// Reservation id.
    pub id: String,
    /// A device can be created from it now.
    #[serde(default)]
    pub provisionable: bool,
    /// The device created from it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<Ref>,
    /// The plan of devices created from it.
    #[serde(default)]
    pub plan: Plan,
    /// Where it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facility: Option<Place>,
}

/// A project SSH key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SshKey {
    /// Key id.
    pub id: String,
    /// Label; ours is configured.
    #[serde(default)]
    pub label: String,
    /// OpenSSH public key line.
    #[serde(default)]
    pub key: String,
}

/// Paging metadata of list responses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Meta {
    /// Link to the next page, absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<Ref>,
    /// Current page, counting from 1.
    #[serde(default)]
    pub current_page: Option<u32>,
    /// Last page.
    #[serde(default)]
    pub last_page: Option<u32>,
    /// Objects in all pages.
    #[serde(default)]
    pub total: Option<u64>,
}

/// `GET /projects/{id}/devices`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceList {
    /// This page.
    pub devices: Vec<Device>,
    /// Paging.
    #[serde(default)]
    pub meta: Meta,
}

/// `GET /projects/{id}/hardware-reservations`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReservationList {
    /// This page.
    pub hardware_reservations: Vec<Reservation>,
    /// Paging.
    #[serde(default)]
    pub meta: Meta,
}

/// `GET /projects/{id}/ssh-keys`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SshKeyList {
    /// Every key of the project.
    pub ssh_keys: Vec<SshKey>,
}

/// `POST /projects/{id}/devices`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceCreate {
    /// Hostname (our prefix + the first 18 characters of the reservation id).
    pub hostname: String,
    /// Plan slug of the reservation.
    pub plan: String,
    /// Operating system slug.
    pub operating_system: String,
    /// The reservation to create it from.
    pub hardware_reservation_id: String,
    /// Project SSH keys to install.
    pub project_ssh_keys: Vec<String>,
}

/// `POST/PUT …/ssh-keys`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SshKeyInput {
    /// Label.
    pub label: String,
    /// OpenSSH public key line.
    pub key: String,
}

/// `POST /devices/{id}/actions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Action {
    /// `reboot`, `power_on`, …
    #[serde(rename = "type")]
    pub kind: String,
}
