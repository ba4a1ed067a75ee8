//! The OpenStack Ironic provider (SPEC §19): Ironic's node state machine mapped onto
//! Shepherd's provider traits.
//!
//! - **Unused**: `available` nodes, not in maintenance, with no `instance_uuid`, matching the
//!   operator's [`Selector`].
//! - **Create**: reserve the node with one JSON patch that sets a fresh `instance_uuid` and our
//!   deployment id in `extra` (Ironic refuses a second client's `instance_uuid` with 409, so
//!   two replicas never both take a node), then request `active` with a config drive carrying
//!   Shepherd's SSH key, then record the machine. Ironic deploys in the background; no worker
//!   waits for it.
//! - **Ours**: nodes whose `instance_uuid` is set and whose `extra` names this deployment. One
//!   the BMDB does not know (the insert failed, or the replica died before it) is an orphan:
//!   listed as possibly used, adopted by [`Provider::create_machine`]. Its deploy is requested
//!   only if it is still `available`: Ironic accepts `active` from `available` alone, so a node
//!   is never deployed twice.
//! - **Failed**: `deploy failed`, `error`, or a deploy that has not finished within the
//!   configured timeout; the updater marks the machine failed, with Ironic's `last_error`.
//! - **Recovery**: `rebooting` through Ironic's power API; a node in maintenance is never
//!   power-cycled.
//! - **Decommissioned** by an operator: released (our `instance_uuid` and marks removed; the
//!   node stays as it is), or with `--undeploy` released and torn down (`deleted`, so Ironic
//!   cleans it and makes it `available` again, for other clients: the decommission bars it
//!   from this deployment).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use rand::seq::SliceRandom;
use shepherd_bmdb::{Lease, Provider as ProviderKind, ProviderStatus, Session};
use shepherd_provider::settings::InvalidSetting;
use shepherd_provider::{
    record_deploying_machine, ApiFailure, Availability, HandBack, Provider, ProviderError,
    ProviderMachine, Recorded, Recoverer,
};

use crate::client::{ApiError, Client, Conflict};
use crate::model::{Allocation, Node, PatchOp};
use crate::placement::PlacementEstimate;

/// The `extra` key that names the deployment that reserved a node.
pub const DEPLOYMENT_KEY: &str = "shepherd_deployment";

/// The `extra` key naming the claim our marks belong to: the `instance_uuid` the node has
/// while we hold it (our allocation's id, or the instance we set). A node is ours only while
/// the two agree, so marks written before an allocation was seen placed (see
/// [`IronicProvider::settle`]) never make a node another client won ours. Marks from before
/// this key lack it and count as agreeing.
pub const CLAIM_KEY: &str = "shepherd_claim";

/// The `extra` key holding when a replica reserved the node (RFC 3339, the replica's clock),
/// so that another replica can tell a creation in progress from an orphan.
pub const RESERVED_AT_KEY: &str = "shepherd_reserved_at";

/// Which available nodes Shepherd may take. Every criterion set must match; none set takes
/// every available node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    /// The node's `resource_class`.
    pub resource_class: Option<String>,
    /// The node's `conductor_group`, lower-cased (as Ironic stores it) by
    /// [`Selector::normalized`].
    pub conductor_group: Option<String>,
    /// The node's `owner`.
    pub owner: Option<String>,
    /// A key of the node's `extra` and the text it must hold.
    pub extra: Option<(String, String)>,
    /// Traits the node must have (`--ironic-trait`, repeatable); also asked of Ironic in each
    /// allocation, so it schedules by them.
    pub traits: Vec<String>,
}

impl Selector {
    /// The selector as Ironic compares it: the conductor group lower-cased; or which
    /// setting holds a value Ironic would never match (its own limits: a conductor group of
    /// letters, digits, `_`, `-` and `.`, at most 255; a resource class at most 80; an owner
    /// at most 255).
    pub fn normalized(mut self) -> Result<Selector, InvalidSetting> {
        let bad = |setting: &str, problem: &str| Err(InvalidSetting::new(setting, problem));
        if let Some(group) = &mut self.conductor_group {
            let fine = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
            if group.len() > 255 || !group.chars().all(fine) {
                return bad(
                    "ironic-conductor-group",
                    "at most 255 letters, digits, '_', '-' or '.' (as Ironic accepts)",
                );
            }
            *group = group.to_ascii_lowercase();
        }
        // Ironic's trait names: upper-case letters, digits and '_', at most 255.
        let trait_name = |t: &String| {
            !t.is_empty()
                && t.len() <= 255
                && t.chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        };
        if let Some(t) = self.traits.iter().find(|t| !trait_name(t)) {
            return bad(
                "ironic-trait",
                &format!("{t:?}: a trait is 1 to 255 upper-case letters, digits or '_' (CUSTOM_GPU, HW_CPU_X86_AVX2)"),
            );
        }
        // (setting, value, longest Ironic accepts)
        let lengths = [
            ("ironic-resource-class", &self.resource_class, 80),
            ("ironic-owner", &self.owner, 255),
        ];
        for (setting, value, max) in lengths {
            if value
                .as_ref()
                .is_some_and(|v| v.is_empty() || v.len() > max)
            {
                return bad(
                    setting,
                    &format!("1 to {max} characters (as Ironic accepts)"),
                );
            }
        }
        Ok(self)
    }

    /// The criteria Ironic filters on itself, as query parameters.
    fn query(&self) -> Vec<(&'static str, &str)> {
        let mut q = Vec::new();
        if let Some(v) = &self.resource_class {
            q.push(("resource_class", v.as_str()));
        }
        if let Some(v) = &self.conductor_group {
            // Ironic keeps conductor groups lower-cased and filters on them as stored.
            q.push(("conductor_group", v.as_str()));
        }
        if let Some(v) = &self.owner {
            q.push(("owner", v.as_str()));
        }
        q
    }

    /// Whether `node` matches every criterion.
    pub fn matches(&self, node: &Node) -> bool {
        let same = |want: &Option<String>, have: &Option<String>| {
            want.as_ref().is_none_or(|w| have.as_deref() == Some(w))
        };
        let same_group = self.conductor_group.as_ref().is_none_or(|w| {
            node.conductor_group
                .as_deref()
                .is_some_and(|h| h.eq_ignore_ascii_case(w))
        });
        same(&self.resource_class, &node.resource_class)
            && same_group
            && same(&self.owner, &node.owner)
            && self.extra.as_ref().is_none_or(|(k, v)| {
                node.field(&format!("extra.{k}")).as_deref() == Some(v.as_str())
            })
            && self.traits.iter().all(|t| node.traits.contains(t))
    }
}

/// What a deploy writes onto the disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// `instance_info.image_source`: the image's URL.
    pub url: String,
    /// `instance_info.image_checksum`: its checksum (or the URL of a checksum file).
    pub checksum: String,
}

