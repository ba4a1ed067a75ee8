//! `shepherd-bench`: benchmarks that compare Shepherd with a baseline measured in the same run
//! and write a markdown report under `bench/results/`.

mod agents;
mod api;
mod binaries;
mod bmdb;
mod heartbeat;
mod image_write;
mod ironic;
mod scale;
mod ssh;
mod stats;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "Shepherd benchmarks; each writes bench/results/<name>.md")]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Claim throughput and latency of the BMDB on Postgres and SQLite.
    Bmdb(bmdb::Args),
    /// Agents heartbeating over TLS against the server, vs the raw upsert on Postgres.
    Heartbeat(heartbeat::Args),
    /// Takeovers over a real sshd: Shepherd's SSH transport against OpenSSH scp + ssh.
    Ssh(ssh::Args),
    /// 1,000 Ironic fake-hardware nodes to heartbeating, vs deploying them directly.
    Ironic(ironic::Args),
    /// Fleet scale: static inventory lookups, the demo with 1,000 and 10,000 machines.
    Scale(scale::Args),
    /// The operator API at 100,000 machines: its page against the web UI's, and a JWT's cost.
    Api(api::Args),
    /// The agent writing raw, zstd and qcow2 images against `curl | dd` (figures for
    /// bench/results/baremetal.md, which scripts/bare-figures.sh writes).
    ImageWrite(image_write::Args),
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().bench {
        Bench::Bmdb(args) => bmdb::run(args).await,
        Bench::Ssh(args) => ssh::run(args).await,
        Bench::Heartbeat(args) => heartbeat::run(args).await,
        Bench::Scale(args) => scale::run(args).await,
        Bench::Ironic(args) => ironic::run(args).await,
        Bench::Api(args) => api::run(args).await,
        Bench::ImageWrite(args) => image_write::run(args).await,
    }
}
