//! The Equinix Metal provider (design.md §14). Our devices are those whose hostname starts with the
//! configured prefix; free capacity is the project's provisionable hardware reservations.
//!
//! Devices with our prefix are listed as *possibly used*: the BMDB decides. One it does not
//! know is an orphan (created, but its BMDB insert never committed), and the provisioner's
//! next iteration adopts it through [`Provider::create_machine`] instead of creating another.
//! After an ambiguous failure of the creation POST the provider looks for a device of the
//! reservation's hostname, so an answer lost on the way back never leads to a second device.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use shepherd_bmdb::{Lease, ProviderKind, ProviderStatus, Session};
use shepherd_provider::penalty::PenaltyBox;
use shepherd_provider::settings::InvalidSetting;
use shepherd_provider::{
    record_new_machine, ApiFailure, Availability, Provider, ProviderError, ProviderMachine,
    Rebooter, Recorded,
};

use crate::client::{ApiError, Client};
use crate::model::*;

/// Characters of the reservation id appended to the prefix to make a hostname (upstream's rule).
const RESERVATION_ID_CHARS: usize = 18;

/// Provider settings (design.md §14, §17).
#[derive(Debug, Clone)]
pub struct EquinixConfig {
    /// Hostname prefix of devices we own.
    pub device_prefix: String,
    /// Operating system slug of new devices.
    pub os: String,
    /// Label of our project SSH key.
    pub ssh_key_label: String,
    /// Our SSH public key (OpenSSH line), ensured as the project key at start-up.
    pub ssh_public_key: String,
    /// How long a reservation listing is reused (the call is slow).
    pub reservation_cache: Duration,
    /// How long a reservation whose device creation failed is skipped.
    pub reservation_penalty: Duration,
    /// How long a rebooted device is given before the initializer takes it over again.
    pub reboot_wait: Duration,
}

impl EquinixConfig {
    /// Defaults for everything but the key and prefix.
    pub fn new(device_prefix: &str, ssh_public_key: &str) -> Self {
        EquinixConfig {
            device_prefix: device_prefix.into(),
            os: "ubuntu_20_04".into(),
            ssh_key_label: "shepherd".into(),
            ssh_public_key: ssh_public_key.trim().into(),
            reservation_cache: Duration::from_secs(5 * 60),
            reservation_penalty: Duration::from_secs(60 * 60),
            reboot_wait: Duration::from_secs(30),
        }
    }

    fn validate(&self) -> Result<(), InvalidSetting> {
        if self.device_prefix.is_empty() {
            return Err(InvalidSetting::new(
                "equinix-device-prefix",
                "must not be empty (it decides which devices are ours)",
            ));
        }
        if self.os.is_empty() {
            return Err(InvalidSetting::new("equinix-os", "must not be empty"));
        }
        if self.ssh_key_label.is_empty() {
            return Err(InvalidSetting::new(
                "equinix-ssh-key-label",
                "must not be empty",
            ));
        }
        if !self.ssh_public_key.starts_with("ssh-") {
            return Err(InvalidSetting::new(
                "the SSH public key",
                "is not an OpenSSH public key line",
            ));
        }
        Ok(())
    }
}

/// The provider. Safe to call concurrently: the provisioner creates several machines at once
/// with `--provisioner-parallelism`, while the machine loops look machines up.
pub struct EquinixProvider {
    client: Client,
    config: EquinixConfig,
    ssh_key_id: String,
    reservations: Mutex<Option<(Instant, Vec<Reservation>)>>,
    penalty: PenaltyBox<String>,
}

/// `e` as the provider's error: unavailable for a transport failure, a 5xx or a 429 (after
/// the client's retries), else the API's answer.
fn api(e: ApiError) -> ProviderError {
    let unavailable = match &e {
        ApiError::Transport(_) => true,
        ApiError::Status { status, .. } => {
            status.is_server_error() || *status == reqwest::StatusCode::TOO_MANY_REQUESTS
        }
        ApiError::NotFound | ApiError::Decode(_) => false,
    };
    match unavailable {
        true => ProviderError::Unavailable(ApiFailure::new(e)),
        false => ProviderError::Api(ApiFailure::new(e)),
    }
}

