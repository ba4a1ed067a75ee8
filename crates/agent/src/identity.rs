//! The agent's ed25519 identity and the self-signed TLS client certificate made from it.

use ring::signature::{Ed25519KeyPair, KeyPair};

/// A fresh ed25519 key: (PKCS#8 DER, 32-byte public key).
pub fn generate() -> Result<(Vec<u8>, Vec<u8>), String> {
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 =
        Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| "generating an ed25519 key failed")?;
    let pair =
        Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).map_err(|_| "reading the new key failed")?;
    Ok((pkcs8.as_ref().to_vec(), pair.public_key().as_ref().to_vec()))
}

/// A self-signed certificate for the key, naming the machine.
pub fn client_certificate(
    pkcs8: &[u8],
    machine_id: &str,
) -> Result<rustls_pki_types::CertificateDer<'static>, String> {
    let der = rustls_pki_types::PrivatePkcs8KeyDer::from(pkcs8);
    let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519)
        .map_err(|e| format!("loading the agent key: {e}"))?;
    let mut params =
        rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("shepherd agent {machine_id}"),
    );
    let cert = params
        .self_signed(&key)
        .map_err(|e| format!("self-signing: {e}"))?;
    Ok(cert.der().clone())
}
