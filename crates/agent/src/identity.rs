//! The agent's ed25519 identity and the self-signed TLS client certificate made from it.

use ring::signature::{Ed25519KeyPair, KeyPair};

/// Why the agent's key or certificate could not be made.
#[derive(Debug)]
pub enum IdentityError {
    /// The system's random source or ring could not make a key.
    Generate,
    /// A key could not be loaded or certified (`rcgen`'s reason).
    Certificate(rcgen::Error),
}

impl std::fmt::Display for IdentityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdentityError::Generate => f.write_str("generating an ed25519 key failed"),
            IdentityError::Certificate(e) => write!(f, "making the client certificate: {e}"),
        }
    }
}

impl std::error::Error for IdentityError {}

/// A fresh ed25519 key: (PKCS#8 DER, 32-byte public key).
pub fn generate() -> Result<(Vec<u8>, Vec<u8>), IdentityError> {
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| IdentityError::Generate)?;
    let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).map_err(|_| IdentityError::Generate)?;
    Ok((pkcs8.as_ref().to_vec(), pair.public_key().as_ref().to_vec()))
}

/// A self-signed certificate for the key, naming the machine.
pub fn client_certificate(
    pkcs8: &[u8],
    machine_id: &str,
) -> Result<rustls_pki_types::CertificateDer<'static>, IdentityError> {
    let der = rustls_pki_types::PrivatePkcs8KeyDer::from(pkcs8);
    let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519)
        .map_err(IdentityError::Certificate)?;
    let mut params =
        rcgen::CertificateParams::new(Vec::<String>::new()).map_err(IdentityError::Certificate)?;
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("shepherd agent {machine_id}"),
    );
    let cert = params
        .self_signed(&key)
        .map_err(IdentityError::Certificate)?;
    Ok(cert.der().clone())
}