/// Why the provider could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A setting is wrong.
    #[error(transparent)]
    Setting(#[from] InvalidSetting),
    /// Our project SSH key could not be found, updated or created.
    #[error("{step} the project SSH key: {error}")]
    SshKey {
        /// What was being done (`listing`, `updating`, `creating`).
        step: &'static str,
        /// What the API said.
        error: ApiError,
    },
}

/// A device could not be created from a reservation, which is skipped for a while.
#[derive(Debug, thiserror::Error)]
#[error("creating a device from reservation {reservation}: {error} (reservation skipped for {skipped_for:?})")]
pub struct CreationFailed {
    /// The reservation.
    pub reservation: String,
    /// What the API said.
    pub error: ApiError,
    /// How long the reservation is skipped.
    pub skipped_for: Duration,
}

/// Maps an Equinix device state to the BMDB's provider status.
pub fn status_of(state: &str) -> ProviderStatus {
    match state {
        "active" => ProviderStatus::Running,
        "queued" | "provisioning" | "deploying" | "reinstalling" => ProviderStatus::Provisioning,
        "failed" => ProviderStatus::ProvisioningFailedPermanent,
        "inactive" | "powering_off" | "powering_on" => ProviderStatus::Stopped,
        _ => ProviderStatus::Unknown,
    }
}

impl EquinixProvider {
    /// Checks the settings and ensures our project SSH key (created, or updated if its key
    /// changed).
    pub async fn connect(client: Client, config: EquinixConfig) -> Result<Self, ConnectError> {
        config.validate()?;
        let ssh_key_id =
            ensure_ssh_key(&client, &config.ssh_key_label, &config.ssh_public_key).await?;
        let penalty = PenaltyBox::new(config.reservation_penalty);
        Ok(EquinixProvider {
            client,
            config,
            ssh_key_id,
            reservations: Mutex::new(None),
            penalty,
        })
    }

    /// The id of our project SSH key.
    pub fn ssh_key_id(&self) -> &str {
        &self.ssh_key_id
    }

    fn ours(&self, d: &Device) -> bool {
        d.hostname.starts_with(&self.config.device_prefix)
    }

    fn hostname_for(&self, reservation: &str) -> String {
        let short: String = reservation.chars().take(RESERVATION_ID_CHARS).collect();
        format!("{}{short}", self.config.device_prefix)
    }

    fn machine(d: &Device, availability: Availability) -> ProviderMachine {
        let mut m = ProviderMachine::new(d.id.clone(), d.address(), availability);
        m.failed = d.state == "failed";
        m.cause = m
            .failed
            .then(|| format!("Equinix device {} is in state failed", d.id));
        m.location = d.location();
        m.status = Some(status_of(&d.state));
        m.reservation = d
            .hardware_reservation
            .as_ref()
            .and_then(|r| r.id())
            .map(String::from);
        m
    }

    async fn reservations(&self) -> Result<Vec<Reservation>, ApiError> {
        if let Some((at, list)) = &*self.reservations.lock().unwrap() {
            if at.elapsed() < self.config.reservation_cache {
                return Ok(list.clone());
            }
        }
        let list = self.client.list_reservations().await?;
        *self.reservations.lock().unwrap() = Some((Instant::now(), list.clone()));
        Ok(list)
    }

    /// Forgets a reservation in the cached listing (a device now exists for it).
    fn consume_reservation(&self, id: &str) {
        if let Some((_, list)) = &mut *self.reservations.lock().unwrap() {
            list.retain(|r| r.id != id);
        }
    }

