//! The static provider (SPEC §6): a JSON inventory `[{"ID", "Addr", "Location", "BMC"}]` read from a
//! `file://` or `http(s)://` URL. Whether a listed machine is ours is decided by the BMDB
//! (availability PossiblyUsed). The inventory is read on every listing, so an operator's edit
//! takes effect at the next reconciliation.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{bail, Context};
use async_trait::async_trait;
use serde::Deserialize;
use shepherd_bmdb::{Provider as ProviderKind, ProviderStatus, Session, MAX_PROVIDER_ID_LEN};
use uuid::Uuid;

use crate::provider::{
    record_new_machine, Availability, Provider, ProviderError, ProviderMachine, Recoverer,
};
use crate::redfish::{Bmc, BmcEntry};

/// Largest inventory accepted.
pub const MAX_INVENTORY_BYTES: usize = 16 << 20;

/// One inventory entry, exactly as written in the file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InventoryEntry {
    /// Stable, unique id of the machine within this inventory.
    #[serde(rename = "ID")]
    pub id: String,
    /// Address reachable over SSH.
    #[serde(rename = "Addr")]
    pub addr: String,
    /// Free-form location.
    #[serde(rename = "Location", default)]
    pub location: Option<String>,
    /// The machine's BMC, for power control by the recoverer (Redfish).
    #[serde(rename = "BMC", default)]
    pub bmc: Option<BmcEntry>,
}

/// Parses and validates an inventory: every entry needs a non-empty id of at most 128 bytes,
/// unique, and a non-empty address.
pub fn parse_inventory(bytes: &[u8]) -> anyhow::Result<Vec<InventoryEntry>> {
    if bytes.len() > MAX_INVENTORY_BYTES {
        bail!(
            "inventory is {} bytes, more than the {MAX_INVENTORY_BYTES} allowed",
            bytes.len()
        );
    }
    let entries: Vec<InventoryEntry> = serde_json::from_slice(bytes)
        .context("inventory is not a valid JSON list of {\"ID\", \"Addr\", \"Location\"}")?;
    let mut seen = BTreeSet::new();
    for (i, e) in entries.iter().enumerate() {
        if e.id.is_empty() || e.id.len() > MAX_PROVIDER_ID_LEN {
            bail!("inventory entry {i}: ID must be 1..={MAX_PROVIDER_ID_LEN} bytes");
        }
        if e.addr.trim().is_empty() {
            bail!("inventory entry {i} ({}): Addr is empty", e.id);
        }
        if !seen.insert(e.id.as_str()) {
            bail!("inventory entry {i}: duplicate ID {:?}", e.id);
        }
        if let Some(b) = &e.bmc {
            b.validate()
                .with_context(|| format!("inventory entry {i} ({})", e.id))?;
        }
    }
    Ok(entries)
}

/// A provider backed by a static inventory.
pub struct StaticProvider {
    url: url::Url,
    kind: ProviderKind,
    http: reqwest::Client,
    bmc_timeout: Duration,
    reboot_wait: Duration,
}

