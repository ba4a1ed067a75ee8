//! Ironic's resources as the provider reads them: nodes (only the fields it asks for), JSON
//! patches, microversions and error bodies.

use serde::{Deserialize, Serialize};
use shepherd_bmdb::ProviderFacts;

/// The node fields every read asks for (`?fields=`), so that listings stay small. Not
/// `allocation_uuid`: Ironic 39 answers a listing that asks for it with a 500; a node held by
/// an allocation has the allocation's id as its `instance_uuid`.
pub const NODE_FIELDS: &str = "uuid,name,provision_state,provision_updated_at,target_provision_state,maintenance,maintenance_reason,instance_uuid,extra,resource_class,conductor_group,owner,last_error,power_state,properties,driver,deploy_interface,traits";

/// The allocation fields every read asks for.
pub const ALLOCATION_FIELDS: &str = "uuid,name,state,node_uuid,last_error,created_at";

/// An API microversion, `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ApiVersion {
    /// Always 1 so far.
    pub major: u32,
    /// The microversion proper.
    pub minor: u32,
}

impl std::fmt::Display for ApiVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl std::str::FromStr for ApiVersion {
    type Err = BadMicroversion;
    fn from_str(s: &str) -> Result<Self, BadMicroversion> {
        let parsed = s.split_once('.').and_then(|(major, minor)| {
            Some(ApiVersion {
                major: major.parse().ok()?,
                minor: minor.parse().ok()?,
            })
        });
        parsed.ok_or_else(|| BadMicroversion(s.to_string()))
    }
}

/// A microversion that is not `MAJOR.MINOR`.
#[derive(Debug, thiserror::Error)]
#[error("microversion {0:?} is not MAJOR.MINOR")]
pub struct BadMicroversion(String);

impl ApiVersion {
    /// The range `GET /v1/` announces: `{"version": {"min_version": "1.1", "version": "1.115"}}`.
    pub fn range_of(root: &serde_json::Value) -> Option<(ApiVersion, ApiVersion)> {
        let v = root.get("version")?;
        let min = v.get("min_version")?.as_str()?.parse().ok()?;
        let max = v.get("version")?.as_str()?.parse().ok()?;
        Some((min, max))
    }
}

/// A node, with the fields of [`NODE_FIELDS`].
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Node {
    /// Ironic's id of the node; Shepherd's provider id.
    pub uuid: String,
    /// The operator's name for it.
    #[serde(default)]
    pub name: Option<String>,
    /// Where it is in Ironic's state machine (`available`, `deploying`, `active`, …).
    #[serde(default)]
    pub provision_state: Option<String>,
    /// When `provision_state` last changed.
    #[serde(default)]
    pub provision_updated_at: Option<chrono::DateTime<chrono::FixedOffset>>,
    /// Where a transition in progress is going.
    #[serde(default)]
    pub target_provision_state: Option<String>,
    /// Whether an operator (or Ironic) took the node out of service.
    #[serde(default)]
    pub maintenance: bool,
    /// Why.
    #[serde(default)]
    pub maintenance_reason: Option<String>,
    /// Who reserved it (a compare-and-set field: a second client's value is refused).
    #[serde(default)]
    pub instance_uuid: Option<String>,
    /// Free-form operator data.
    #[serde(default)]
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// The node's resource class.
    #[serde(default)]
    pub resource_class: Option<String>,
    /// The conductor group serving it ("" for none).
    #[serde(default)]
    pub conductor_group: Option<String>,
    /// The project owning it.
    #[serde(default)]
    pub owner: Option<String>,
    /// The error of the last failed operation.
    #[serde(default)]
    pub last_error: Option<String>,
    /// `power on`, `power off`, or none while unknown.
    #[serde(default)]
    pub power_state: Option<String>,
    /// Hardware facts (`cpus`, `memory_mb`, `local_gb`, `cpu_arch`, …).
    #[serde(default)]
    pub properties: serde_json::Map<String, serde_json::Value>,
    /// The hardware type (`redfish`, `ipmi`, `fake-hardware`, …).
    #[serde(default)]
    pub driver: Option<String>,
    /// How Ironic deploys it (`direct`, `ramdisk`, `fake`, …).
    #[serde(default)]
    pub deploy_interface: Option<String>,
    /// What the deploy uses (`image_source`, …); read only at start-up (see
    /// [`crate::Client::list_nodes_with`]), empty otherwise.
    #[serde(default)]
    pub instance_info: serde_json::Map<String, serde_json::Value>,
    /// The node's traits (`CUSTOM_GPU`, `HW_CPU_X86_AVX2`, …).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub traits: Vec<String>,
}