    async fn device_named(&self, hostname: &str) -> Result<Option<Device>, ApiError> {
        Ok(self
            .client
            .list_devices()
            .await?
            .into_iter()
            .find(|d| d.hostname == hostname))
    }

    /// Creates the device for `reservation`. One an earlier attempt created is not looked for
    /// first: the listing that offered this reservation excludes reservations with devices.
    async fn create_device(&self, reservation: &Reservation) -> Result<Device, ProviderError> {
        let hostname = self.hostname_for(&reservation.id);
        let request = DeviceCreate {
            hostname: hostname.clone(),
            plan: reservation.plan.slug.clone(),
            operating_system: self.config.os.clone(),
            hardware_reservation_id: reservation.id.clone(),
            project_ssh_keys: vec![self.ssh_key_id.clone()],
        };
        match self.client.create_device(&request).await {
            Ok(d) => Ok(d),
            Err(e) => {
                // The device may exist although the answer was an error: after an ambiguous
                // failure (the answer lost, a 5xx) it is ours to adopt; after a refusal (422)
                // another replica created it first, and records it. Look (with retries)
                // before giving up on this reservation.
                if e.retryable() || e.refused() {
                    if let Ok(Some(d)) = self.device_named(&hostname).await {
                        if e.refused() {
                            return Err(ProviderError::Taken(format!(
                                "reservation {}: device {} was created by another replica first",
                                reservation.id, d.id
                            )));
                        }
                        tracing::warn!(hostname, device = d.id, error = %e, "device creation answered with an error but the device exists; adopting it");
                        return Ok(d);
                    }
                }
                self.penalty.penalize(reservation.id.clone());
                Err(ProviderError::Api(ApiFailure::new(CreationFailed {
                    reservation: reservation.id.clone(),
                    error: e,
                    skipped_for: self.config.reservation_penalty,
                })))
            }
        }
    }
}

/// Finds our project SSH key by label and makes its key ours; returns its id.
pub async fn ensure_ssh_key(
    client: &Client,
    label: &str,
    key: &str,
) -> Result<String, ConnectError> {
    let input = SshKeyInput {
        label: label.into(),
        key: key.into(),
    };
    let failed = |step| move |error| ConnectError::SshKey { step, error };
    let keys = client.list_ssh_keys().await.map_err(failed("listing"))?;
    match keys.into_iter().find(|k| k.label == label) {
        Some(k) if k.key.trim() == key => Ok(k.id),
        Some(k) => {
            tracing::info!(label, id = k.id, "updating the project SSH key");
            Ok(client
                .update_ssh_key(&k.id, &input)
                .await
                .map_err(failed("updating"))?
                .id)
        }
        None => {
            tracing::info!(label, "creating the project SSH key");
            match client.create_ssh_key(&input).await {
                Ok(k) => Ok(k.id),
                // The POST may have succeeded without our hearing: look once more.
                Err(e) => client
                    .list_ssh_keys()
                    .await
                    .ok()
                    .and_then(|keys| keys.into_iter().find(|k| k.label == label))
                    .map(|k| k.id)
                    .ok_or(ConnectError::SshKey {
                        step: "creating",
                        error: e,
                    }),
            }
        }
    }
}

