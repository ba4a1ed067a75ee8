//! TLS for the agent-facing server: our certificate from files (or generated for development),
//! and a client-certificate verifier that accepts any certificate — agents' certificates are
//! self-signed — while still checking the handshake signature, which proves the client holds
//! the key in its certificate. Authorization happens per request, against the BMDB.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::{
    verify_tls12_signature, verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};

/// Why the server's TLS could not be set up. Texts name the setting and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{setting}: {path}: {error}")]
    File {
        /// The setting that names it (`tls-cert`, `tls-key`, `dev-certs`).
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// A file holds nothing of what it should.
    #[error("{setting}: {path} holds no {what}")]
    Empty {
        /// The setting that names it.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// What it should hold.
        what: &'static str,
    },
    /// A private key file others may read.
    #[error("dev-certs: {0} is readable by group or others; chmod 600 it")]
    KeyReadable(PathBuf),
    /// rustls refused the certificate and key (they do not match, or are unsupported).
    #[error("server certificate and key")]
    Rustls(#[from] rustls::Error),
    /// Development certificates could not be made.
    #[error("dev-certs: generating certificates")]
    Generate(#[from] rcgen::Error),
}

/// What a handshake signature check returns.
type Signed = Result<HandshakeSignatureValid, rustls::Error>;
/// The signed part of a handshake message.
type Dss = DigitallySignedStruct;

/// Accepts any client certificate, but verifies the handshake signature made with its key
/// (rustls' own checks, with the crypto provider's algorithms).
#[derive(Debug)]
struct AnyClientCert {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for AnyClientCert {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_tls12_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Dss) -> Signed {
        verify_tls12_signature(m, c, d, &self.algorithms)
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_tls13_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Dss) -> Signed {
        verify_tls13_signature(m, c, d, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let verifier = Arc::new(AnyClientCert {
        algorithms: provider.signature_verification_algorithms,
    });
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// A server config from a PEM certificate chain and a PEM private key.
pub fn load_server_config(cert: &Path, key: &Path) -> Result<ServerConfig, TlsError> {
    let (chain, key) = load_pem(cert, key)?;
    server_config(chain, key)
}

/// A server config for HTTPS (the operator API) from the same files: no client certificate is
/// asked for (people and programs prove who they are in each request), HTTP/1.1.
pub fn load_https_config(cert: &Path, key: &Path) -> Result<ServerConfig, TlsError> {
    let (chain, key) = load_pem(cert, key)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The certificate chain and private key in PEM files `cert` and `key`.
fn load_pem(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let file = |setting, path: &Path| {
        let path = path.to_path_buf();
        move |error| TlsError::File {
            setting,
            path,
            error,
        }
    };
    let empty = |setting, path: &Path, what| TlsError::Empty {
        setting,
        path: path.to_path_buf(),
        what,
    };
    let certs = std::fs::read(cert).map_err(file("tls-cert", cert))?;
    let chain = rustls_pemfile::certs(&mut certs.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(file("tls-cert", cert))?;
    if chain.is_empty() {
        return Err(empty("tls-cert", cert, "certificate"));
    }
    let keys = std::fs::read(key).map_err(file("tls-key", key))?;
    let key = rustls_pemfile::private_key(&mut keys.as_slice())
        .map_err(file("tls-key", key))?
        .ok_or_else(|| empty("tls-key", key, "private key"))?;
    Ok((chain, key))
}

/// Development certificates: a CA and a server certificate signed by it, kept in a directory
/// and reused on later starts (private keys 0600).
#[derive(Debug, Clone)]
pub struct DevCerts {
    /// The CA certificate agents must trust (PEM).
    pub ca_pem: PathBuf,
    /// The server certificate (PEM).
    pub cert_pem: PathBuf,
    /// The server key (PEM).
    pub key_pem: PathBuf,
}

/// Creates (or reuses) development certificates in `dir` for the DNS names / IPs in `names`.
pub fn dev_certs(dir: &Path, names: &[String]) -> Result<DevCerts, TlsError> {
    let file = |path: &Path| {
        let path = path.to_path_buf();
        move |error| TlsError::File {
            setting: "dev-certs",
            path,
            error,
        }
    };
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let certs = DevCerts {
        ca_pem: dir.join("ca.pem"),
        cert_pem: dir.join("server.pem"),
        key_pem: dir.join("server.key"),
    };
    if certs.ca_pem.exists() && certs.cert_pem.exists() && certs.key_pem.exists() {
        let mode = std::fs::metadata(&certs.key_pem)
            .map_err(file(&certs.key_pem))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(TlsError::KeyReadable(certs.key_pem));
        }
        if certifies_ed25519(&certs.cert_pem) {
            tracing::warn!(
                dir = %dir.display(),
                "the development server certificate is Ed25519, which gRPC C-core clients \
                 (Python, C++, Ruby) cannot verify; remove the directory to make ECDSA P-256 \
                 ones (machines taken over with the old CA must then be taken over again)"
            );
        }
        return Ok(certs);
    }
    std::fs::create_dir_all(dir).map_err(file(dir))?;
    // ECDSA P-256, not Ed25519: gRPC C-core clients (BoringSSL) offer no Ed25519 signature
    // scheme and cannot verify an Ed25519 server. Agents keep their Ed25519 client keys.
    let ca_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "shepherd dev CA");
    let ca = ca_params.self_signed(&ca_key)?;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = rcgen::CertificateParams::new(names.to_vec())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "shepherd BMaaS server");
    let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
    let cert = params.signed_by(&key, &issuer)?;
    let write = |path: &Path, text: &str, mode: u32| -> Result<(), TlsError> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(path)
            .map_err(file(path))?;
        std::io::Write::write_all(&mut f, text.as_bytes()).map_err(file(path))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(file(path))?;
        Ok(())
    };
    write(&certs.key_pem, &key.serialize_pem(), 0o600)?;
    write(&certs.cert_pem, &cert.pem(), 0o644)?;
    write(&certs.ca_pem, &ca.pem(), 0o644)?;
    Ok(certs)
}

/// Whether the first certificate in a PEM file certifies an Ed25519 key (development
/// certificates made before they were ECDSA).
fn certifies_ed25519(pem: &Path) -> bool {
    std::fs::read(pem)
        .ok()
        .and_then(|bytes| rustls_pemfile::certs(&mut bytes.as_slice()).next()?.ok())
        .is_some_and(|der| peer_ed25519_key(&der).is_some())
}

/// The ed25519 public key in a DER certificate, if that is what it certifies.
pub fn peer_ed25519_key(cert: &[u8]) -> Option<[u8; 32]> {
    const ED25519: &str = "1.3.101.112";
    let (_, cert) = x509_parser::parse_x509_certificate(cert).ok()?;
    let spki = cert.public_key();
    if spki.algorithm.algorithm.to_id_string() != ED25519 {
        return None;
    }
    spki.subject_public_key.data.as_ref().try_into().ok()
}