/// `null` read as an empty list (Ironic sends `null` for a node without traits).
fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(Option::<Vec<String>>::deserialize(d)?.unwrap_or_default())
}

/// A port of a node (`/v1/ports`): one of its network interfaces.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Port {
    /// The port's id.
    pub uuid: String,
    /// Its MAC address.
    pub address: String,
}

/// A page of `GET /v1/ports`.
#[derive(Debug, Deserialize)]
pub struct PortList {
    /// The ports.
    pub ports: Vec<Port>,
}

/// An allocation (`/v1/allocations`): Ironic's reservation of one node for one instance. Its
/// id becomes the node's `instance_uuid`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Allocation {
    /// The allocation's id.
    pub uuid: String,
    /// Its unique name.
    #[serde(default)]
    pub name: Option<String>,
    /// `allocating`, `active` or `error`.
    pub state: String,
    /// The node it holds, once `active`.
    #[serde(default)]
    pub node_uuid: Option<String>,
    /// Why it is in `error`.
    #[serde(default)]
    pub last_error: Option<String>,
    /// When it was created.
    #[serde(default)]
    pub created_at: Option<chrono::DateTime<chrono::FixedOffset>>,
}

impl Node {
    /// What the node says about its hardware, for the BMDB: the resource class, hardware
    /// type and conductor group, then every scalar of `properties` (`cpus`, `memory_mb`,
    /// `local_gb`, `cpu_arch`, …) under its own name, as far as the bounds of
    /// [`ProviderFacts`] allow. Nested properties (`root_device` hints) are left out.
    pub fn facts(&self) -> ProviderFacts {
        let mut facts = ProviderFacts::default();
        for (name, value) in [
            ("resource_class", &self.resource_class),
            ("driver", &self.driver),
            ("conductor_group", &self.conductor_group),
        ] {
            if let Some(v) = value.as_deref().filter(|v| !v.is_empty()) {
                facts.insert(name, v);
            }
        }
        for (name, value) in &self.properties {
            let text = match value {
                serde_json::Value::String(s) if !s.is_empty() => s.clone(),
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => b.to_string(),
                _ => continue,
            };
            if facts.get(name).is_none() {
                facts.insert(name, &text);
            }
        }
        facts
    }

    /// The provision state, `""` when Ironic sent none.
    pub fn state(&self) -> &str {
        self.provision_state.as_deref().unwrap_or("")
    }

    /// The value at a dotted path (`extra.ssh_address`, `properties.location`) of the fields
    /// read, as text; `None` if absent, empty or not a string or number.
    pub fn field(&self, path: &str) -> Option<String> {
        let (top, rest) = path.split_once('.').unwrap_or((path, ""));
        let mut value = match top {
            "extra" => serde_json::Value::Object(self.extra.clone()),
            "properties" => serde_json::Value::Object(self.properties.clone()),
            "name" => serde_json::Value::from(self.name.clone()),
            "resource_class" => serde_json::Value::from(self.resource_class.clone()),
            "conductor_group" => serde_json::Value::from(self.conductor_group.clone()),
            "owner" => serde_json::Value::from(self.owner.clone()),
            _ => return None,
        };
        for key in rest.split('.').filter(|k| !k.is_empty()) {
            value = value.get(key)?.clone();
        }
        match value {
            serde_json::Value::String(s) if !s.is_empty() => Some(s),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    }
}

/// A page of `GET /v1/nodes`.
#[derive(Debug, Deserialize)]
pub struct NodeList {
    /// The nodes.
    pub nodes: Vec<Node>,
    /// The next page's address, when there is one.
    #[serde(default)]
    pub next: Option<String>,
}

/// One operation of a JSON patch (RFC 6902), as Ironic's `PATCH /v1/nodes/{id}` takes them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PatchOp {
    /// `add`, `replace` or `remove`.
    pub op: &'static str,
    /// The field (`/instance_uuid`, `/extra/key`).
    pub path: String,
    /// The new value (absent for `remove`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
}

