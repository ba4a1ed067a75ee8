//! What an agent's installation report says (design.md §21), read once from the bytes the
//! BMDB keeps. Every text of the agent's becomes one bounded line: it goes into a log line
//! and the machine's history, where a newline or an escape sequence of its own would forge a
//! line or move a terminal. The disk the agent chose is kept only as valid root device hints.

use shepherd_disks::RootDeviceHints;
use shepherd_proto::bmaas as proto;
use shepherd_proto::Message;

/// How long the agent's cause of a failure may be, in characters.
const MAX_CAUSE_CHARS: usize = 500;

/// How long the agent's texts of a success may be, in characters.
const MAX_WRITTEN_CHARS: usize = 300;

/// How long the hints naming the chosen disk may be, in bytes.
const MAX_CHOSEN_DISK_BYTES: usize = 1024;

/// An agent's installation report, as far as Shepherd reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InstallReport {
    /// The disk the image was written onto, with the facts it was chosen by (a success).
    pub written_onto: Option<String>,
    /// What the wipe before the image cleared (a success).
    pub wiped: Option<String>,
    /// The config drive added after the image (a success).
    pub config_drive: Option<String>,
    /// Why it failed (a failure).
    pub failure: ReportedFailure,
    /// Root device hints naming the disk the agent chose by its identity, if it chose one
    /// that has a serial or WWN.
    pub chosen_disk: Option<String>,
}

/// What an agent's report of a failed installation says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReportedFailure {
    /// Its error, one line, bounded.
    pub cause: String,
    /// The image's server failed, not the machine: it may be asked again.
    pub unavailable: bool,
    /// The agent had begun writing the disk.
    pub disk_written: bool,
    /// With `unavailable`, the installations in a row that failed so.
    pub in_a_row: u32,
}

/// Reads `report_raw`, an `OSInstallationReport` as the BMDB keeps it.
pub(crate) fn read(report_raw: &[u8]) -> InstallReport {
    let mut report = InstallReport {
        written_onto: None,
        wiped: None,
        config_drive: None,
        failure: ReportedFailure {
            cause: "the agent's report gives no reason".into(),
            unavailable: false,
            disk_written: false,
            in_a_row: 0,
        },
        chosen_disk: None,
    };
    let Ok(decoded) = proto::OsInstallationReport::decode(report_raw) else {
        return report;
    };
    let line = |text: &str, max| (!text.is_empty()).then(|| shepherd_bmdb::one_line_cut(text, max));
    report.chosen_disk = Some(decoded.chosen_disk)
        .filter(|hints| hints.len() <= MAX_CHOSEN_DISK_BYTES)
        .filter(|hints| RootDeviceHints::from_json(hints).is_ok());
    match decoded.result {
        Some(proto::os_installation_report::Result::Success(s)) => {
            report.written_onto = line(&s.written_onto, MAX_WRITTEN_CHARS);
            report.wiped = line(&s.wiped, MAX_WRITTEN_CHARS);
            report.config_drive = line(&s.config_drive, MAX_WRITTEN_CHARS);
        }
        Some(proto::os_installation_report::Result::Error(e)) => {
            report.failure = ReportedFailure {
                cause: shepherd_bmdb::one_line_cut(&e.error, MAX_CAUSE_CHARS),
                unavailable: e.unavailable,
                disk_written: e.disk_written,
                in_a_row: e.unavailable_in_a_row,
            };
        }
        None => {}
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(error: String) -> Vec<u8> {
        proto::OsInstallationReport {
            result: Some(proto::os_installation_report::Result::Error(
                proto::os_installation_report::Error {
                    error,
                    ..Default::default()
                },
            )),
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn an_agents_error_is_one_bounded_line() {
        let forged = "disk full\n2030-01-01T00:00:00Z WARN forged\x1b[2K\x1b[1A".to_string();
        assert_eq!(
            read(&failed(forged)).failure.cause,
            "disk full\\n2030-01-01T00:00:00Z WARN forged\\u{1b}[2K\\u{1b}[1A"
        );
        let long = read(&failed("x".repeat(10_000))).failure.cause;
        assert_eq!(
            long.chars().count(),
            501,
            "500 characters and the mark of the cut"
        );
        assert_eq!(
            read(b"\xff").failure.cause,
            "the agent's report gives no reason"
        );
    }

    #[test]
    fn the_chosen_disk_is_kept_only_as_valid_bounded_hints() {
        let chosen = |chosen_disk: String| {
            let raw = proto::OsInstallationReport {
                chosen_disk,
                ..Default::default()
            }
            .encode_to_vec();
            read(&raw).chosen_disk
        };
        let pin = r#"{"serial":"s== S3YJNX0K"}"#;
        assert_eq!(chosen(pin.into()).as_deref(), Some(pin));
        assert_eq!(chosen(String::new()), None);
        assert_eq!(chosen(r#"{"colour":"blue"}"#.into()), None);
        assert_eq!(chosen("/dev/sda".into()), None);
        let long = format!(r#"{{"serial":"s== {}"}}"#, "x".repeat(2000));
        assert_eq!(chosen(long), None);
    }
}
