//! The static provider (design.md §6): a JSON inventory `[{"ID", "Addr", "Location", "BMC"}]` read from a
//! `file://` or `http(s)://` URL. Whether a listed machine is ours is decided by the BMDB
//! (availability PossiblyUsed). Every listing checks whether the inventory changed, so an
//! operator's edit takes effect at the next reconciliation; it is parsed once per change and
//! looked up by id. A broken inventory is a start-up error; later, the last good one is kept.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{Lease, ProviderKind, ProviderStatus, Session};
use shepherd_retry::{Delays, Streak};

use crate::causes::reqwest_causes;
use crate::metrics::register_at_zero;
use crate::redfish::Bmc;
use crate::settings::InvalidSetting;
use crate::static_inventory::{
    check_local, parse_inventory, Inventory, InventoryEntry, InventoryError, InventoryProblem,
    MAX_INVENTORY_BYTES,
};
use crate::{
    record_machine, Availability, BarePlan, Provider, ProviderError, ProviderMachine, Rebooter,
    Recorded, Recording,
};

/// What identifies one version of the inventory without reading it: a file's length,
/// modification time and inode, or an HTTP validator (`ETag`, else `Last-Modified`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stamp {
    File(u64, Option<std::time::SystemTime>, u64),
    Http(reqwest::header::HeaderName, reqwest::header::HeaderValue),
    None,
}

/// The last inventory that was read and parsed successfully, and what was last wrong.
#[derive(Default)]
struct Cache {
    good: Option<(Arc<Inventory>, Stamp)>,
    checked: Option<Instant>,
    error: Option<String>,
}

/// Metrics of the inventory reads.
#[derive(Debug, Clone, Default)]
pub struct InventoryMetrics {
    reads: Family<ResultLabels, Counter>,
    stale: Gauge,
    machines: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

impl InventoryMetrics {
    /// Adds the metrics to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        register_at_zero(
            registry,
            "shepherd_inventory_reads",
            "Reads of the static inventory, by result (ok, unchanged, error)",
            &self.reads,
            ["ok", "unchanged", "error"].map(|result| ResultLabels { result }),
        );
        registry.register(
            "shepherd_inventory_stale",
            "1 while the last read of the static inventory failed and the last good one is used",
            self.stale.clone(),
        );
        registry.register(
            "shepherd_inventory_machines",
            "Machines in the last good static inventory",
            self.machines.clone(),
        );
    }

    fn read(&self, result: &'static str) {
        self.reads.get_or_create(&ResultLabels { result }).inc();
    }
}

/// Lookups reuse an inventory checked this recently; listings always check.
const LOOKUP_MAX_AGE: Duration = Duration::from_secs(5);

/// Attempts to read an http(s) inventory at start-up before giving up.
const START_ATTEMPTS: u32 = 5;

/// Waits between the first reads of an `http(s)://` inventory: from 250 ms, at most 4 s.
const START_DELAYS: Delays = Delays::new(Duration::from_millis(250), Duration::from_secs(4));

/// A provider backed by a static inventory. The inventory is read again only when it changed
/// (file length, time and inode; HTTP `ETag`/`Last-Modified`) and parsed once per change. A
/// read that fails keeps the last good inventory, logged once per distinct error.
pub struct StaticProvider {
    url: url::Url,
    kind: ProviderKind,
    http: reqwest::Client,
    bmc_timeout: Duration,
    reboot_wait: Duration,
    cache: tokio::sync::Mutex<Cache>,
    metrics: InventoryMetrics,
}

