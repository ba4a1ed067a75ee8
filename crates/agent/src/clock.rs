//! The time an agent checks the server's certificate against. A machine's own clock can be
//! wrong by years (a dead RTC battery before NTP runs, a clock set by hand), and TLS rejects
//! a certificate that is not valid *now*: such an agent would never heartbeat, and the
//! recoverer would reboot its machine forever. The takeover gives the agent the Initializer's
//! time (`TakeoverInit.issued_at_unix_millis`), from a host whose clock is kept; the agent
//! counts on from it with its monotonic clock, which does not depend on the wall clock.
//!
//! A certificate is accepted when it is valid at that time, or, failing that for its dates
//! alone, at the machine's own clock (so an agent restarted long after its takeover, whose
//! reference has fallen behind, still accepts a certificate renewed meanwhile when its clock
//! is right). What it gives up: an agent trusts the Initializer's clock as it trusts the CA
//! the Initializer gave it, over the same pinned SSH connection; a certificate that expired
//! between the takeover and now is still accepted while the count since the takeover says it
//! is valid (the monotonic clock stops while a machine is suspended).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio_rustls::rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

/// Where the agent's notion of "now" for certificates comes from.
#[derive(Debug, Clone, Copy)]
pub struct CertificateTime {
    /// The Initializer's time at the takeover, and the instant the agent learned it.
    reference: Option<(Duration, Instant)>,
}

impl CertificateTime {
    /// The machine's own clock only (no takeover time known, as with an upstream Initializer).
    pub fn wall_clock() -> Self {
        CertificateTime { reference: None }
    }

    /// The Initializer's time `issued_at_unix_millis` (0 or less: none sent), counted on from
    /// now with the monotonic clock.
    pub fn from_takeover(issued_at_unix_millis: i64) -> Self {
        let reference = u64::try_from(issued_at_unix_millis)
            .ok()
            .filter(|ms| *ms > 0)
            .map(|ms| (Duration::from_millis(ms), Instant::now()));
        CertificateTime { reference }
    }

    /// The takeover's time counted on to now, if there is one.
    fn trusted_now(&self) -> Option<UnixTime> {
        let (at, learned) = self.reference?;
        Some(UnixTime::since_unix_epoch(at + learned.elapsed()))
    }
}

// Short names for the verifier trait's types.
type Der<'a> = CertificateDer<'a>;
type Name<'a> = ServerName<'a>;
type Dss = DigitallySignedStruct;
type Signed = Result<HandshakeSignatureValid, rustls::Error>;
type Verified = Result<ServerCertVerified, rustls::Error>;

/// Whether `e` rejects a certificate for its dates alone.
fn is_date_error(e: &rustls::Error) -> bool {
    matches!(
        e,
        rustls::Error::InvalidCertificate(
            CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. }
        )
    )
}

/// The web PKI's verification of the server's chain, at the [`CertificateTime`].
#[derive(Debug)]
pub(crate) struct AtCertificateTime {
    inner: Arc<WebPkiServerVerifier>,
    time: CertificateTime,
}

impl AtCertificateTime {
    pub(crate) fn new(inner: Arc<WebPkiServerVerifier>, time: CertificateTime) -> Self {
        AtCertificateTime { inner, time }
    }
}

impl ServerCertVerifier for AtCertificateTime {
    fn verify_server_cert(
        &self,
        leaf: &Der,
        chain: &[Der],
        name: &Name,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Verified {
        let verify = |at| self.inner.verify_server_cert(leaf, chain, name, ocsp, at);
        match self.time.trusted_now() {
            None => verify(now),
            Some(trusted) => match verify(trusted) {
                Err(e) if is_date_error(&e) => verify(now).map_err(|_| e),
                other => other,
            },
        }
    }

    fn verify_tls12_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Dss) -> Signed {
        self.inner.verify_tls12_signature(m, c, d)
    }

    fn verify_tls13_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Dss) -> Signed {
        self.inner.verify_tls13_signature(m, c, d)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_takeover_time_is_counted_on_and_none_means_the_wall_clock() {
        assert!(CertificateTime::wall_clock().trusted_now().is_none());
        assert!(CertificateTime::from_takeover(0).trusted_now().is_none());
        assert!(CertificateTime::from_takeover(-5).trusted_now().is_none());
        let t = CertificateTime::from_takeover(946_684_800_000); // 2000-01-01
        std::thread::sleep(Duration::from_millis(20));
        let now = t.trusted_now().unwrap().as_secs();
        assert!((946_684_800..946_684_802).contains(&now), "{now}");
    }
}
