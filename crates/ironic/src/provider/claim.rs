//! How the Ironic provider claims a node: through an allocation named after this deployment
//! and the node ([`allocation_name`]), placed by Ironic's conductor, then marked as ours; a
//! node without a resource class by setting its `instance_uuid`. A claim cut short is found
//! again by its name or its marks and finished or released; a failed allocation is deleted.

use std::time::Duration;

use shepherd_bmdb::Lease;
use shepherd_provider::ProviderError;
use shepherd_retry::Delays;

use super::{
    allocation_name, api, IronicError, IronicProvider, CLAIM_KEY, DEPLOYMENT_KEY, RESERVED_AT_KEY,
};
use crate::client::{ApiError, Conflict};
use crate::model::{Allocation, Node, PatchOp};

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
    /// Reserves node `uuid` for this deployment. A node with a resource class (every node
    /// Ironic can schedule has one) is claimed through an allocation ([`Self::allocate`]),
    /// then marked as ours with one patch ([`Self::mark`]). A node without one cannot be
    /// allocated, and is reserved as before allocations: one patch that sets a fresh
    /// `instance_uuid` with the marks.
    pub(super) async fn reserve(
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
        if lease.may_start("unmark node").is_err() {
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
            lease.may_start("create allocation")?;
            let created = match self.client.create_allocation(body.clone()).await {
                Ok(a) => a,
                Err(ApiError::Conflict { message, .. }) => {
                    return Err(self.name_taken(&name, &message, lease).await);
                }
                Err(e) if !e.not_applied() && e.transient() => {
                    // It may have been made; if so, a later listing finds it by its name.
                    return Err(ProviderError::NotYet(format!(
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
                    lease.may_start("mark node")?;
                    return Ok(self.mark(uuid, &a.uuid).await?);
                }
                Settled::Placed(failed) => failed,
                Settled::Vanished => {
                    return Err(ProviderError::NotYet(format!(
                        "allocation {name} was deleted before it was seen placed (another replica found it failed, or an operator deleted it); a later pass claims the node again"
                    )));
                }
            };
            // A failed allocation left behind is deleted by the node's next claim.
            lease.may_start("delete allocation")?;
            if let Err(e) = self.client.delete_allocation(&placed.uuid).await {
                tracing::warn!(node = uuid, allocation = placed.uuid, error = %e, "deleting a failed allocation failed; the next claim of the node deletes it");
            }
            let last_error = placed.last_error.unwrap_or_else(|| "no last_error".into());
            if last_error.contains(NODE_LOCKED) {
                // Busy, not unfit: a conductor holds the node (a periodic task, an operation
                // in flight) past Ironic's own retries. Not skipped; the next pass tries again.
                return Err(ProviderError::NotYet(format!(
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
            tokio::time::sleep(ALLOCATION_RETRY.delay(attempt - 1)).await;
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
            lease.may_start("mark node")?;
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
                if lease.may_start("delete allocation").is_err() {
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
                if let Err(lost) = lease.may_start("delete allocation") {
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
                ProviderError::NotYet(format!(
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
    pub(super) async fn partial_claim(&self, node: &Node) -> Result<Option<Allocation>, ApiError> {
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
    pub(super) async fn finish_partial_claim(&self, node: &Node) -> Result<Node, ProviderError> {
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
    pub(super) async fn release(&self, node: &Node) -> Result<(), ApiError> {
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

/// The waits between those attempts: the one retry arithmetic, 100–200 ms before the second
/// and 200–400 ms before the third.
const ALLOCATION_RETRY: Delays = Delays::new(Duration::from_millis(200), Duration::from_secs(2));

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
