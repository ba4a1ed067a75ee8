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

use anyhow::{bail, Context};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{
    verify_tls12_signature, verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms,
};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

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
    pub fn from_ca_file(path: &Path) -> anyhow::Result<BmcTrust> {
        let pem = std::fs::read(path).with_context(|| format!("BMC CA {}", path.display()))?;
        let certs = rustls_pemfile::certs(&mut pem.as_slice())
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("BMC CA {}", path.display()))?;
        if certs.is_empty() {
            bail!("BMC CA {}: holds no PEM certificate", path.display());
        }
        Ok(BmcTrust::Pinned(certs))
    }

    /// A rustls client configuration that trusts what `self` says.
    pub fn client_config(&self) -> anyhow::Result<ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = Verifier::new(self, provider.clone())?;
        Ok(ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth())
    }
}

/// The system's trust anchors, loaded once per process.
fn system_roots() -> anyhow::Result<Arc<RootCertStore>> {
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
                return Err(format!(
                    "no system trust roots ({why}): install ca-certificates, set SSL_CERT_FILE, or give the BMC a CA"
                ));
            }
            Ok(Arc::new(roots))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

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
    fn new(trust: &BmcTrust, provider: Arc<CryptoProvider>) -> anyhow::Result<Verifier> {
        let algorithms = provider.signature_verification_algorithms;
        let chained = |roots: Arc<RootCertStore>| {
            WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .context("BMC certificate verifier")
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

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
