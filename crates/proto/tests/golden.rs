//! Golden bytes: the encoding of each wire message is pinned to bytes written out by hand from
//! the field numbers of design.md §11, so a renumbered or retyped field fails here rather than in a
//! mixed fleet of upstream and Shepherd components.

use shepherd_proto::agent::*;
use shepherd_proto::bmaas::*;
use shepherd_proto::Message;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn pin<M: Message + Default + PartialEq + std::fmt::Debug>(m: M, golden: &str) {
    let want = hex(golden);
    assert_eq!(m.encode_to_vec(), want, "{m:?}");
    assert_eq!(M::decode(want.as_slice()).unwrap(), m);
}

fn init() -> TakeoverInit {
    TakeoverInit {
        machine_id: "m".into(),
        bmaas_endpoint: "e".into(),
        ca_certificate: vec![1],
        ..Default::default()
    }
}

#[test]
fn takeover_messages() {
    pin(init(), "0a016d 120165 1a0101");
    pin(
        TakeoverResponse {
            result: Some(takeover_response::Result::Success(TakeoverSuccess {
                init_message: Some(init()),
                key: vec![2],
                warning: vec!["w".into()],
                ..Default::default()
            })),
        },
        "0a11 0a09 0a016d120165 1a0101 120102 1a0177",
    );
    pin(
        TakeoverResponse {
            result: Some(takeover_response::Result::Error(TakeoverError {
                message: "x".into(),
            })),
        },
        "1203 0a0178",
    );
}

#[test]
fn hardware_report_messages() {
    pin(
        BlockDevice {
            capacity_bytes: 5,
            protocol: block_device::Protocol::Nvme as i32,
            media_errors: Some(0), // optional: present even when zero
            ..Default::default()
        },
        "3005 4803 5800",
    );
    pin(
        NetworkInterface {
            mac: vec![0xaa],
            link_up: true,
            supported_speed_bytes: vec![1, 2],
            ..Default::default()
        },
        "0a01aa 1a020102 2001",
    );
}

#[test]
fn heartbeat_messages() {
    let node = Node {
        manufacturer: "a".into(),
        memory_installed_bytes: 1,
        cpu: vec![Cpu {
            architecture: Some(cpu::Architecture::X8664(cpu::X8664 {
                family: 6,
                ..Default::default()
            })),
            cores: 2,
            ..Default::default()
        }],
        efi_support: EfiSupport::Enabled as i32,
        ..Default::default()
    };
    pin(
        HeartbeatRequest {
            machine_id: "m".into(),
            hardware_report: Some(AgentHardwareReport {
                report: Some(node),
                warning: vec!["w".into()],
            }),
            installation_report: Some(OsInstallationReport {
                generation: 3,
                result: Some(os_installation_report::Result::Error(
                    os_installation_report::Error {
                        error: "e".into(),
                        ..Default::default()
                    },
                )),
                chosen_disk: String::new(),
            }),
        },
        "0a016d \
         1214 0a0f 0a0161 4001 5206 0a020806 4002 6804 120177 \
         1a07 0803 1a03 0a0165",
    );
    pin(
        HeartbeatResponse {
            installation_request: Some(OsInstallationRequest {
                generation: 1,
                r#type: Some(os_installation_request::Type::Image(
                    ImageInstallationRequest {
                        url: "u".into(),
                        sha256: "s".into(),
                        target_device: "d".into(),
                        ..Default::default()
                    },
                )),
            }),
        },
        "0a0d 0801 1a09 0a0175 120173 1a0164",
    );
    pin(
        OsInstallationReport {
            generation: 2,
            result: Some(os_installation_report::Result::Success(
                os_installation_report::Success::default(),
            )),
            chosen_disk: String::new(),
        },
        "0802 1200",
    );
}
