//! The model of a bare machine's way from a BMC and empty disks to its installed OS (design.md
//! §21): the phase it is in (`machine_bare_metal`), each step it took (`bare_metal_history`),
//! and what the media server needs to hand its BMC the live image. The SQL is in
//! `sql/bare_metal.rs`; the loop that moves machines along, in `crates/loops/src/bare_metal.rs`.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::model::text_enum;
use crate::Error;

text_enum! {
    /// Where a bare machine stands. The bare-metal loop moves it along; each phase is entered
    /// in a transaction that also checks the loop still holds the machine's work and that the
    /// phase is still the one it read, before the BMC side effects of the next phase.
    BarePhase {
        /// Waiting for a live boot: nothing is done yet, or an attempt was undone.
        Bare,
        /// A media token was chosen: the machine is powered off and the live image inserted
        /// as virtual media.
        Inserting,
        /// The live image is inserted and the machine off: a one-time boot from the virtual CD
        /// is set and the machine powered on (only if it is still off: the step is done once).
        StartingLive,
        /// Powered on into the live environment: the initializer takes it over.
        LiveBoot,
        /// The agent in the live environment was asked to install the OS.
        Installing,
        /// The OS is on the disk: the media is ejected and the machine powered off.
        Ejecting,
        /// The disk is set as the boot device from now on and the machine powered on (only
        /// if it is still off).
        StartingDisk,
        /// Booting its installed OS: the initializer takes it over again.
        DiskBoot,
        /// Heartbeating from its installed OS. Only an operator's reimage moves it on.
        Done,
        /// Given up on, with the cause in its history; an operator decides (reimage).
        Failed,
    }
}

impl BarePhase {
    /// The phases in which the machine runs something the initializer may take over over SSH
    /// (its live environment, its installed OS); in the others its agent is not started.
    pub const TAKEOVER: [BarePhase; 3] =
        [BarePhase::LiveBoot, BarePhase::DiskBoot, BarePhase::Done];

    /// Whether the machine is on its way (not done, not given up on).
    pub fn is_open(self) -> bool {
        !matches!(self, BarePhase::Done | BarePhase::Failed)
    }
}

/// The `machine_bare_metal` tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BareMetal {
    /// Where it stands.
    pub phase: BarePhase,
    /// When it entered that phase (the database's clock).
    pub phase_at: DateTime<Utc>,
    /// Live boots begun since it was recorded bare or reimaged.
    pub attempts: i32,
    /// The secret of its live image's URL, while the BMC may fetch it.
    pub media_token: Option<String>,
    /// Until when the URL may be fetched.
    pub media_expires_at: Option<DateTime<Utc>>,
    /// Its config drive's files (JSON), as the media server splices them into the image.
    pub config: Option<String>,
    /// The URL secret of the grant during which an installation began writing its disk before
    /// the image's server failed: during that grant's live boot (while it is `media_token`),
    /// Shepherd may write the disk again without a wipe permission.
    pub rewrite_grant: Option<String>,
    /// Root device hints (JSON) naming by its serial and WWN the disk the agent chose during
    /// this way, as its report gave them: later requests of the way name the disk so.
    pub chosen_disk: Option<String>,
    /// Who allowed its disk to be overwritten besides its inventory entry (an operator's
    /// reimage), if anyone.
    pub wipe_by: Option<String>,
    /// The installation generation it was asked to install.
    pub install_generation: Option<i64>,
}

/// What entering a phase writes besides the phase, its time and a history entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PhaseWrites {
    /// A live boot begins: the attempt count goes up by one.
    pub count_attempt: bool,
    /// The media URL's secret and until when it may be fetched, with the config drive;
    /// `Some(None)` revokes the URL.
    pub media: Option<Option<MediaGrant>>,
    /// The installation generation asked for.
    pub install_generation: Option<i64>,
    /// Forget what tied the machine to the system it ran until now: its agent's tags, its
    /// heartbeat and its pinned SSH host key (a live environment and an installed OS have
    /// host keys of their own), and, with `installation`, its installation request and report.
    pub forget_system: Option<ForgetSystem>,
    /// Shepherd began writing the disk during the current grant ([`BareMetal::rewrite_grant`]).
    pub began_writing: bool,
    /// The disk the agent chose, by its identity ([`BareMetal::chosen_disk`]); `None` keeps
    /// what is recorded.
    pub chosen_disk: Option<String>,
}

/// What [`PhaseWrites::forget_system`] forgets besides the agent, its heartbeat and the host
/// key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForgetSystem {
    /// Also the installation request and report: the installation is done (or undone), and
    /// the initializer takes the machine over again.
    pub installation: bool,
}

/// What a BMC is given to fetch: a machine's live image URL secret, until a time, and its
/// config drive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaGrant {
    /// The URL's secret (hex, 64 digits).
    pub token: String,
    /// Until when it may be fetched.
    pub expires_at: DateTime<Utc>,
    /// The config drive's files, JSON.
    pub config: String,
}

impl MediaGrant {
    /// A fresh grant of `config` for `ttl` from `now`, with 256 random bits as its secret.
    pub fn new(config: String, now: DateTime<Utc>, ttl: std::time::Duration) -> MediaGrant {
        let token = format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple());
        let ttl = chrono::TimeDelta::from_std(ttl).unwrap_or(chrono::TimeDelta::MAX);
        MediaGrant {
            token,
            expires_at: now
                .checked_add_signed(ttl)
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
            config,
        }
    }

    /// The proof of the live environment this grant boots: what its config drive gives the
    /// agent (`SHEPHERD_AGENT_LIVE_PROOF`) and the agent shows at its takeover, so that an
    /// installation is asked only of the live environment of this live boot, never of an
    /// installed OS the CD boot fell through to (design.md §21). Derived from the URL's
    /// secret, so it lives and ends with the grant; a different value, so that the proof an
    /// agent shows opens no URL.
    pub fn live_proof(&self) -> String {
        live_proof_of(&self.token)
    }
}

/// [`MediaGrant::live_proof`] of the grant whose URL secret is `token`.
pub fn live_proof_of(token: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("shepherd live environment proof\n{token}").as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// One step of a bare machine's way: the phase it entered, when, by which session, and what
/// was done or found (the BMC's answer, the image, who allowed a wipe).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BareHistoryEntry {
    /// Ordering key.
    pub id: i64,
    /// When, in the database's clock: the time spent in the phase before is the time between
    /// this entry and the one before it.
    pub at: DateTime<Utc>,
    /// The machine.
    pub machine_id: Uuid,
    /// The phase entered.
    pub phase: BarePhase,
    /// The session that moved it, if a loop did (none when the provisioner recorded it or an
    /// operator reimaged it).
    pub session_id: Option<Uuid>,
    /// What was done or found.
    pub detail: String,
}

/// Longest detail kept for a history entry; longer ones are cut at a character boundary.
pub const MAX_DETAIL_LEN: usize = 2048;

/// Why a phase could not be entered although the BMDB answered.
pub(crate) fn phase_moved(machine: Uuid, expected: BarePhase, found: Option<BarePhase>) -> Error {
    Error::BarePhaseMoved {
        machine,
        expected: expected.as_str(),
        found: found.map(BarePhase::as_str),
    }
}