impl StaticProvider {
    /// A provider reading `url` (`file://` or `http(s)://`) and recording machines as `kind`.
    /// Nothing is read yet: see [`StaticProvider::load_at_start`].
    pub fn new(url: &str, kind: ProviderKind) -> Result<Self, InventoryError> {
        let bad_url =
            |problem: String| InvalidSetting::new(format!("inventory URL {url:?}"), problem);
        let url = url::Url::parse(url).map_err(|e| bad_url(e.to_string()))?;
        if !matches!(url.scheme(), "file" | "http" | "https") {
            return Err(bad_url(format!(
                "must be file://, http:// or https://, not {}://",
                url.scheme()
            ))
            .into());
        }
        if url.scheme() == "file" && url.to_file_path().is_err() {
            return Err(bad_url("is not a local file path".into()).into());
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| bad_url(format!("no HTTP client: {}", reqwest_causes(e))))?;
        Ok(StaticProvider {
            url,
            kind,
            http,
            bmc_timeout: Duration::from_secs(30),
            reboot_wait: Duration::ZERO,
            cache: tokio::sync::Mutex::new(Cache::default()),
            metrics: InventoryMetrics::default(),
        })
    }

    /// How long BMC requests may take, and how long a rebooted machine is given before the
    /// initializer takes it over again.
    pub fn with_bmc_timing(mut self, timeout: Duration, reboot_wait: Duration) -> Self {
        self.bmc_timeout = timeout;
        self.reboot_wait = reboot_wait;
        self
    }

    /// The metrics of this provider's inventory reads.
    pub fn metrics(&self) -> &InventoryMetrics {
        &self.metrics
    }

    /// Reads the inventory for the first time; a start-up check. A `file://` inventory gets
    /// one attempt; an `http(s)://` one a few, with jittered backoff (the server may be
    /// restarting too). The error is one line naming the URL and what is wrong.
    pub async fn load_at_start(&self) -> Result<Arc<Inventory>, InventoryError> {
        let attempts = if self.url.scheme() == "file" {
            1
        } else {
            START_ATTEMPTS
        };
        let mut failures = Streak::new(START_DELAYS);
        loop {
            match self.refresh(Duration::ZERO).await {
                Ok(inv) => return Ok(inv),
                Err(e) if failures.failures() + 1 >= attempts => {
                    return Err(if attempts > 1 {
                        InventoryError::GaveUp {
                            attempts,
                            last: Box::new(e),
                        }
                    } else {
                        e
                    });
                }
                Err(_) => tokio::time::sleep(failures.failed()).await,
            }
        }
    }

    /// Whether the last good inventory has an entry that comes bare (false before one was
    /// read).
    pub async fn has_bare(&self) -> bool {
        let cache = self.cache.lock().await;
        cache.good.as_ref().is_some_and(|(inv, _)| inv.has_bare())
    }

    /// Whether the last good inventory names any BMC (false before one was read).
    pub async fn has_bmcs(&self) -> bool {
        let cache = self.cache.lock().await;
        cache.good.as_ref().is_some_and(|(inv, _)| inv.has_bmcs())
    }

