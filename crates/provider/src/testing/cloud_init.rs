//! What cloud-init's own code makes of a config drive (`scripts/cloud-init-read.py`, run by
//! Debian's python3 with Debian's cloud-init package, which scripts/test-deps.sh installs), so
//! that tests check the installed OS's config drive against the reader a stock cloud image
//! runs, not against Shepherd's own idea of the format.

/// cloud-init's reading of the config drive `files` (paths under `openstack/latest/`, as
/// [`crate::bare::installed_config_drive`] gives them) on a machine whose NICs are `nics`
/// (MAC, name): `instance_id`, `hostname`, `public_keys`, `user_data`, `vendor_data`, and `network` (its
/// network config) or `network_error` (what it refused).
pub fn read(files: &[(String, Vec<u8>)], nics: &[(&str, &str)]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    for (path, content) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/cloud-init-read.py"
    );
    let run = std::process::Command::new("/usr/bin/python3")
        .arg(script)
        .arg(dir.path())
        .args(nics.iter().map(|(mac, name)| format!("{mac}={name}")))
        .output();
    match run {
        Ok(out) if out.status.success() => serde_json::from_slice(&out.stdout).unwrap(),
        Ok(out) => panic!("{script}: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!("Debian's python3 with cloud-init (scripts/test-deps.sh): {e}"),
    }
}