/// Provider settings.
#[derive(Debug, Clone)]
pub struct IronicConfig {
    /// This deployment's id, written into `extra.shepherd_deployment` of the nodes it takes:
    /// replicas of one deployment share it; another deployment's nodes are not ours.
    pub deployment: String,
    /// Which available nodes to take.
    pub selector: Selector,
    /// The image to deploy; `None` leaves it to the deploy interface's defaults.
    pub image: Option<Image>,
    /// Put `network_data` into each config drive, from the node's ports (DHCP on each), for
    /// images whose cloud-init configures the network from it (`--ironic-network-data`).
    pub network_data: bool,
    /// Deploy the image the operator set in each node's `instance_info` (`image_source`),
    /// instead of one image for all (`--ironic-image-from-node`); Shepherd never touches it.
    pub image_from_node: bool,
    /// Shepherd's SSH public key (OpenSSH line), put into each node's config drive.
    pub ssh_public_key: String,
    /// The node field holding the address to reach it over SSH (`host` or `host:port`).
    pub address_field: Option<String>,
    /// Whether to look an address up in the node's inspection inventory when the field
    /// holds none.
    pub address_from_inventory: bool,
    /// How long the initializer waits after a deploy was requested before its first takeover
    /// attempt (a deploy still running then is asked again with a growing backoff).
    pub deploy_wait: Duration,
    /// How long a deploy may take before the node counts as failed.
    pub deploy_timeout: Duration,
    /// How long a rebooted node is given before the initializer takes it over again.
    pub reboot_wait: Duration,
    /// How long a node whose allocation, reservation or deploy Ironic refused is skipped (a
    /// skip the provisioner records in the BMDB, so every replica honours it).
    pub refused_penalty: Duration,
    /// How long a node of ours that the BMDB does not know must have been left unchanged
    /// before it is adopted as an orphan: until then another replica of this deployment may
    /// be creating it (reserved, not yet recorded).
    pub orphan_grace: Duration,
}

impl IronicConfig {
    /// Defaults for everything but the deployment id and the key.
    pub fn new(deployment: &str, ssh_public_key: &str) -> Self {
        IronicConfig {
            deployment: deployment.into(),
            selector: Selector::default(),
            image: None,
            image_from_node: false,
            network_data: false,
            ssh_public_key: ssh_public_key.trim().into(),
            address_field: Some("extra.ssh_address".into()),
            address_from_inventory: true,
            deploy_wait: Duration::from_secs(300),
            deploy_timeout: Duration::from_secs(3600),
            reboot_wait: Duration::from_secs(60),
            refused_penalty: Duration::from_secs(600),
            orphan_grace: Duration::from_secs(60),
        }
    }

    /// Checks the settings; the message names the setting.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let bad = |setting: &str, problem: &str| Err(InvalidSetting::new(setting, problem));
        let d = &self.deployment;
        if d.is_empty()
            || d.len() > 64
            || !d
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return bad(
                "ironic-deployment",
                "must be 1 to 64 letters, digits, '-', '_' or '.' (it marks the nodes this deployment took)",
            );
        }
        if !self.ssh_public_key.starts_with("ssh-") {
            return bad(
                "ssh-key",
                "the SSH public key is not an OpenSSH public key line",
            );
        }
        if self.image.is_some() && self.image_from_node {
            return bad(
                "ironic-image-from-node",
                "deploys the image each node names; it excludes --ironic-image",
            );
        }
        if let Some(image) = &self.image {
            if url::Url::parse(&image.url).is_err() {
                return bad("ironic-image", "must be a URL with a scheme");
            }
            if image.checksum.is_empty() {
                return bad("ironic-image-checksum", "is required with --ironic-image");
            }
        }
        if self.address_field.is_none() && !self.address_from_inventory {
            return bad(
                "ironic-address-field",
                "no address source: name a node field or allow the inspection inventory",
            );
        }
        if self.deploy_timeout.is_zero() {
            return bad("ironic-deploy-timeout", "must be more than zero");
        }
        Ok(())
    }
}

/// Why the provider could not do something, as the typed source of a [`ProviderError`].
#[derive(Debug, thiserror::Error)]
pub enum IronicError {
    /// A call to Ironic failed.
    #[error("Ironic {call} of node {node}: {error}")]
    Api {
        /// What was asked.
        call: &'static str,
        /// The node.
        node: String,
        /// Why it failed.
        error: ApiError,
    },
    /// The node is in maintenance at Ironic: it is not power-cycled.
    #[error("node {node} is in maintenance at Ironic ({reason}); not power-cycling it")]
    InMaintenance {
        /// The node.
        node: String,
        /// Ironic's maintenance reason.
        reason: String,
    },
    /// An allocation was still not placed when the provider stopped waiting.
    #[error("Ironic did not place the allocation of node {node} within {waited:?}")]
    AllocationStuck {
        /// The node.
        node: String,
        /// How long it waited.
        waited: Duration,
    },
    /// Ironic failed to process the allocations of a node on its own, every attempt.
    #[error("Ironic failed to process the allocation of node {node}: {last_error}")]
    AllocationFailed {
        /// The node.
        node: String,
        /// Ironic's `last_error` of the last attempt.
        last_error: String,
    },
    /// Ironic placed no node in an allocation of one candidate (the node was taken or
    /// changed since it was listed).
    #[error("Ironic could not allocate node {node}: {last_error}")]
    NotAllocated {
        /// The node.
        node: String,
        /// The allocation's `last_error`.
        last_error: String,
    },
    /// A node the provider was asked to adopt is not ours (any more).
    #[error("node {0} is not reserved by this deployment")]
    NotOurs(String),
}

impl From<IronicError> for ProviderError {
    fn from(e: IronicError) -> Self {
        match e {
            IronicError::Api {
                error: ApiError::NotFound { .. },
                node,
                ..
            } => ProviderError::NotFound(node),
            IronicError::Api {
                error: ApiError::Unavailable { .. } | ApiError::Connect(_) | ApiError::Transport(_),
                ..
            } => ProviderError::Unavailable(ApiFailure::new(e)),
            e @ (IronicError::AllocationStuck { .. } | IronicError::AllocationFailed { .. }) => {
                ProviderError::Unavailable(ApiFailure::new(e))
            }
            e => ProviderError::Api(ApiFailure::new(e)),
        }
    }
}

fn api<'a>(call: &'static str, node: &'a str) -> impl FnOnce(ApiError) -> IronicError + 'a {
    move |error| IronicError::Api {
        call,
        node: node.to_string(),
        error,
    }
}

/// Ironic's provision state as the BMDB's provider status, for a node of ours.
pub fn status_of(node: &Node, deploy_timed_out: bool) -> ProviderStatus {
    if node.maintenance {
        return ProviderStatus::Maintenance;
    }
    match node.state() {
        "active" => ProviderStatus::Running,
        "deploy failed" | "error" | "adopt failed" => ProviderStatus::ProvisioningFailedPermanent,
        "deploying" | "wait call-back" | "available" | "adopting" if deploy_timed_out => {
            ProviderStatus::ProvisioningFailedPermanent
        }
        "deploying" | "wait call-back" | "available" | "adopting" => ProviderStatus::Provisioning,
        "deleting" | "cleaning" | "clean wait" | "clean failed" | "manageable" | "enroll" => {
            ProviderStatus::Stopped
        }
        _ => ProviderStatus::Unknown,
    }
}

/// The provider. Safe to call concurrently: the provisioner creates several machines at once
/// with `--provisioner-parallelism`, while the machine loops look machines up.
pub struct IronicProvider {
    client: Client,
    config: IronicConfig,
    /// Addresses found in inspection inventories, by node: an inventory does not change while
    /// a node is deployed, and reading it is one call per node.
    inventory_addresses: Mutex<HashMap<String, String>>,
    /// Allocations found to be another client's (see [`Self::partial_claim`]).
    foreign_allocations: Mutex<HashSet<String>>,
    /// How long Ironic has lately taken to place an allocation.
    placement: PlacementEstimate,
}

