//! What Shepherd's TLS certificate verifiers share. The BMaaS server accepts agents'
//! self-signed client certificates and the recoverer trusts a BMC's certificate on its own
//! terms (`shepherd-loops`' `bmc_tls.rs`), but both must still check that the peer signed the
//! handshake with the key of the certificate it presented. Those checks are the same in every
//! verifier, so they are written once here, as [`handshake_signature_checks!`].

#[doc(hidden)]
pub use rustls;

/// Expands, inside an `impl ServerCertVerifier` or `impl ClientCertVerifier` block, to the
/// three methods that check the handshake signature against the presented certificate with
/// the signature algorithms in `self.$algorithms` (a `WebPkiSupportedAlgorithms`, usually the
/// crypto provider's `signature_verification_algorithms`).
#[macro_export]
macro_rules! handshake_signature_checks {
    ($algorithms:ident) => {
        $crate::handshake_signature_checks!(@check $algorithms, verify_tls12_signature);
        $crate::handshake_signature_checks!(@check $algorithms, verify_tls13_signature);

        fn supported_verify_schemes(&self) -> Vec<$crate::rustls::SignatureScheme> {
            self.$algorithms.supported_schemes()
        }
    };
    (@check $algorithms:ident, $check:ident) => {
        fn $check(
            &self,
            message: &[u8],
            cert: &$crate::rustls::pki_types::CertificateDer<'_>,
            dss: &$crate::rustls::DigitallySignedStruct,
        ) -> Result<$crate::rustls::client::danger::HandshakeSignatureValid, $crate::rustls::Error>
        {
            $crate::rustls::crypto::$check(message, cert, dss, &self.$algorithms)
        }
    };
}
