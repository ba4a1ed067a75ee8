//! How the Ironic provider deploys a node it holds (to `active`, with a config drive carrying
//! Shepherd's SSH key and the node's network) and hands a decommissioned one back (released,
//! and torn down when asked).

use shepherd_bmdb::Lease;
use shepherd_provider::{HandBack, ProviderError};

use super::{api, IronicProvider};
use crate::client::ApiError;
use crate::model::Node;

impl IronicProvider {
    /// Hands a decommissioned node back: released, then torn down when `undeploy`. A node in
    /// a transition (still deploying) is left for the next pass. Ironic clears
    /// `instance_uuid` when it tears a node down but not our mark in `extra`, so the node is
    /// released first; a tear-down request that then fails for good is logged by the
    /// provisioner and left to the operator (the node is no longer ours to retry). The release
    /// and the tear-down each start only while `lease` holds.
    pub(super) async fn hand_back_node(
        &self,
        lease: &Lease,
        uuid: &str,
        undeploy: bool,
    ) -> Result<HandBack, ProviderError> {
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
        lease.may_start("release node")?;
        self.release(&node)
            .await
            .map_err(api("release_node", uuid))?;
        let deployed = !matches!(node.state(), "available" | "manageable" | "enroll");
        if undeploy && deployed {
            lease.may_start("undeploy node")?;
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
    pub(super) async fn deploy(&self, node: &Node) -> Result<(), ProviderError> {
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