/// Where [`IronicProvider::settle`] left a new allocation.
enum Settled {
    /// Placed on the node, which is marked as ours.
    Marked(Box<Node>),
    /// Placed (`active`) or failed (`error`); the node is not marked yet.
    Placed(Allocation),
    /// Deleted before it was seen placed: another replica found it failed and cleared it out
    /// of the name's way (or an operator deleted it).
    Vanished,
}

impl IronicProvider {
    /// Checks the settings and the API (its microversions and the credentials), so that a
    /// wrong URL, an old Ironic or a wrong password fail at start-up.
    pub async fn connect(client: Client, mut config: IronicConfig) -> Result<Self, ConnectError> {
        config.validate()?;
        // Compared and sent as Ironic stores them, whoever built the config.
        config.selector = config.selector.normalized()?;
        let version = client.negotiate().await?;
        tracing::info!(url = client.root(), %version, pinned = %crate::client::PINNED_VERSION, deployment = config.deployment, "Ironic API reached");
        if config.image.is_none() {
            let nodes = client
                .list_nodes_with(&config.selector.query(), "instance_info")
                .await?;
            needs_no_image(&config.selector, &nodes, config.image_from_node)?;
        }
        Ok(IronicProvider {
            client,
            config,
            inventory_addresses: Mutex::new(HashMap::new()),
            foreign_allocations: Mutex::new(HashSet::new()),
            placement: PlacementEstimate::default(),
        })
    }

    /// The client (for tests and the benchmark, which count its calls).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Node `id` as the provider reads it; a node Ironic does not know is `NotFound`.
    async fn read_node(&self, id: &str) -> Result<Node, IronicError> {
        self.client.get_node(id).await.map_err(api("get_node", id))
    }

    /// Whether this deployment reserved `node`.
    pub fn ours(&self, node: &Node) -> bool {
        held_by(node, &self.config.deployment)
    }

    /// Whether `node` is free to take: `available`, not in maintenance, no instance, its
    /// power state known (Ironic allocates no node without one: its BMC was never reached),
    /// matching the selector and not skipped.
    fn unused(&self, node: &Node) -> bool {
        node.state() == "available"
            && !node.maintenance
            && node.power_state.is_some()
            && node.instance_uuid.is_none()
            && self.config.selector.matches(node)
    }

    fn deploy_timed_out(&self, node: &Node) -> bool {
        let deploying = matches!(node.state(), "deploying" | "wait call-back")
            || (node.state() == "available" && node.target_provision_state.is_some());
        let since = node
            .provision_updated_at
            .map(|t| chrono::Utc::now().signed_duration_since(t))
            .and_then(|d| d.to_std().ok());
        deploying && since.is_some_and(|d| d > self.config.deploy_timeout)
    }

    /// The address in the configured field, else one already found in the node's inventory.
    fn known_address(&self, node: &Node) -> Option<String> {
        self.config
            .address_field
            .as_deref()
            .and_then(|f| node.field(f))
            .or_else(|| {
                self.inventory_addresses
                    .lock()
                    .unwrap()
                    .get(&node.uuid)
                    .cloned()
            })
    }

    /// The address, reading the inspection inventory once when no field gives one (and the
    /// operator allowed it). A node without either has no address: the initializer waits.
    async fn address(&self, node: &Node) -> Option<String> {
        if let Some(a) = self.known_address(node) {
            return Some(a);
        }
        if !self.config.address_from_inventory {
            return None;
        }
        match self.client.inventory(&node.uuid).await {
            Ok(inventory) => {
                let addr = inventory_address(&inventory)?;
                self.inventory_addresses
                    .lock()
                    .unwrap()
                    .insert(node.uuid.clone(), addr.clone());
                Some(addr)
            }
            Err(ApiError::NotFound { .. }) => None,
            Err(e) => {
                tracing::debug!(node = node.uuid, error = %e, "reading the inspection inventory failed");
                None
            }
        }
    }

    fn machine(
        &self,
        node: &Node,
        availability: Availability,
        addr: Option<String>,
    ) -> ProviderMachine {
        let timed_out = self.deploy_timed_out(node);
        let status = status_of(node, timed_out);
        let mut m = ProviderMachine::new(node.uuid.clone(), addr, availability);
        m.failed = status == ProviderStatus::ProvisioningFailedPermanent;
        m.status = Some(status);
        m.location = node.conductor_group.clone().filter(|g| !g.is_empty());
        m.facts = node.facts();
        // The claim: a node claimed again later (after an undeploy) is a new machine.
        m.reservation = node.instance_uuid.clone();
        if m.failed {
            let cause = node.last_error.as_deref().unwrap_or(if timed_out {
                "the deploy did not finish within ironic-deploy-timeout"
            } else {
                "Ironic gave no last_error"
            });
            m.cause = Some(format!(
                "Ironic node {} is in state {:?}: {cause}",
                node.uuid,
                node.state()
            ));
        }
        m
    }

    /// Reserves node `uuid` for this deployment. A node with a resource class (every node
    /// Ironic can schedule has one) is claimed through an allocation ([`Self::allocate`]),
    /// then marked as ours with one patch ([`Self::mark`]). A node without one cannot be
    /// allocated, and is reserved as before allocations: one patch that sets a fresh
    /// `instance_uuid` with the marks.
    async fn reserve(
        &self,
        uuid: &str,
        resource_class: Option<&str>,
        lease: &Lease,
    ) -> Result<Node, ProviderError> {
        match resource_class.filter(|rc| !rc.is_empty()) {
            Some(rc) => self.allocate(uuid, rc, lease).await,
            None => self.reserve_by_instance_uuid(uuid).await,
        }
    }

    /// The patch that marks a node as this deployment's: our id, when, and the image.
    fn mark_ops(&self, claim: &str) -> Vec<PatchOp> {
        let mut ops = vec![
            PatchOp::add(
                format!("/extra/{DEPLOYMENT_KEY}"),
                self.config.deployment.clone(),
            ),
            PatchOp::add(
                format!("/extra/{RESERVED_AT_KEY}"),
                chrono::Utc::now().to_rfc3339(),
            ),
            PatchOp::add(format!("/extra/{CLAIM_KEY}"), claim),
        ];
        if let Some(image) = &self.config.image {
            ops.push(PatchOp::add(
                "/instance_info/image_source",
                image.url.clone(),
            ));
            ops.push(PatchOp::add(
                "/instance_info/image_checksum",
                image.checksum.clone(),
            ));
        }
        ops
    }

    /// Marks node `uuid`, allocated by `allocation`, as ours. If this fails the node stays
    /// allocated under our allocation's name, and a later listing finds it as a claim cut
    /// short ([`Self::partial_claim`]) and adopts it.
    async fn mark(&self, uuid: &str, allocation: &str) -> Result<Node, IronicError> {
        self.client
            .patch_node("mark_node", uuid, &self.mark_ops(allocation))
            .await
            .map_err(api("mark_node", uuid))
    }

    /// Removes the marks [`Self::settle`] wrote before an allocation that then failed: the
    /// node is not ours (and without the marks it is no longer listed as a claim of ours in
    /// any way). Best effort, and only while the lease holds: marks left behind name a claim
    /// the node does not hold, so they make nothing ours.
    async fn unmark(&self, uuid: &str, lease: &Lease) {
        if lease.left().is_err() {
            tracing::debug!(node = uuid, "the lease ended: the marks of a failed claim stay, naming a claim the node does not hold");
            return;
        }
        let ops: Vec<PatchOp> = [DEPLOYMENT_KEY, RESERVED_AT_KEY, CLAIM_KEY]
            .iter()
            .map(|key| PatchOp::remove(format!("/extra/{key}")))
            .collect();
        if let Err(e) = self.client.patch_node("unmark_node", uuid, &ops).await {
            tracing::debug!(node = uuid, error = %e, "removing the marks of a failed claim failed; they name a claim the node does not hold");
        }
    }