    /// The inventory, read again if it was last checked longer than `max_age` ago and changed
    /// since. When the read fails, the last good inventory (if any) is returned and the error
    /// is logged once per distinct error.
    pub async fn refresh(&self, max_age: Duration) -> Result<Arc<Inventory>, InventoryError> {
        let mut cache = self.cache.lock().await;
        if let (Some((inv, _)), Some(checked)) = (&cache.good, cache.checked) {
            if checked.elapsed() < max_age {
                return Ok(inv.clone());
            }
        }
        let stamp = cache.good.as_ref().map(|(_, s)| s.clone());
        let result =
            self.fetch_if_changed(stamp.as_ref())
                .await
                .and_then(|fetched| match fetched {
                    None => Ok(None),
                    Some((bytes, stamp)) => {
                        let checked = parse_inventory(&bytes)
                            .and_then(|entries| check_local(&entries).map(|()| entries));
                        match checked {
                            Ok(entries) => Ok(Some((entries, stamp))),
                            Err(problem) => Err(self.invalid(problem)),
                        }
                    }
                });
        cache.checked = Some(Instant::now());
        match result {
            Ok(fresh) => {
                if cache.error.take().is_some() {
                    tracing::info!(url = %self.url, "the inventory can be read again");
                }
                self.metrics.stale.set(0);
                match fresh {
                    None => self.metrics.read("unchanged"),
                    Some((entries, stamp)) => {
                        self.metrics.read("ok");
                        let inv = Arc::new(Inventory::new(entries));
                        let had_bmcs = cache.good.as_ref().map(|(old, _)| old.has_bmcs());
                        if had_bmcs.is_some_and(|b| b != inv.has_bmcs()) {
                            tracing::info!(
                                url = %self.url,
                                bmcs = inv.has_bmcs(),
                                "the inventory now {} BMCs: the recoverer follows it",
                                if inv.has_bmcs() { "names" } else { "names no" }
                            );
                        }
                        self.metrics.machines.set(inv.entries().len() as i64);
                        cache.good = Some((inv, stamp));
                    }
                }
                Ok(cache.good.as_ref().expect("a good inventory").0.clone())
            }
            Err(e) => {
                self.metrics.read("error");
                let text = e.to_string();
                if cache.error.as_deref() != Some(text.as_str()) {
                    // With nothing to fall back on the caller gets the error (at start-up).
                    if let Some((inv, _)) = &cache.good {
                        tracing::warn!(
                            error = %text,
                            machines = inv.entries().len(),
                            "cannot read the inventory; using the last good one until it can be read again"
                        );
                    }
                    cache.error = Some(text);
                }
                match &cache.good {
                    Some((inv, _)) => {
                        self.metrics.stale.set(1);
                        Ok(inv.clone())
                    }
                    None => Err(e),
                }
            }
        }
    }

    /// The inventory's bytes and stamp, or `None` if it is unchanged since `known`.
    async fn fetch_if_changed(
        &self,
        known: Option<&Stamp>,
    ) -> Result<Option<(Vec<u8>, Stamp)>, InventoryError> {
        if let Ok(path) = self.url.to_file_path() {
            use std::os::unix::fs::MetadataExt;
            let unreadable = |error| InventoryError::File {
                url: self.url.to_string(),
                path: path.clone(),
                error,
            };
            let meta = tokio::fs::metadata(&path).await.map_err(unreadable)?;
            let stamp = Stamp::File(meta.len(), meta.modified().ok(), meta.ino());
            if known == Some(&stamp) {
                return Ok(None);
            }
            if meta.len() > MAX_INVENTORY_BYTES as u64 {
                return Err(self.invalid(InventoryProblem::TooLarge(meta.len())));
            }
            let bytes = tokio::fs::read(&path).await.map_err(unreadable)?;
            return Ok(Some((bytes, stamp)));
        }
        let http = |e: reqwest::Error| InventoryError::Http {
            url: self.url.to_string(),
            cause: reqwest_causes(e),
        };
        let mut request = self.http.get(self.url.clone());
        match known {
            Some(Stamp::Http(name, value)) if name == reqwest::header::ETAG => {
                request = request.header(reqwest::header::IF_NONE_MATCH, value.clone());
            }
            Some(Stamp::Http(_, value)) => {
                request = request.header(reqwest::header::IF_MODIFIED_SINCE, value.clone());
            }
            _ => {}
        }
        let mut resp = request.send().await.map_err(http)?;
        if resp.status() == reqwest::StatusCode::NOT_MODIFIED && known.is_some() {
            return Ok(None);
        }
        resp = resp.error_for_status().map_err(http)?;
        let headers = resp.headers();
        let stamp = [reqwest::header::ETAG, reqwest::header::LAST_MODIFIED]
            .into_iter()
            .find_map(|name| {
                let value = headers.get(&name)?.clone();
                Some(Stamp::Http(name, value))
            })
            .unwrap_or(Stamp::None);
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(http)? {
            if body.len() + chunk.len() > MAX_INVENTORY_BYTES {
                let size = (body.len() + chunk.len()) as u64;
                return Err(self.invalid(InventoryProblem::TooLarge(size)));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Some((body, stamp)))
    }

    fn invalid(&self, problem: InventoryProblem) -> InventoryError {
        InventoryError::Invalid {
            url: self.url.to_string(),
            problem,
        }
    }

    fn to_machine(e: &InventoryEntry) -> ProviderMachine {
        ProviderMachine {
            id: Some(e.id.clone()),
            addr: Some(e.addr.clone()),
            availability: Availability::PossiblyUsed,
            failed: false,
            cause: None,
            location: e.location.clone(),
            status: Some(ProviderStatus::Running),
            reservation: None,
            facts: Default::default(),
        }
    }
}

#[async_trait]
impl Provider for StaticProvider {
    fn kind(&self) -> ProviderKind {
        self.kind
    }

    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        let inv = self.refresh(Duration::ZERO).await?;
        Ok(inv.entries().iter().map(Self::to_machine).collect())
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        self.refresh(LOOKUP_MAX_AGE)
            .await?
            .get(id)
            .map(Self::to_machine)
            .ok_or_else(|| ProviderError::NotFound(id.to_string()))
    }

