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
    // The server's side of AgentCallback, on the same route, over `raw::HeartbeatRequest`: it
    // keeps the reports as the bytes the agent sent (see src/raw.rs).
    let raw = tonic_build::manual::Service::builder()
        .name("AgentCallback")
        .package("cloud.bmaas.server.api")
        .method(
            tonic_build::manual::Method::builder()
                .name("heartbeat")
                .route_name("Heartbeat")
                .input_type("crate::raw::HeartbeatRequest")
                .output_type("crate::bmaas::HeartbeatResponse")
                .codec_path("tonic_prost::ProstCodec")
                .build(),
        )
        .build();
    tonic_build::manual::Builder::new()
        .build_client(false)
        .build_transport(false)
        .compile(&[raw]);
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