    /// Claims node `uuid` through Ironic's Allocation API: an allocation named after this
    /// deployment and the node ([`allocation_name`]), with the node as its only candidate, the
    /// node's resource class, the selector's traits and owner. Replicas racing for the node
    /// race on that name: the loser gets a conflict, never a second allocation. Waits until
    /// the conductor has placed it ([`Self::settle`]) and returns the node marked as ours; an
    /// allocation that ends in `error` (the node was taken or changed since it was listed) is
    /// deleted and the node skipped for a while.
    async fn allocate(
        &self,
        uuid: &str,
        resource_class: &str,
        lease: &Lease,
    ) -> Result<Node, ProviderError> {
        let name = allocation_name(&self.config.deployment, uuid);
        let mut body = serde_json::json!({
            "name": name,
            "resource_class": resource_class,
            "candidate_nodes": [uuid],
            "extra": { DEPLOYMENT_KEY: self.config.deployment },
        });
        if !self.config.selector.traits.is_empty() {
            body["traits"] = serde_json::json!(self.config.selector.traits);
        }
        if let Some(owner) = &self.config.selector.owner {
            body["owner"] = serde_json::json!(owner);
        }
        let mut attempt = 1;
        loop {
            // Each attempt claims the node anew: none once the lease is gone (the work may be
            // another replica's by now).
            lease.left()?;
            let created = match self.client.create_allocation(body.clone()).await {
                Ok(a) => a,
                Err(ApiError::Conflict { message, .. }) => {
                    return Err(self.name_taken(&name, &message, lease).await);
                }
                Err(e) if !e.not_applied() && e.transient() => {
                    // It may have been made; if so, a later listing finds it by its name.
                    return Err(ProviderError::Taken(format!(
                        "allocating node {uuid} answered with an error ({e}); if the allocation was made, a later pass adopts the node"
                    )));
                }
                Err(e) => return Err(self.refused_or(api("create_allocation", uuid)(e))),
            };
            let placed = match self.settle(created, uuid, lease).await? {
                Settled::Marked(node) => return Ok(*node),
                Settled::Placed(a)
                    if a.state == "active" && a.node_uuid.as_deref() == Some(uuid) =>
                {
                    // Placing an allocation can take seconds: mark nothing once the lease is
                    // gone (the allocated, unmarked node is a claim cut short, adopted later).
                    lease.left()?;
                    return Ok(self.mark(uuid, &a.uuid).await?);
                }
                Settled::Placed(failed) => failed,
                Settled::Vanished => {
                    return Err(ProviderError::Taken(format!(
                        "allocation {name} was deleted before it was seen placed (another replica found it failed, or an operator deleted it); a later pass claims the node again"
                    )));
                }
            };
            // A failed allocation left behind is deleted by the node's next claim.
            lease.left()?;
            if let Err(e) = self.client.delete_allocation(&placed.uuid).await {
                tracing::warn!(node = uuid, allocation = placed.uuid, error = %e, "deleting a failed allocation failed; the next claim of the node deletes it");
            }
            let last_error = placed.last_error.unwrap_or_else(|| "no last_error".into());
            if last_error.contains(NODE_LOCKED) {
                // Busy, not unfit: a conductor holds the node (a periodic task, an operation
                // in flight) past Ironic's own retries. Not skipped; the next pass tries again.
                return Err(ProviderError::Taken(format!(
                    "node {uuid} is locked by an Ironic conductor ({last_error}); a later pass tries again"
                )));
            }
            if !last_error.starts_with(IRONIC_FAULT) {
                // The node was taken or changed since it was listed.
                return Err(self.refused(
                    uuid,
                    IronicError::NotAllocated {
                        node: uuid.to_string(),
                        last_error,
                    },
                ));
            }
            // Ironic failed on its own (its database was busy, say): not the node's fault.
            if attempt == ALLOCATION_ATTEMPTS {
                return Err(IronicError::AllocationFailed {
                    node: uuid.to_string(),
                    last_error,
                }
                .into());
            }
            tracing::debug!(
                node = uuid,
                attempt,
                last_error,
                "Ironic failed to process an allocation; trying again"
            );
            let pause = 100 * attempt as u64;
            tokio::time::sleep(Duration::from_millis(pause + rand::random_range(0..pause))).await;
            attempt += 1;
        }
    }

    /// Waits until the conductor has placed `allocation` (just made, for node `uuid`), with
    /// as few requests as it can. The first look comes after the placement time recent claims
    /// took ([`PlacementEstimate`]). Where no image is to be written, that look is the marking
    /// patch itself: its answer shows whether the node's instance is already the allocation
    /// (placed, and marked, in one request). The marks name the allocation ([`CLAIM_KEY`]),
    /// so that written on a node the allocation then does not get, they make nothing ours;
    /// they are removed again when it fails. An image is written only once the node is held.
    /// Later looks read the allocation ([`Self::placed`]).
    async fn settle(
        &self,
        allocation: Allocation,
        uuid: &str,
        lease: &Lease,
    ) -> Result<Settled, ProviderError> {
        tokio::time::sleep(self.placement.first_look()).await;
        let mut marked_early = false;
        if self.config.image.is_none() {
            lease.left()?;
            let ops = self.mark_ops(&allocation.uuid);
            match self.client.patch_node("mark_node", uuid, &ops).await {
                Ok(node) if node.instance_uuid.as_deref() == Some(allocation.uuid.as_str()) => {
                    self.placement.placed_at_first_look();
                    return Ok(Settled::Marked(Box::new(node)));
                }
                Ok(_) => marked_early = true,
                Err(e) => {
                    tracing::debug!(node = uuid, error = %e, "marking a node before its allocation was placed failed; it is marked once placed");
                    marked_early = !e.not_applied();
                }
            }
        }
        let (placed, looks) = match self.placed(allocation, uuid, lease).await {
            Ok(placed) => placed,
            Err(e) => {
                // Not seen placed: whatever became of the allocation, the marks go. (One
                // placed after all is an allocated, unmarked node: a claim cut short, adopted.)
                if marked_early {
                    self.unmark(uuid, lease).await;
                }
                return match e {
                    IronicError::Api {
                        error: ApiError::NotFound { .. },
                        ..
                    } => Ok(Settled::Vanished),
                    e => Err(e.into()),
                };
            }
        };
        if looks <= 1 && !marked_early && self.config.image.is_some() {
            self.placement.placed_at_first_look();
        } else {
            self.placement.placed_later();
        }
        if placed.state != "active" && marked_early {
            self.unmark(uuid, lease).await;
        }
        Ok(Settled::Placed(placed))
    }