    /// Records the machine; one whose entry says `Bare` is recorded at the start of its
    /// bare-metal way (design.md §21), which the bare-metal loop takes from there.
    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        let id = unused.required_id()?;
        let inv = self.refresh(LOOKUP_MAX_AGE).await?;
        let bare = inv.get(id).and_then(|e| e.bare.as_ref()).map(|b| {
            format!(
                "recorded bare: {} (sha256 {}) goes onto {}, which {}",
                shepherd_disks::url_shown(&b.image_url),
                b.image_sha256,
                b.disk_choice()
                    .map(|d| d.to_string())
                    .unwrap_or_else(|_| b.disk.to_string()),
                if b.wipe {
                    "the inventory entry allows to overwrite"
                } else {
                    "is written only if it holds no partition table or file system"
                }
            )
        });
        let recording = Recording {
            deploy_wait: Duration::ZERO,
            bare,
        };
        Ok(record_machine(session, self.kind, unused, &recording).await?)
    }
}

#[async_trait]
impl Rebooter for StaticProvider {
    /// Only entries that name a BMC can be power-cycled; this follows the last good inventory.
    async fn can_reboot(&self) -> bool {
        self.has_bmcs().await
    }

    /// Power-cycles the machine through the BMC its inventory entry names.
    async fn reboot(&self, lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError> {
        let id = machine.required_id()?;
        let inv = self.refresh(LOOKUP_MAX_AGE).await?;
        let entry = inv
            .get(id)
            .ok_or_else(|| ProviderError::NotFound(id.to_string()))?;
        let bmc = entry.bmc.clone().ok_or(ProviderError::NotSupported(
            "reboot: the inventory entry names no BMC",
        ))?;
        let bmc_client = Bmc::new(&bmc, self.bmc_timeout)?;
        lease.may_start("reset")?;
        let reset = bmc_client.reset().await?;
        tracing::info!(
            provider_id = id,
            bmc = bmc.url,
            reset,
            "power-cycled through the BMC"
        );
        Ok(())
    }

    fn reboot_wait(&self) -> Duration {
        self.reboot_wait
    }

    /// The entry's `Bare` and a client of its BMC.
    async fn bare_plan(&self, machine: &ProviderMachine) -> Result<BarePlan, ProviderError> {
        let id = machine.required_id()?;
        let inv = self.refresh(LOOKUP_MAX_AGE).await?;
        let entry = inv
            .get(id)
            .ok_or_else(|| ProviderError::NotFound(id.to_string()))?;
        let (Some(bmc), Some(bare)) = (&entry.bmc, &entry.bare) else {
            return Err(ProviderError::NotSupported(
                "the inventory entry no longer says Bare with a BMC",
            ));
        };
        Ok(BarePlan {
            bmc: Bmc::new(bmc, self.bmc_timeout)?,
            entry: bare.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
