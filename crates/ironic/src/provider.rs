//! The OpenStack Ironic provider (design.md §19): Ironic's node state machine mapped onto
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
use shepherd_bmdb::{Lease, ProviderKind, ProviderStatus, Session};
use shepherd_provider::settings::InvalidSetting;
use shepherd_provider::{
    record_deploying_machine, ApiFailure, Availability, HandBack, Provider, ProviderError,
    ProviderMachine, Rebooter, Recorded,
};

use crate::client::{ApiError, Client};
use crate::model::Node;
use crate::placement::PlacementEstimate;

mod claim;
mod config;
mod deploy;

use config::needs_no_image;
pub use config::{Image, IronicConfig, Selector};

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
        lease: &Lease,
        machine: &ProviderMachine,
        undeploy: bool,
    ) -> Result<HandBack, ProviderError> {
        let id = machine.valid_id().ok_or(ProviderError::NotSupported(
            "handing back a machine without an id",
        ))?;
        self.hand_back_node(lease, id, undeploy).await
    }

    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        // Each step at Ironic is taken only while the lease holds; one cut short by its end
        // leaves an orphan that a later pass (of whichever replica) adopts.
        let lease = session.lease();
        lease.may_start("create machine")?;
        let node = match unused.valid_id() {
            // An orphan: reserved by this deployment, unknown to the BMDB.
            Some(id) => {
                let node = self.read_node(id).await?;
                lease.may_start("adopt node")?;
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
                    lease.may_start("deploy")?;
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
                lease.may_start("deploy")?;
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
impl Rebooter for IronicProvider {
    async fn reboot(&self, lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError> {
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
        lease.may_start("reset")?;
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
