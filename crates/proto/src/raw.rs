//! The server's view of a heartbeat: the same wire message as `bmaas::HeartbeatRequest`, with
//! its two reports kept as the bytes the agent sent. prost drops fields it does not know when
//! it decodes, so a report decoded and encoded again would lose what a newer agent added; the
//! server decodes these bytes only to validate them and stores them as they came.
//!
//! A report field sent twice in one request is merged by a full decode; here the last one is
//! kept. Agents send each report once.

/// `cloud.bmaas.server.api.HeartbeatRequest`, reports as received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeartbeatRequest {
    /// Field 1: the machine the agent speaks for.
    #[prost(string, tag = "1")]
    pub machine_id: String,
    /// Field 2: an encoded `AgentHardwareReport`, if sent.
    #[prost(bytes = "vec", optional, tag = "2")]
    pub hardware_report: Option<Vec<u8>>,
    /// Field 3: an encoded `OSInstallationReport`, if sent.
    #[prost(bytes = "vec", optional, tag = "3")]
    pub installation_report: Option<Vec<u8>>,
}

#[allow(missing_docs, clippy::all)]
mod generated {
    include!(concat!(
        env!("OUT_DIR"),
        "/cloud.bmaas.server.api.AgentCallback.rs"
    ));
}

/// The server trait and service of `AgentCallback` over [`HeartbeatRequest`].
pub use generated::agent_callback_server;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bmaas;
    use prost::Message;

    /// An encoded full request decodes here with each report's bytes exactly as encoded, and
    /// fields this build does not know survive in them.
    #[test]
    fn reports_keep_their_bytes() {
        let report = bmaas::AgentHardwareReport {
            report: None,
            warning: vec!["x".into()],
        };
        let mut report_bytes = report.encode_to_vec();
        // Field 99, a varint of 7: unknown to every build.
        report_bytes.extend([0x98, 0x06, 0x07]);
        let mut wire = Vec::new();
        prost::encoding::string::encode(1, &"m".to_string(), &mut wire);
        prost::encoding::bytes::encode(2, &report_bytes, &mut wire);
        let raw = HeartbeatRequest::decode(wire.as_slice()).unwrap();
        assert_eq!(
            raw.hardware_report.as_deref(),
            Some(report_bytes.as_slice())
        );
        let typed = bmaas::HeartbeatRequest::decode(wire.as_slice()).unwrap();
        assert_eq!(
            typed.hardware_report.unwrap().encode_to_vec().len() + 3,
            report_bytes.len()
        );
    }
}