#[async_trait]
impl Provider for EquinixProvider {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Equinix
    }

    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        let devices = self.client.list_devices().await.map_err(api)?;
        let reservations = self.reservations().await.map_err(api)?;
        let mut out: Vec<ProviderMachine> = devices
            .iter()
            .filter(|d| self.ours(d))
            .map(|d| Self::machine(d, Availability::PossiblyUsed))
            .collect();
        // A reservation whose device exists (in this listing, or per the reservation) is used.
        let used: std::collections::BTreeSet<&str> = devices
            .iter()
            .filter_map(|d| d.hardware_reservation.as_ref().and_then(|r| r.id()))
            .collect();
        for r in reservations {
            if !r.provisionable
                || r.device.is_some()
                || used.contains(r.id.as_str())
                || self.penalty.is_penalized(&r.id)
            {
                continue;
            }
            let mut m = ProviderMachine {
                id: None,
                addr: None,
                availability: Availability::KnownUnused,
                failed: false,
                cause: None,
                location: r.facility.as_ref().map(|f| f.code.clone()),
                status: None,
                reservation: Some(r.id.clone()),
                facts: Default::default(),
            };
            m.location = m.location.filter(|l| !l.is_empty());
            out.push(m);
        }
        Ok(out)
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        match self.client.get_device(id).await {
            Ok(d) if self.ours(&d) => Ok(Self::machine(&d, Availability::KnownUsed)),
            Ok(_) | Err(ApiError::NotFound) => Err(ProviderError::NotFound(id.to_string())),
            Err(e) => Err(api(e)),
        }
    }

    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        let device = if unused.valid_id().is_some() {
            // An orphan: the device exists, the BMDB does not know it yet.
            tracing::warn!(
                device = unused.id.as_deref(),
                "adopting a device of ours the BMDB does not know"
            );
            unused.clone()
        } else {
            let reservation_id = unused
                .reservation
                .as_deref()
                .ok_or(ProviderError::Incomplete(
                    "a reservation of the unused machine",
                ))?;
            let reservation = self
                .reservations()
                .await
                .map_err(api)?
                .into_iter()
                .find(|r| r.id == reservation_id)
                .unwrap_or_else(|| Reservation {
                    id: reservation_id.to_string(),
                    provisionable: true,
                    device: None,
                    plan: Plan::default(),
                    facility: None,
                });
            // Listing reservations may have outlasted the lease: create nothing then.
            session.lease().may_start("create device")?;
            let d = self.create_device(&reservation).await?;
            self.consume_reservation(&reservation.id);
            let mut m = Self::machine(&d, Availability::KnownUsed);
            m.reservation = Some(reservation.id.clone());
            m
        };
        // If this insert fails the device is an orphan until the next iteration adopts it.
        Ok(record_new_machine(session, ProviderKind::Equinix, &device).await?)
    }
}

#[async_trait]
impl Rebooter for EquinixProvider {
    async fn reboot(&self, lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError> {
        let id = machine.required_id()?;
        lease.may_start("reset")?;
        self.client.reboot(id).await.map_err(|e| match e {
            ApiError::NotFound => ProviderError::NotFound(id.to_string()),
            e => api(e),
        })?;
        Ok(())
    }

    fn reboot_wait(&self) -> Duration {
        self.config.reboot_wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_map_to_statuses() {
        assert_eq!(status_of("active"), ProviderStatus::Running);
        assert_eq!(status_of("provisioning"), ProviderStatus::Provisioning);
        assert_eq!(
            status_of("failed"),
            ProviderStatus::ProvisioningFailedPermanent
        );
        assert_eq!(status_of("inactive"), ProviderStatus::Stopped);
        assert_eq!(status_of("weird"), ProviderStatus::Unknown);
    }

    #[test]
    fn addresses_prefer_public_ipv4() {
        let ip = |a: &str, f, p| IpAddress {
            address: a.into(),
            address_family: f,
            public: p,
        };
        let mut d = Device {
            id: "d".into(),
            hostname: "h".into(),
            state: "active".into(),
            ip_addresses: vec![ip("10.0.0.1", 4, false), ip("2001:db8::1", 6, true)],
            hardware_reservation: None,
            metro: None,
            facility: Some(Place {
                code: "da11".into(),
            }),
        };
        assert_eq!(d.address().as_deref(), Some("2001:db8::1"));
        d.ip_addresses.push(ip("147.75.1.2", 4, true));
        assert_eq!(d.address().as_deref(), Some("147.75.1.2"));
        assert_eq!(d.location().as_deref(), Some("da11"));
    }
}
