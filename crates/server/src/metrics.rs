//! Connection metrics of the agent-facing server: connections by state, rejections by reason,
//! closes by reason.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// Every handshake slot is taken.
    PendingHandshakes,
    /// This peer holds its share of handshake slots.
    PendingHandshakesPerPeer,
    /// Every connection slot is taken.
    Connections,
    /// This peer holds its share of connection slots.
    ConnectionsPerPeer,
    /// The TLS handshake did not finish in time.
    HandshakeTimeout,
    /// The TLS handshake failed.
    HandshakeFailed,
}

impl Rejection {
    const ALL: [Rejection; 6] = [
        Rejection::PendingHandshakes,
        Rejection::PendingHandshakesPerPeer,
        Rejection::Connections,
        Rejection::ConnectionsPerPeer,
        Rejection::HandshakeTimeout,
        Rejection::HandshakeFailed,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Rejection::PendingHandshakes => "pending_handshakes",
            Rejection::PendingHandshakesPerPeer => "pending_handshakes_per_peer",
            Rejection::Connections => "connections",
            Rejection::ConnectionsPerPeer => "connections_per_peer",
            Rejection::HandshakeTimeout => "handshake_timeout",
            Rejection::HandshakeFailed => "handshake_failed",
        }
    }
}

/// Why the server closed an established connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// No request for longer than the idle timeout.
    Idle,
    /// No authorized request within the grace period after the handshake.
    Unauthenticated,
    /// The server is shutting down.
    Shutdown,
}

impl CloseReason {
    const ALL: [CloseReason; 3] = [
        CloseReason::Idle,
        CloseReason::Unauthenticated,
        CloseReason::Shutdown,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            CloseReason::Idle => "idle",
            CloseReason::Unauthenticated => "unauthenticated",
            CloseReason::Shutdown => "shutdown",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Counters and gauges of the server's connections. Cheap to clone; clones share values.
#[derive(Debug, Clone)]
pub struct ConnectionMetrics {
    by_state: Family<StateLabels, Gauge>,
    pub(crate) handshaking: Gauge,
    pub(crate) established: Gauge,
    rejected: Family<ReasonLabels, Counter>,
    closed: Family<ReasonLabels, Counter>,
}

impl Default for ConnectionMetrics {
    fn default() -> Self {
        let by_state = Family::<StateLabels, Gauge>::default();
        // Gauges share their value with their clones, so these handles update the family.
        let handshaking = by_state
            .get_or_create(&StateLabels {
                state: "handshaking",
            })
            .clone();
        let established = by_state
            .get_or_create(&StateLabels {
                state: "established",
            })
            .clone();
        let rejected = Family::<ReasonLabels, Counter>::default();
        for r in Rejection::ALL {
            let _ = rejected.get_or_create(&ReasonLabels { reason: r.label() });
        }
        let closed = Family::<ReasonLabels, Counter>::default();
        for c in CloseReason::ALL {
            let _ = closed.get_or_create(&ReasonLabels { reason: c.label() });
        }
        ConnectionMetrics {
            by_state,
            handshaking,
            established,
            rejected,
            closed,
        }
    }
}

impl ConnectionMetrics {
    /// Adds the metrics to `registry`; every series exists from the start, at zero.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "shepherd_server_connections",
            "Agent-facing connections by state (handshaking, established)",
            self.by_state.clone(),
        );
        registry.register(
            "shepherd_server_connections_rejected",
            "Connections refused or dropped before they were established, by reason",
            self.rejected.clone(),
        );
        registry.register(
            "shepherd_server_connections_closed",
            "Established connections the server closed, by reason",
            self.closed.clone(),
        );
    }

    pub(crate) fn rejected(&self, r: Rejection) {
        self.rejected
            .get_or_create(&ReasonLabels { reason: r.label() })
            .inc();
    }

    pub(crate) fn closed(&self, c: CloseReason) {
        self.closed
            .get_or_create(&ReasonLabels { reason: c.label() })
            .inc();
    }

    /// Rejections so far for `r`.
    pub fn rejections(&self, r: Rejection) -> u64 {
        self.rejected
            .get_or_create(&ReasonLabels { reason: r.label() })
            .get()
    }

    /// Closes so far for `c`.
    pub fn closes(&self, c: CloseReason) -> u64 {
        self.closed
            .get_or_create(&ReasonLabels { reason: c.label() })
            .get()
    }

    /// Connections now: (handshaking, established).
    pub fn connections(&self) -> (i64, i64) {
        (self.handshaking.get(), self.established.get())
    }
}