    /// The allocation once the conductor has placed it (`active` or `error`), read at once,
    /// then after 50 ms doubling to 2 s, and how many reads that took. One still `allocating`
    /// after [`ALLOCATION_WAIT`] is deleted (the conductor is stuck or gone): Ironic is not
    /// answering, which is not the node's fault), while the lease holds; left for the node's
    /// next claim otherwise.
    async fn placed(
        &self,
        mut allocation: Allocation,
        uuid: &str,
        lease: &Lease,
    ) -> Result<(Allocation, u32), IronicError> {
        let started = std::time::Instant::now();
        let mut pause = Duration::ZERO;
        let mut looks = 0;
        while allocation.state == "allocating" {
            if started.elapsed() > ALLOCATION_WAIT {
                if lease.left().is_err() {
                    tracing::debug!(node = uuid, allocation = allocation.uuid, "the lease ended: an allocation that never finished stays for the node's next claim");
                } else if let Err(e) = self.client.delete_allocation(&allocation.uuid).await {
                    tracing::warn!(node = uuid, allocation = allocation.uuid, error = %e, "deleting an allocation that never finished failed");
                }
                return Err(IronicError::AllocationStuck {
                    node: uuid.to_string(),
                    waited: ALLOCATION_WAIT,
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).clamp(Duration::from_millis(50), Duration::from_secs(2));
            looks += 1;
            allocation = self
                .client
                .get_allocation(&allocation.uuid)
                .await
                .map_err(api("get_allocation", uuid))?;
        }
        Ok((allocation, looks))
    }

    /// Why an allocation name of ours was taken: another replica of this deployment is
    /// claiming the node (taken), or an earlier claim's allocation failed and was left behind
    /// (deleted now while the lease holds, so that the node can be claimed again on a later
    /// pass).
    async fn name_taken(&self, name: &str, message: &str, lease: &Lease) -> ProviderError {
        match self.client.get_allocation(name).await {
            Ok(a) if a.state == "error" || stuck(&a) => {
                if let Err(lost) = lease.left() {
                    return lost.into();
                }
                if a.state != "error" {
                    tracing::warn!(allocation = name, created_at = ?a.created_at, "deleting an allocation of ours that Ironic never finished");
                }
                if let Err(e) = self.client.delete_allocation(&a.uuid).await {
                    tracing::warn!(allocation = name, error = %e, "deleting a failed allocation failed");
                }
                let why = match a.state.as_str() {
                    "error" => a.last_error.unwrap_or_else(|| "no last_error".into()),
                    _ => format!("still allocating after {:?}", 2 * ALLOCATION_WAIT),
                };
                ProviderError::Taken(format!(
                    "allocation {name} had failed ({why}); deleted, the node is claimed again on a later pass"
                ))
            }
            _ => ProviderError::Taken(format!(
                "allocation {name} exists: another replica of this deployment is claiming the node ({message})"
            )),
        }
    }

    /// Whether `node`, held by an allocation but without any deployment's marks, is a claim
    /// of ours cut short (a replica stopped between allocating and marking it): its
    /// allocation carries our name for it. Allocations found foreign are remembered, so each
    /// costs one read per process.
    async fn partial_claim(&self, node: &Node) -> Result<Option<Allocation>, ApiError> {
        // A node held by an allocation has the allocation's id as its instance.
        let Some(id) = node.instance_uuid.as_deref() else {
            return Ok(None);
        };
        if node.extra.contains_key(DEPLOYMENT_KEY)
            || self.foreign_allocations.lock().unwrap().contains(id)
        {
            return Ok(None);
        }
        let ours = allocation_name(&self.config.deployment, &node.uuid);
        match self.client.get_allocation(id).await {
            Ok(a) if a.name.as_deref() == Some(ours.as_str()) => Ok(Some(a)),
            Ok(_) | Err(ApiError::NotFound { .. }) => {
                self.foreign_allocations
                    .lock()
                    .unwrap()
                    .insert(id.to_string());
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Marks a node whose claim of ours was cut short after its allocation, once the claim is
    /// older than the orphan grace (until then, another replica may still be marking it).
    async fn finish_partial_claim(&self, node: &Node) -> Result<Node, ProviderError> {
        let id = node.uuid.as_str();
        let Some(allocation) = self
            .partial_claim(node)
            .await
            .map_err(api("get_allocation", id))?
        else {
            return Err(IronicError::NotOurs(id.to_string()).into());
        };
        let age = allocation
            .created_at
            .and_then(|t| chrono::Utc::now().signed_duration_since(t).to_std().ok());
        if age.is_none_or(|age| age < self.config.orphan_grace) {
            return Err(ProviderError::Taken(format!(
                "node {id} was allocated by this deployment moments ago; another replica is still claiming it"
            )));
        }
        tracing::warn!(
            node = id,
            allocation = allocation.uuid,
            "adopting a node this deployment allocated but never marked"
        );
        Ok(self.mark(id, &allocation.uuid).await?)
    }

    /// Reserves `node` without an allocation: one patch that sets a fresh `instance_uuid`
    /// with our marks. When the answer is lost, the node is read to learn whether the patch
    /// took.
    async fn reserve_by_instance_uuid(&self, uuid: &str) -> Result<Node, ProviderError> {
        let instance = uuid::Uuid::new_v4().to_string();
        let mut ops = vec![PatchOp::add("/instance_uuid", instance.clone())];
        ops.extend(self.mark_ops(&instance));
        match self.client.patch_node("reserve_node", uuid, &ops).await {
            Ok(node) => Ok(node),
            // Reserved by another client, or already deploying for one: no longer available.
            Err(ApiError::Conflict {
                kind: Conflict::NodeAssociated | Conflict::InTransition,
                message,
            }) => Err(ProviderError::Taken(message)),
            Err(e) if !e.not_applied() && e.transient() => {
                // The patch may have been applied: ours if the node carries our instance.
                let node = self
                    .client
                    .get_node(uuid)
                    .await
                    .map_err(api("reserve_node", uuid))?;
                if node.instance_uuid.as_deref() == Some(instance.as_str()) {
                    tracing::warn!(node = uuid, error = %e, "reserving answered with an error but the reservation took");
                    Ok(node)
                } else if node.instance_uuid.is_some() {
                    Err(ProviderError::Taken(format!(
                        "node {uuid} was reserved by another client"
                    )))
                } else {
                    Err(IronicError::Api {
                        call: "reserve_node",
                        node: uuid.into(),
                        error: e,
                    }
                    .into())
                }
            }
            Err(e) => Err(self.refused_or(api("reserve_node", uuid)(e))),
        }
    }

    /// Gives `node` back: removes our marks (and the image) and its `instance_uuid`, which
    /// also ends its allocation. Ironic refuses to end the allocation of a node deployed (or
    /// failed) outside maintenance: that one keeps its allocation until it is torn down
    /// (which ends it), and without our marks it is no longer ours.
    async fn release(&self, node: &Node) -> Result<(), ApiError> {
        let uuid = node.uuid.as_str();
        let mut ops = vec![PatchOp::remove(format!("/extra/{DEPLOYMENT_KEY}"))];
        for key in [RESERVED_AT_KEY, CLAIM_KEY] {
            if node.extra.contains_key(key) {
                ops.push(PatchOp::remove(format!("/extra/{key}")));
            }
        }
        if self.config.image.is_some() {
            ops.push(PatchOp::remove("/instance_info/image_source"));
            ops.push(PatchOp::remove("/instance_info/image_checksum"));
        }
        let mut with_instance = vec![PatchOp::remove("/instance_uuid")];
        with_instance.extend(ops.iter().cloned());
        match self
            .client
            .patch_node("release_node", uuid, &with_instance)
            .await
        {
            // The node's instance is an allocation Ironic will not end in this state.
            Err(ApiError::Conflict { message, .. })
                if message.contains("allocation") && !FREEABLE_STATES.contains(&node.state()) =>
            {
                tracing::info!(node = uuid, state = node.state(), "the node keeps its allocation until it is torn down; releasing it by removing our marks");
                self.client.patch_node("release_node", uuid, &ops).await?;
                // No longer a claim of ours to adopt, although the allocation has our name.
                if let Some(allocation) = &node.instance_uuid {
                    self.foreign_allocations
                        .lock()
                        .unwrap()
                        .insert(allocation.clone());
                }
            }
            other => {
                other?;
            }
        }
        Ok(())
    }

    /// Hands a decommissioned node back: released, then torn down when `undeploy`. A node in
    /// a transition (still deploying) is left for the next pass. Ironic clears
    /// `instance_uuid` when it tears a node down but not our mark in `extra`, so the node is
    /// released first; a tear-down request that then fails for good is logged by the
    /// provisioner and left to the operator (the node is no longer ours to retry).
    async fn hand_back_node(&self, uuid: &str, undeploy: bool) -> Result<HandBack, IronicError> {
        let node = match self.client.get_node(uuid).await {
            Err(ApiError::NotFound { .. }) => return Ok(HandBack::Released),
            other => other.map_err(api("get_node", uuid))?,
        };
        if !self.ours(&node) {
            return Ok(HandBack::Released);
        }
        if node.target_provision_state.is_some() {
            return Ok(HandBack::InProgress);
        }
        self.release(&node)
            .await
            .map_err(api("release_node", uuid))?;
        let deployed = !matches!(node.state(), "available" | "manageable" | "enroll");
        if undeploy && deployed {
            self.client
                .set_provision_state(
                    "undeploy_node",
                    uuid,
                    serde_json::json!({"target": "deleted"}),
                )
                .await
                .map_err(api("undeploy_node", uuid))?;
        }
        Ok(HandBack::Released)
    }

    /// Requests the deploy of a reserved `available` node with a config drive carrying our
    /// key. Ironic accepts `active` only from `available`, so when the request is refused the
    /// node is read: one of ours already deploying (another replica adopting the same orphan,
    /// or an answer that was lost) is success, never a second deploy.
    async fn deploy(&self, node: &Node) -> Result<(), ProviderError> {
        let uuid = node.uuid.as_str();
        let hostname = node.name.clone().unwrap_or_else(|| uuid.to_string());
        // cloud-init tells instances apart by this: the instance's id (ours, set when the
        // node was reserved), so that a redeploy is a new instance, not the node's.
        let instance = node.instance_uuid.as_deref().unwrap_or(uuid);
        let mut body = serde_json::json!({
            "target": "active",
            "configdrive": {
                "meta_data": {
                    "uuid": instance,
                    "name": hostname,
                    "hostname": hostname,
                    "public_keys": { "shepherd": self.config.ssh_public_key },
                }
            }
        });
        if self.config.network_data {
            let ports = self
                .client
                .list_ports(uuid)
                .await
                .map_err(api("list_ports", uuid))?;
            body["configdrive"]["network_data"] = network_data(&ports);
        }
        let error = match self
            .client
            .set_provision_state("deploy_node", uuid, body)
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let now = self
            .client
            .get_node(uuid)
            .await
            .map_err(api("deploy_node", uuid))?;
        if self.ours(&now) && now.state() != "available" {
            tracing::info!(node = uuid, state = now.state(), error = %error, "the deploy request was answered with an error, but the node is past available");
            return Ok(());
        }
        if matches!(error, ApiError::Refused { .. }) {
            // Ironic will not deploy it as it is (a driver that does not validate, say): give
            // it back rather than hold a node that is not deploying.
            if let Err(e) = self.release(node).await {
                tracing::warn!(node = uuid, error = %e, "releasing a node whose deploy was refused failed; it stays reserved and will be tried again as ours");
            }
        }
        Err(self.refused_or(api("deploy_node", uuid)(error)))
    }

    /// `error` as Ironic's refusal of node `uuid`: the provisioner skips the node for
    /// [`IronicConfig::refused_penalty`], on every replica.
    fn refused(&self, uuid: &str, error: IronicError) -> ProviderError {
        ProviderError::Refused {
            provider_id: uuid.to_string(),
            skip_for: self.config.refused_penalty,
            error: ApiFailure::new(error),
        }
    }

    /// [`Self::refused`] if Ironic refused a call on a node (a 4xx that is not a conflict
    /// or a missing node), else the error as it maps.
    fn refused_or(&self, error: IronicError) -> ProviderError {
        match &error {
            IronicError::Api {
                error: ApiError::Refused { .. },
                node,
                ..
            } => self.refused(&node.clone(), error),
            _ => error.into(),
        }
    }
}

/// Provision states in which Ironic lets an allocation end (outside maintenance).
const FREEABLE_STATES: &[&str] = &[
    "available",
    "manageable",
    "enroll",
    "inspecting",
    "inspect wait",
];

/// How Ironic's conductor begins the `last_error` of an allocation it failed to process on
/// its own (an exception of its own, a busy database), as opposed to a node that no longer
/// fits ("none of the requested nodes are available …").
const IRONIC_FAULT: &str = "Unexpected exception during allocation";

/// What the `last_error` of an allocation says (after "Failed to process allocation …: ")
/// when its every candidate stayed locked by a conductor through all of Ironic's own retries
/// (`node_locked_retry_attempts`).
const NODE_LOCKED: &str = "could not reserve any of";

/// Allocations tried per claim when Ironic fails to process them on its own.
const ALLOCATION_ATTEMPTS: u32 = 3;

/// How long a new allocation may stay `allocating` before it is given up.
const ALLOCATION_WAIT: Duration = Duration::from_secs(30);

/// Whether allocation `a` of ours is stuck `allocating`: created longer ago than twice
/// [`ALLOCATION_WAIT`], so whichever replica made it has given up waiting (and failed to
/// delete it, or Ironic's conductor lost it). Left alone, it would make every later claim of
/// the node end as taken, for good.
fn stuck(a: &Allocation) -> bool {
    let age = a
        .created_at
        .and_then(|t| chrono::Utc::now().signed_duration_since(t).to_std().ok());
    a.state == "allocating" && age.is_some_and(|age| age > 2 * ALLOCATION_WAIT)
}

/// Whether `deployment` holds `node`: the node has an instance, carries the deployment's
/// mark, and its claim mark (if any) names that instance.
fn held_by(node: &Node, deployment: &str) -> bool {
    let extra = |key: &str| node.extra.get(key).and_then(|v| v.as_str());
    node.instance_uuid.is_some()
        && extra(DEPLOYMENT_KEY) == Some(deployment)
        && extra(CLAIM_KEY).is_none_or(|claim| node.instance_uuid.as_deref() == Some(claim))
}

/// The allocation name of this deployment's claim of `node`: every replica of the deployment
/// derives the same one, so that replicas racing for a node race on one name (allocation names
/// are unique in Ironic), and `baremetal allocation list` shows whose claim it is.
pub fn allocation_name(deployment: &str, node: &str) -> String {
    format!("shepherd.{deployment}.{node}")
}

/// Whether a replica reserved `node` less than `within` ago. A node without the mark (reserved
/// by hand, or by an older Shepherd) counts as reserved long ago; a mark in the future (clocks
/// apart) counts as recent.
fn reserved_within(node: &Node, within: Duration) -> bool {
    node.field(&format!("extra.{RESERVED_AT_KEY}"))
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(&t).ok())
        .map(|t| chrono::Utc::now().signed_duration_since(t))
        .is_some_and(|age| age.to_std().map_or(true, |age| age < within))
}

/// The first IPv4 address (else IPv6) of the inventory's interfaces, skipping loopback.
fn inventory_address(inventory: &serde_json::Value) -> Option<String> {
    let interfaces = inventory
        .pointer("/inventory/interfaces")
        .and_then(|i| i.as_array())?;
    let pick = |key: &str| {
        interfaces.iter().find_map(|i| {
            let a = i.get(key)?.as_str()?;
            let ip: std::net::IpAddr = a.split('/').next()?.parse().ok()?;
            (!ip.is_loopback() && !ip.is_unspecified()).then(|| ip.to_string())
        })
    };
    pick("ipv4_address").or_else(|| pick("ipv6_address"))
}

/// The config drive's `network_data` (OpenStack's `network_data.json`) for a node's ports:
/// one physical link per port, by its MAC address, each configured by DHCP (IPv4).
fn network_data(ports: &[crate::model::Port]) -> serde_json::Value {
    let mut links = Vec::new();
    let mut networks = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let link = format!("port-{}", port.uuid);
        networks.push(serde_json::json!({
            "id": format!("network{i}"), "type": "ipv4_dhcp", "link": link, "network_id": port.uuid,
        }));
        links.push(serde_json::json!({
            "id": link, "type": "phy", "ethernet_mac_address": port.address,
        }));
    }
    serde_json::json!({ "links": links, "networks": networks, "services": [] })
}

/// Deploy interfaces that write an image, and fail without one.
const WRITES_AN_IMAGE: &[&str] = &["direct", "ansible", "anaconda"];

/// Refuses a start without `--ironic-image` when an `available` node the selector matches
/// deploys with an interface that writes an image: every deploy of it would be refused. With
/// `from_node` (`--ironic-image-from-node`), only such nodes whose `instance_info` names no
/// `image_source` are refused.
fn needs_no_image(
    selector: &Selector,
    nodes: &[Node],
    from_node: bool,
) -> Result<(), InvalidSetting> {
    let needing: Vec<&Node> = nodes
        .iter()
        .filter(|n| n.state() == "available" && selector.matches(n))
        .filter(|n| {
            n.deploy_interface
                .as_deref()
                .is_some_and(|d| WRITES_AN_IMAGE.contains(&d))
        })
        .filter(|n| !from_node || !n.instance_info.contains_key("image_source"))
        .collect();
    let Some(first) = needing.first() else {
        return Ok(());
    };
    let (setting, remedy) = if from_node {
        ("ironic-image-from-node", ", and name none in instance_info: set it (baremetal node set NODE --instance-info image_source=URL --instance-info image_checksum=SUM) or give --ironic-image")
    } else {
        ("ironic-image", ": give --ironic-image and --ironic-image-checksum, or --ironic-image-from-node to deploy the image each node's instance_info names")
    };
    let interface = first.deploy_interface.as_deref().unwrap_or("");
    Err(InvalidSetting::new(
        setting,
        format!(
            "{} available node(s) the selector matches deploy with {interface:?} (node {}), which writes an image{remedy}",
            needing.len(),
            first.uuid
        ),
    ))
}

/// Why the provider could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A setting is wrong.
    #[error(transparent)]
    Config(#[from] InvalidSetting),
    /// The API could not be used.
    #[error("Ironic API")]
    Api(#[from] ApiError),
}

#[async_trait]
impl Provider for IronicProvider {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Ironic
    }

    /// Ours first (the BMDB decides which are orphans), then the unused nodes in a random
    /// order, so that replicas taking nodes at the same time mostly pick different ones.
    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        let nodes = self
            .client
            .list_nodes(&self.config.selector.query())
            .await
            .map_err(api("list_nodes", "*"))?;
        let mut out = Vec::new();
        let mut unused = Vec::new();
        for node in &nodes {
            if self.ours(node) {
                let addr = self.known_address(node);
                out.push(self.machine(node, Availability::PossiblyUsed, addr));
            } else if node.instance_uuid.is_some() && self.config.selector.matches(node) {
                match self.partial_claim(node).await {
                    // Listed as possibly ours: the provisioner adopts it as an orphan.
                    Ok(Some(_)) => out.push(self.machine(node, Availability::PossiblyUsed, None)),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::debug!(node = node.uuid, error = %e, "could not read the allocation holding a node; looked at again next pass")
                    }
                }
            } else if self.unused(node) {
                unused.push(ProviderMachine {
                    id: None,
                    addr: None,
                    availability: Availability::KnownUnused,
                    failed: false,
                    cause: None,
                    location: node.conductor_group.clone().filter(|g| !g.is_empty()),
                    status: None,
                    reservation: Some(node.uuid.clone()),
                    facts: node.facts(),
                });
            }
        }
        unused.shuffle(&mut rand::rng());
        out.extend(unused);
        Ok(out)
    }

    /// A node keeps its id: the machine made of it is known by the node's id.
    fn id_once_created<'m>(&self, unused: &'m ProviderMachine) -> Option<&'m str> {
        unused.valid_id().or(unused.reservation.as_deref())
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        let node = self.read_node(id).await?;
        if !self.ours(&node) {
            return Err(ProviderError::NotFound(id.to_string()));
        }
        let addr = self.address(&node).await;
        Ok(self.machine(&node, Availability::KnownUsed, addr))
    }

    async fn hand_back(
        &self,
        machine: &ProviderMachine,
        undeploy: bool,
    ) -> Result<HandBack, ProviderError> {
        let id = machine.valid_id().ok_or(ProviderError::NotSupported(
            "handing back a machine without an id",
        ))?;
        Ok(self.hand_back_node(id, undeploy).await?)
    }

    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        // Each step at Ironic is taken only while the lease holds; one cut short by its end
        // leaves an orphan that a later pass (of whichever replica) adopts.
        let lease = session.lease();
        lease.left()?;
        let node = match unused.valid_id() {
            // An orphan: reserved by this deployment, unknown to the BMDB.
            Some(id) => {
                let node = self.read_node(id).await?;
                lease.left()?;
                let node = if !self.ours(&node) {
                    self.finish_partial_claim(&node).await?
                } else if reserved_within(&node, self.config.orphan_grace) {
                    return Err(ProviderError::Taken(format!(
                        "node {id} was reserved by this deployment moments ago; another replica is still creating it"
                    )));
                } else {
                    node
                };
                tracing::warn!(
                    node = id,
                    state = node.state(),
                    "adopting a node this deployment reserved that the BMDB does not know"
                );
                if node.state() == "available" && !node.maintenance {
                    lease.left()?;
                    self.deploy(&node).await?;
                }
                node
            }
            None => {
                let uuid = unused.reservation.as_deref().ok_or_else(|| {
                    ProviderError::NotSupported("an unused Ironic machine without a node id")
                })?;
                let node = self
                    .reserve(uuid, unused.facts.get("resource_class"), &lease)
                    .await?;
                lease.left()?;
                self.deploy(&node).await?;
                node
            }
        };
        let addr = self.address(&node).await;
        let machine = self.machine(&node, Availability::KnownUsed, addr);
        // If this insert fails the node is an orphan until the next pass adopts it.
        let wait = match machine.status {
            Some(ProviderStatus::Provisioning) => self.config.deploy_wait,
            _ => Duration::ZERO,
        };
        Ok(record_deploying_machine(session, ProviderKind::Ironic, &machine, wait).await?)
    }
}

