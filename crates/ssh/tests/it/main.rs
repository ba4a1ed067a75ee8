//! The integration tests of the SSH client, one test binary for the crate: each module was once a
//! binary of its own.

mod password_auth;
mod real_sshd;