impl PatchOp {
    /// Sets `path` to `value`.
    pub fn add(path: impl Into<String>, value: impl Into<serde_json::Value>) -> PatchOp {
        PatchOp {
            op: "add",
            path: path.into(),
            value: Some(value.into()),
        }
    }

    /// Removes `path`.
    pub fn remove(path: impl Into<String>) -> PatchOp {
        PatchOp {
            op: "remove",
            path: path.into(),
            value: None,
        }
    }
}

/// Ironic's error body: `{"error_message": "<JSON text with faultstring>"}`.
#[derive(Debug, Deserialize)]
pub struct ErrorBody {
    error_message: serde_json::Value,
}

impl ErrorBody {
    /// The explanation in an error answer: the fault string, else the start of the body.
    pub fn message_of(body: &[u8]) -> String {
        let fault = serde_json::from_slice::<ErrorBody>(body)
            .ok()
            .and_then(|b| match b.error_message {
                serde_json::Value::String(inner) => {
                    serde_json::from_str::<serde_json::Value>(&inner)
                        .ok()
                        .and_then(|v| v.get("faultstring")?.as_str().map(String::from))
                        .or(Some(inner))
                }
                other => other
                    .get("faultstring")
                    .and_then(|f| f.as_str())
                    .map(String::from),
            });
        let text = fault.unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
        let text = text.trim();
        match text.char_indices().nth(300) {
            Some((cut, _)) => format!("{}…", &text[..cut]),
            None => text.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_order() {
        let root =
            serde_json::json!({"id": "v1", "version": {"min_version": "1.1", "version": "1.115"}});
        let (min, max) = ApiVersion::range_of(&root).unwrap();
        assert_eq!(min.to_string(), "1.1");
        assert_eq!(max.to_string(), "1.115");
        assert!(max > "1.81".parse().unwrap(), "1.115 is newer than 1.81");
        assert!("1.9".parse::<ApiVersion>().unwrap() < "1.81".parse().unwrap());
        assert!("1".parse::<ApiVersion>().is_err());
    }

    #[test]
    fn fields_are_read_by_dotted_path() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "uuid": "u", "provision_state": "available",
            "provision_updated_at": "2026-11-25T11:46:18.472046+00:00",
            "extra": {"ssh_address": "127.0.0.1:2222", "rack": {"row": 7}, "empty": ""},
            "properties": {"cpus": 8}, "conductor_group": ""
        }))
        .unwrap();
        assert_eq!(
            node.field("extra.ssh_address").as_deref(),
            Some("127.0.0.1:2222")
        );
        assert_eq!(node.field("extra.rack.row").as_deref(), Some("7"));
        assert_eq!(node.field("properties.cpus").as_deref(), Some("8"));
        assert_eq!(node.field("extra.empty"), None);
        assert_eq!(node.field("conductor_group"), None);
        assert_eq!(node.field("instance_info.x"), None);
        assert!(node.provision_updated_at.is_some());
    }

    #[test]
    fn error_bodies_give_the_fault_string() {
        let body = br#"{"error_message": "{\"faultcode\": \"Client\", \"faultstring\": \"Node x is locked by host h.\", \"debuginfo\": null}"}"#;
        assert_eq!(ErrorBody::message_of(body), "Node x is locked by host h.");
        assert_eq!(ErrorBody::message_of(b"plain text"), "plain text");
        let long = "y".repeat(1000);
        assert_eq!(ErrorBody::message_of(long.as_bytes()).chars().count(), 301);
    }
}
