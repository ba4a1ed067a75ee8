//! The integration tests of the BMaaS server, one test binary for the crate: each module was once a
//! binary of its own.

mod agent_e2e;
mod heartbeat_tls;