#[async_trait]
impl Recoverer for IronicProvider {
    async fn reboot(&self, machine: &ProviderMachine) -> Result<(), ProviderError> {
        let id = machine.valid_id().ok_or(ProviderError::NotSupported(
            "rebooting a machine without an id",
        ))?;
        if machine.status == Some(ProviderStatus::Maintenance) {
            let node = self.read_node(id).await?;
            if node.maintenance {
                return Err(IronicError::InMaintenance {
                    node: id.to_string(),
                    reason: node
                        .maintenance_reason
                        .unwrap_or_else(|| "no reason given".into()),
                }
                .into());
            }
        }
        self.client
            .set_power_state(id, "rebooting")
            .await
            .map_err(api("reboot_node", id))?;
        Ok(())
    }

    fn reboot_wait(&self) -> Duration {
        self.config.reboot_wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(v: serde_json::Value) -> Node {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn states_map_to_statuses() {
        let n = |state: &str, maintenance: bool| {
            node(
                serde_json::json!({"uuid": "u", "provision_state": state, "maintenance": maintenance}),
            )
        };
        use ProviderStatus::*;
        // (provision state, in maintenance, deploy timed out) → status.
        let cases = [
            ("active", false, false, Running),
            ("active", true, false, Maintenance),
            ("deploying", false, false, Provisioning),
            ("wait call-back", false, true, ProvisioningFailedPermanent),
            ("deploy failed", false, false, ProvisioningFailedPermanent),
            ("cleaning", false, false, Stopped),
            ("rescue", false, false, Unknown),
        ];
        for (state, maintenance, timed_out, want) in cases {
            assert_eq!(
                status_of(&n(state, maintenance), timed_out),
                want,
                "{state} maintenance={maintenance} timed_out={timed_out}"
            );
        }
    }

    #[test]
    fn a_node_is_held_only_while_its_claim_mark_names_its_instance() {
        let marked = |instance: Option<&str>, claim: Option<&str>| {
            let mut extra = serde_json::json!({ DEPLOYMENT_KEY: "site-a" });
            if let Some(claim) = claim {
                extra[CLAIM_KEY] = claim.into();
            }
            node(serde_json::json!({"uuid": "u", "instance_uuid": instance, "extra": extra}))
        };
        // (instance, claim mark) → held by site-a.
        let cases = [
            (Some("a1"), Some("a1"), true),
            // Marks from before the claim mark.
            (Some("a1"), None, true),
            // Marked while our allocation was being placed; another client got the node.
            (Some("b7"), Some("a1"), false),
            (None, Some("a1"), false),
        ];
        for (instance, claim, held) in cases {
            let n = marked(instance, claim);
            assert_eq!(held_by(&n, "site-a"), held, "{instance:?} {claim:?}");
        }
        assert!(!held_by(&marked(Some("a1"), Some("a1")), "site-b"));
    }

    #[test]
    fn selectors_match_every_criterion_set() {
        let n = node(
            serde_json::json!({"uuid": "u", "resource_class": "gpu", "owner": "p1", "extra": {"pool": "shepherd"}}),
        );
        assert!(Selector::default().matches(&n));
        let mut s = Selector {
            resource_class: Some("gpu".into()),
            extra: Some(("pool".into(), "shepherd".into())),
            ..Default::default()
        };
        assert!(s.matches(&n));
        s.owner = Some("p2".into());
        assert!(!s.matches(&n));
        s.owner = None;
        s.extra = Some(("pool".into(), "other".into()));
        assert!(!s.matches(&n));
        // Traits: every one asked for must be among the node's; null traits are none.
        let gpu =
            node(serde_json::json!({"uuid": "u", "traits": ["CUSTOM_GPU", "HW_CPU_X86_AVX2"]}));
        let bare = node(serde_json::json!({"uuid": "u", "traits": null}));
        let traits = |t: &[&str]| Selector {
            traits: t.iter().map(|t| t.to_string()).collect(),
            ..Default::default()
        };
        assert!(traits(&["CUSTOM_GPU"]).matches(&gpu));
        assert!(traits(&["CUSTOM_GPU", "HW_CPU_X86_AVX2"]).matches(&gpu));
        assert!(!traits(&["CUSTOM_GPU", "CUSTOM_FPGA"]).matches(&gpu));
        assert!(!traits(&["CUSTOM_GPU"]).matches(&bare));
        assert!(traits(&[]).matches(&bare));
        assert_eq!(
            Selector {
                owner: Some("p1".into()),
                ..Default::default()
            }
            .query(),
            vec![("owner", "p1")]
        );
    }

    #[test]
    fn conductor_groups_match_in_any_case_and_bad_values_fail_at_start_up() {
        let n = node(serde_json::json!({"uuid": "u", "conductor_group": "rack-a"}));
        let given = Selector {
            conductor_group: Some("Rack-A".into()),
            ..Default::default()
        };
        assert!(given.matches(&n), "matched as given");
        let sent = given.normalized().unwrap();
        assert_eq!(sent.query(), vec![("conductor_group", "rack-a")]);
        assert!(sent.matches(&n));
        for (bad, setting) in [
            (
                Selector {
                    conductor_group: Some("rack a".into()),
                    ..Default::default()
                },
                "ironic-conductor-group",
            ),
            (
                Selector {
                    resource_class: Some("x".repeat(81)),
                    ..Default::default()
                },
                "ironic-resource-class",
            ),
            (
                Selector {
                    owner: Some(String::new()),
                    ..Default::default()
                },
                "ironic-owner",
            ),
            (
                Selector {
                    traits: vec!["custom_gpu".into()],
                    ..Default::default()
                },
                "ironic-trait",
            ),
        ] {
            let e = bad.normalized().unwrap_err();
            assert!(e.to_string().contains(setting), "{e}");
        }
    }

    #[test]
    fn allocation_names_are_one_per_deployment_and_node_and_valid_in_ironic() {
        let name = allocation_name("site-a", "1be26c0b-03f2-4d2e-ae87-c02d7f33c123");
        assert_eq!(name, "shepherd.site-a.1be26c0b-03f2-4d2e-ae87-c02d7f33c123");
        assert_ne!(
            name,
            allocation_name("site-b", "1be26c0b-03f2-4d2e-ae87-c02d7f33c123")
        );
        // Ironic's logical names: RFC 3986 unreserved characters, at most 255.
        let longest = allocation_name(&"d".repeat(64), &"n".repeat(36));
        assert!(longest.len() <= 255);
        assert!(longest
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '~')));
    }

