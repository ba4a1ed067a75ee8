//! The Ironic provider's settings: which nodes it may take ([`Selector`]), what a deploy
//! writes ([`Image`]) and the rest of [`IronicConfig`], each checked at start-up.

use std::time::Duration;

use shepherd_provider::settings::InvalidSetting;

use crate::model::Node;

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
    pub(super) fn query(&self) -> Vec<(&'static str, &str)> {
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

/// Deploy interfaces that write an image, and fail without one.
const WRITES_AN_IMAGE: &[&str] = &["direct", "ansible", "anaconda"];

/// Refuses a start without `--ironic-image` when an `available` node the selector matches
/// deploys with an interface that writes an image: every deploy of it would be refused. With
/// `from_node` (`--ironic-image-from-node`), only such nodes whose `instance_info` names no
/// `image_source` are refused.
pub(super) fn needs_no_image(
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
