//! A BMC entry without `CA` trusts the system's trust store, as OpenSSL does: here
//! `SSL_CERT_FILE` names the site CA, and a BMC whose certificate that CA issued is trusted.
//! (Before, the default was a root list bundled into the HTTP client, and `SSL_CERT_FILE` was
//! ignored.) One test in its own binary, because it sets a process-wide variable.

use std::time::Duration;

use shepherd_provider::redfish::Bmc;
use shepherd_provider::testing::bmc::{BmcCerts, Script, ScriptedBmc};

#[test]
fn the_default_trust_is_the_systems_and_honours_ssl_cert_file() {
    let dir = tempfile::tempdir().unwrap();
    let certs = BmcCerts::generate();
    let ca = dir.path().join("site-ca.pem");
    std::fs::write(&ca, &certs.ca_pem).unwrap();
    // SAFETY: set before any other thread of this process exists (the runtime is built below,
    // and this binary holds no other test).
    unsafe {
        std::env::set_var("SSL_CERT_FILE", &ca);
        std::env::remove_var("SSL_CERT_DIR");
    }
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let bmc = ScriptedBmc::start(Script {
            tls: Some(certs.ca_signed_server.clone()),
            ..Script::allowing(&["ForceRestart"])
        })
        .await;
        let entry = bmc.entry(dir.path());
        assert!(entry.ca.is_none() && !entry.insecure);
        let client = Bmc::new(&entry, Duration::from_secs(10)).unwrap();
        assert_eq!(client.reset().await.unwrap(), "ForceRestart");
        assert_eq!(bmc.resets(), ["ForceRestart"]);
    });
}