    #[test]
    fn inventory_addresses_skip_loopback_and_prefer_ipv4() {
        let inv = serde_json::json!({"inventory": {"interfaces": [
            {"name": "lo", "ipv4_address": "127.0.0.1"},
            {"name": "eth0", "ipv6_address": "2001:db8::5", "ipv4_address": null},
            {"name": "eth1", "ipv4_address": "192.0.2.7"}
        ]}});
        assert_eq!(inventory_address(&inv).as_deref(), Some("192.0.2.7"));
        let v6 =
            serde_json::json!({"inventory": {"interfaces": [{"ipv6_address": "2001:db8::5"}]}});
        assert_eq!(inventory_address(&v6).as_deref(), Some("2001:db8::5"));
        assert_eq!(inventory_address(&serde_json::json!({})), None);
    }

    #[test]
    fn settings_are_checked() {
        let good = IronicConfig::new("site-a", "ssh-ed25519 AAAA k");
        assert!(good.validate().is_ok());
        let mut c = good.clone();
        c.deployment = "has space".into();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("ironic-deployment:"));
        let mut c = good.clone();
        c.image = Some(Image {
            url: "no-scheme.qcow2".into(),
            checksum: "abc".into(),
        });
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("ironic-image:"));
        let mut c = good;
        c.address_field = None;
        c.address_from_inventory = false;
        assert!(c.validate().is_err());
    }
}
