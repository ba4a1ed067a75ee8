//! Compiles the .proto files with protox (pure Rust), so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/cloud/agent/api/takeover.proto",
        "proto/cloud/agent/api/hwreport.proto",
        "proto/cloud/bmaas/server/api/agentcallback.proto",
        "proto/shepherd/agent/state.proto",
    ];
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
