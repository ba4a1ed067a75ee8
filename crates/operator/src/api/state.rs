//! What the API's handlers share: the BMDB, the authenticator, the recoverer's threshold,
//! this process's background tasks and the cached fleet counts; and the id of each request.

use std::sync::Arc;

use shepherd_bmdb::Bmdb;
use shepherd_tasks::Tasks;

use super::auth::Authenticator;

/// The API's state, shared by its handlers.
pub struct Api {
    pub(super) db: Bmdb,
    pub(super) auth: Arc<Authenticator>,
    /// How old a last heartbeat must be to count as stale (the recoverer's threshold).
    pub(super) stale_after: chrono::Duration,
    pub(super) tasks: Tasks,
    pub(super) counts: crate::inventory::CountsCache,
}

/// The id of one API request: in the `x-request-id` answer header and in the operators'
/// history of the actions it made.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);
