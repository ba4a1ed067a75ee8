//! How a BMC's TLS certificate is trusted.
//!
//! - **No `CA`**: the system's trust store, as OpenSSL would use it (`SSL_CERT_FILE` and
//!   `SSL_CERT_DIR` are honoured), with the usual chain and name checks.
//! - **`CA` given**: trust *this certificate or this CA, for this BMC*. A certificate in the
//!   file that the BMC presents itself is trusted as it is (pinned): that is how most BMCs ship,
//!   self-signed with `CA:TRUE` as `openssl req -x509` makes it, often naming no address, which
//!   a chain check would refuse (`CaUsedAsEndEntity`, a name mismatch). Any other certificate
//!   must chain to one in the file, with the name checked. Nothing else is trusted.
//! - **`Insecure`**: any certificate.
//!
//! In every case the TLS handshake signature is verified against the presented certificate,
//! so the peer holds its key.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{
    verify_tls12_signature, verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms,
};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// Why a BMC's TLS trust could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// The `CA` file could not be read.
    #[error("BMC CA {path}: {error}")]
    ReadCa {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// The `CA` file holds no PEM certificate.
    #[error("BMC CA {0}: holds no PEM certificate")]
    EmptyCa(std::path::PathBuf),
    /// The system trust store holds no usable certificate.
    #[error("no system trust roots ({0}): install ca-certificates, set SSL_CERT_FILE, or give the BMC a CA")]
    NoSystemRoots(String),
    /// rustls refused the configuration.
    #[error("BMC TLS configuration: {0}")]
    Config(String),
}

/// What a BMC client trusts.
#[derive(Debug, Clone)]
pub enum BmcTrust {
    /// The system's trust store.
    System,
    /// The certificates of a `CA` file: pinned as they are, and as roots.
    Pinned(Vec<CertificateDer<'static>>),
    /// Anything (the inventory said `Insecure`).
    Anything,
}

impl BmcTrust {
    /// Reads a `CA` file: at least one PEM certificate, or an error naming the file.
    pub fn from_ca_file(path: &Path) -> Result<BmcTrust, TrustError> {
        let unreadable = |error| TrustError::ReadCa {
            path: path.to_path_buf(),
            error,
        };
        let pem = std::fs::read(path).map_err(unreadable)?;
        let certs = rustls_pemfile::certs(&mut pem.as_slice())
            .collect::<Result<Vec<_>, _>>()
            .map_err(unreadable)?;
        if certs.is_empty() {
            return Err(TrustError::EmptyCa(path.to_path_buf()));
        }
        Ok(BmcTrust::Pinned(certs))
    }

    /// A rustls client configuration that trusts what `self` says.
    pub fn client_config(&self) -> Result<ClientConfig, TrustError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = Verifier::new(self, provider.clone())?;
        Ok(ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TrustError::Config(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth())
    }
}

/// The system's trust anchors, loaded once per process.
fn system_roots() -> Result<Arc<RootCertStore>, TrustError> {
    static ROOTS: OnceLock<Result<Arc<RootCertStore>, String>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut roots = RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map_or("none found".to_string(), |e| e.to_string());
                return Err(why);
            }
            Ok(Arc::new(roots))
        })
        .clone()
        .map_err(TrustError::NoSystemRoots)
}

/// What a handshake signature check returns.
type Signed = Result<HandshakeSignatureValid, rustls::Error>;
/// The signed part of a handshake message.
type Dss = DigitallySignedStruct;

/// The verifier behind [`BmcTrust`].
struct Verifier {
    /// Certificates trusted as they are.
    pinned: Vec<CertificateDer<'static>>,
    /// Chain and name checks for any other certificate; `None` refuses it.
    chain: Option<Arc<WebPkiServerVerifier>>,
    /// Trust any certificate.
    anything: bool,
    algorithms: WebPkiSupportedAlgorithms,
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("pinned", &self.pinned.len())
            .field("chain", &self.chain.is_some())
            .field("anything", &self.anything)
            .finish()
    }
}

impl Verifier {
    fn new(trust: &BmcTrust, provider: Arc<CryptoProvider>) -> Result<Verifier, TrustError> {
        let algorithms = provider.signature_verification_algorithms;
        let chained = |roots: Arc<RootCertStore>| {
            WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| TrustError::Config(e.to_string()))
        };
        Ok(match trust {
            BmcTrust::System => Verifier {
                pinned: vec![],
                chain: Some(chained(system_roots()?)?),
                anything: false,
                algorithms,
            },
            BmcTrust::Pinned(certs) => {
                let mut roots = RootCertStore::empty();
                // A certificate that is no valid trust anchor is still pinned as it is.
                roots.add_parsable_certificates(certs.iter().cloned());
                Verifier {
                    pinned: certs.clone(),
                    chain: if roots.is_empty() {
                        None
                    } else {
                        Some(chained(Arc::new(roots))?)
                    },
                    anything: false,
                    algorithms,
                }
            }
            BmcTrust::Anything => Verifier {
                pinned: vec![],
                chain: None,
                anything: true,
                algorithms,
            },
        })
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_tls13_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Dss) -> Signed {
        verify_tls13_signature(m, c, d, &self.algorithms)
    }

    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if self.anything
            || self
                .pinned
                .iter()
                .any(|p| p.as_ref() == end_entity.as_ref())
        {
            return Ok(ServerCertVerified::assertion());
        }
        match &self.chain {
            Some(chain) => {
                chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
            }
            None => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            )),
        }
    }

    fn verify_tls12_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Dss) -> Signed {
        verify_tls12_signature(m, c, d, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