impl StaticProvider {
    /// A provider reading `url` (`file://` or `http(s)://`) and recording machines as `kind`.
    pub fn new(url: &str, kind: ProviderKind) -> anyhow::Result<Self> {
        let url = url::Url::parse(url).with_context(|| format!("inventory URL {url:?}"))?;
        if !matches!(url.scheme(), "file" | "http" | "https") {
            bail!(
                "inventory URL must be file://, http:// or https://, not {}://",
                url.scheme()
            );
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?;
        Ok(StaticProvider {
            url,
            kind,
            http,
            bmc_timeout: Duration::from_secs(30),
            reboot_wait: Duration::ZERO,
        })
    }

    /// How long BMC requests may take, and how long a reboot is given to take effect before the
    /// recoverer goes on.
    pub fn with_bmc_timing(mut self, timeout: Duration, reboot_wait: Duration) -> Self {
        self.bmc_timeout = timeout;
        self.reboot_wait = reboot_wait;
        self
    }

    /// Whether any entry of the current inventory names a BMC (the recoverer has work only then).
    pub async fn has_bmcs(&self) -> anyhow::Result<bool> {
        Ok(self.inventory().await?.iter().any(|e| e.bmc.is_some()))
    }

    async fn fetch(&self) -> anyhow::Result<Vec<u8>> {
        if self.url.scheme() == "file" {
            let path = self
                .url
                .to_file_path()
                .map_err(|_| anyhow::anyhow!("bad file URL {}", self.url))?;
            let len = tokio::fs::metadata(&path)
                .await
                .with_context(|| format!("reading {}", path.display()))?
                .len();
            if len > MAX_INVENTORY_BYTES as u64 {
                bail!(
                    "inventory {} is {len} bytes, more than the {MAX_INVENTORY_BYTES} allowed",
                    path.display()
                );
            }
            return tokio::fs::read(&path)
                .await
                .with_context(|| format!("reading {}", path.display()));
        }
        let mut resp = self
            .http
            .get(self.url.clone())
            .send()
            .await?
            .error_for_status()?;
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await? {
            if body.len() + chunk.len() > MAX_INVENTORY_BYTES {
                bail!(
                    "inventory at {} is larger than the {MAX_INVENTORY_BYTES} bytes allowed",
                    self.url
                );
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// The current inventory.
    pub async fn inventory(&self) -> anyhow::Result<Vec<InventoryEntry>> {
        parse_inventory(&self.fetch().await?).with_context(|| format!("inventory {}", self.url))
    }

    fn to_machine(e: InventoryEntry) -> ProviderMachine {
        ProviderMachine {
            id: Some(e.id),
            addr: Some(e.addr),
            availability: Availability::PossiblyUsed,
            failed: false,
            location: e.location,
            status: Some(ProviderStatus::Running),
            reservation: None,
        }
    }
}

#[async_trait]
impl Provider for StaticProvider {
    fn kind(&self) -> ProviderKind {
        self.kind
    }

    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        Ok(self
            .inventory()
            .await?
            .into_iter()
            .map(Self::to_machine)
            .collect())
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        self.inventory()
            .await?
            .into_iter()
            .find(|e| e.id == id)
            .map(Self::to_machine)
            .ok_or_else(|| ProviderError::NotFound(id.to_string()))
    }

    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Uuid, ProviderError> {
        Ok(record_new_machine(session, self.kind, unused).await?)
    }
}

#[async_trait]
impl Recoverer for StaticProvider {
    /// Power-cycles the machine through the BMC its inventory entry names.
    async fn reboot(&self, machine: &ProviderMachine) -> Result<(), ProviderError> {
        let id = machine
            .valid_id()
            .ok_or_else(|| ProviderError::Other(anyhow::anyhow!("machine without an id")))?;
        let entry = self
            .inventory()
            .await?
            .into_iter()
            .find(|e| e.id == id)
            .ok_or_else(|| ProviderError::NotFound(id.to_string()))?;
        let bmc = entry.bmc.ok_or(ProviderError::NotSupported(
            "reboot: the inventory entry names no BMC",
        ))?;
        let reset = Bmc::new(&bmc, self.bmc_timeout)?.reset().await?;
        tracing::info!(
            provider_id = id,
            bmc = bmc.url,
            reset,
            "power-cycled through the BMC"
        );
        tokio::time::sleep(self.reboot_wait).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_parsing() {
        let good = br#"[{"ID": "m1", "Addr": "10.0.0.1", "Location": "rack-1"}, {"ID": "m2", "Addr": "10.0.0.2"}]"#;
        let inv = parse_inventory(good).unwrap();
        assert_eq!(inv.len(), 2);
        assert_eq!(inv[1].location, None);
        for (bad, why) in [
            (
                &br#"[{"ID": "m1", "Addr": "a", "Rack": "x"}]"#[..],
                "unknown field `Rack`",
            ),
            (br#"[{"ID": "m1"}]"#, "missing field `Addr`"),
            (br#"[{"ID": "", "Addr": "a"}]"#, "ID must be"),
            (br#"[{"ID": "m1", "Addr": " "}]"#, "Addr is empty"),
            (
                br#"[{"ID": "m1", "Addr": "a"}, {"ID": "m1", "Addr": "b"}]"#,
                "duplicate ID \"m1\"",
            ),
            (br#"{"ID": "m1", "Addr": "a"}"#, "valid JSON list"),
            (b"not json", "valid JSON list"),
        ] {
            let e = format!("{:#}", parse_inventory(bad).unwrap_err());
            assert!(e.contains(why), "{}: {e}", String::from_utf8_lossy(bad));
        }
        let long = format!(r#"[{{"ID": "{}", "Addr": "a"}}]"#, "x".repeat(129));
        assert!(parse_inventory(long.as_bytes()).is_err());
        assert!(parse_inventory(&vec![b' '; MAX_INVENTORY_BYTES + 1]).is_err());
    }

    #[test]
    fn only_file_and_http_urls() {
        assert!(
            StaticProvider::new("file:///etc/shepherd/inventory.json", ProviderKind::Static)
                .is_ok()
        );
        assert!(
            StaticProvider::new("https://inventory.example/list.json", ProviderKind::Static)
                .is_ok()
        );
        let e = StaticProvider::new("ftp://x/y", ProviderKind::Static)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("file://, http:// or https://"), "{e}");
        assert!(StaticProvider::new("inventory.json", ProviderKind::Static).is_err());
    }
}
