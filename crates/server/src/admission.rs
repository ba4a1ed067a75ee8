//! Admission of TCP connections: how many handshakes and established connections the server
//! holds, in all and per peer, so that one hostile peer cannot take every slot and lock
//! agents out. A ticket is taken when a socket is accepted and returned when it is dropped.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use crate::metrics::{ConnectionMetrics, Rejection};

/// The caps admission enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionCaps {
    /// TLS handshakes in progress, in all.
    pub pending_handshakes: usize,
    /// TLS handshakes in progress from one peer.
    pub pending_handshakes_per_peer: usize,
    /// Established connections, in all.
    pub connections: usize,
    /// Established connections from one peer.
    pub connections_per_peer: usize,
}

/// Who counts as one peer: an IPv4 address, or an IPv6 /64 (one host usually holds a whole
/// /64, so counting single IPv6 addresses would not bound anything).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerKey(IpAddr);

impl PeerKey {
    /// The peer an address belongs to.
    pub fn of(ip: IpAddr) -> PeerKey {
        match ip {
            IpAddr::V4(_) => PeerKey(ip),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerKey(IpAddr::V4(v4)),
                None => {
                    let bits = u128::from(v6) & !((1u128 << 64) - 1);
                    PeerKey(IpAddr::V6(bits.into()))
                }
            },
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    pending: usize,
    established: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Slots held by all peers together.
    total: Counts,
    peers: HashMap<PeerKey, Counts>,
}

impl State {
    fn peer(&mut self, peer: PeerKey) -> &mut Counts {
        self.peers.entry(peer).or_default()
    }

    /// Drops the peer's entry once it holds nothing, so the map is bounded by the slots held.
    fn tidy(&mut self, peer: PeerKey) {
        if let Some(c) = self.peers.get(&peer) {
            if c.pending == 0 && c.established == 0 {
                self.peers.remove(&peer);
            }
        }
    }
}

/// The two kinds of slot a peer holds.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// A TLS handshake in progress.
    Handshake,
    /// An established connection.
    Connection,
}

impl Counts {
    /// The count of `slot`s held.
    fn of(&mut self, slot: Slot) -> &mut usize {
        match slot {
            Slot::Handshake => &mut self.pending,
            Slot::Connection => &mut self.established,
        }
    }
}

/// The server's connection slots.
#[derive(Debug)]
pub struct Admission {
    caps: AdmissionCaps,
    state: Mutex<State>,
    metrics: ConnectionMetrics,
}

impl Admission {
    /// Admission under `caps`, counting into `metrics`.
    pub fn new(caps: AdmissionCaps, metrics: ConnectionMetrics) -> Arc<Admission> {
        Arc::new(Admission {
            caps,
            state: Mutex::new(State::default()),
            metrics,
        })
    }

    /// The metrics this admission counts into.
    pub fn metrics(&self) -> &ConnectionMetrics {
        &self.metrics
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for a TLS handshake from `ip`, or why there is none.
    pub fn handshake(self: &Arc<Self>, ip: IpAddr) -> Result<HandshakeTicket, Rejection> {
        let peer = PeerKey::of(ip);
        let mut s = self.lock();
        let rejection = if s.total.pending >= self.caps.pending_handshakes {
            Some(Rejection::PendingHandshakes)
        } else if s.peer(peer).pending >= self.caps.pending_handshakes_per_peer {
            Some(Rejection::PendingHandshakesPerPeer)
        } else {
            None
        };
        if let Some(r) = rejection {
            s.tidy(peer);
            drop(s);
            self.metrics.rejected(r);
            return Err(r);
        }
        s.total.pending += 1;
        s.peer(peer).pending += 1;
        drop(s);
        self.metrics.handshaking.inc();
        Ok(HandshakeTicket {
            admission: self.clone(),
            peer,
            done: false,
        })
    }

    /// Gives back a slot `peer` held.
    fn release(&self, peer: PeerKey, slot: Slot) {
        let mut s = self.lock();
        *s.total.of(slot) -= 1;
        *s.peer(peer).of(slot) -= 1;
        s.tidy(peer);
        drop(s);
        match slot {
            Slot::Handshake => self.metrics.handshaking.dec(),
            Slot::Connection => self.metrics.established.dec(),
        };
    }

    /// Slots held now: (handshakes, established connections, peers holding any).
    pub fn held(&self) -> (usize, usize, usize) {
        let s = self.lock();
        (s.total.pending, s.total.established, s.peers.len())
    }
}

/// A handshake slot; returned on drop unless turned into a [`ConnectionTicket`].
#[derive(Debug)]
pub struct HandshakeTicket {
    admission: Arc<Admission>,
    peer: PeerKey,
    done: bool,
}

impl HandshakeTicket {
    /// Trades the handshake slot for an established-connection slot, or says why not.
    pub fn establish(mut self) -> Result<ConnectionTicket, Rejection> {
        let a = self.admission.clone();
        let mut s = a.lock();
        let rejection = if s.total.established >= a.caps.connections {
            Some(Rejection::Connections)
        } else if s.peer(self.peer).established >= a.caps.connections_per_peer {
            Some(Rejection::ConnectionsPerPeer)
        } else {
            None
        };
        if let Some(r) = rejection {
            drop(s);
            a.metrics.rejected(r);
            return Err(r); // `self` drops here and returns the handshake slot
        }
        s.total.pending -= 1;
        s.total.established += 1;
        let c = s.peer(self.peer);
        c.pending -= 1;
        c.established += 1;
        drop(s);
        a.metrics.handshaking.dec();
        a.metrics.established.inc();
        self.done = true;
        Ok(ConnectionTicket {
            admission: a,
            peer: self.peer,
        })
    }
}

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        if !self.done {
            self.admission.release(self.peer, Slot::Handshake);
        }
    }
}

/// An established-connection slot, returned on drop.
#[derive(Debug)]
pub struct ConnectionTicket {
    admission: Arc<Admission>,
    peer: PeerKey,
}

impl Drop for ConnectionTicket {
    fn drop(&mut self) {
        self.admission.release(self.peer, Slot::Connection);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> AdmissionCaps {
        AdmissionCaps {
            pending_handshakes: 5,
            pending_handshakes_per_peer: 2,
            connections: 4,
            connections_per_peer: 3,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn per_peer_handshake_cap_leaves_room_for_others() {
        let a = Admission::new(caps(), ConnectionMetrics::default());
        let held: Vec<_> = (0..2)
            .map(|_| a.handshake(ip("10.0.0.1")).unwrap())
            .collect();
        assert_eq!(
            a.handshake(ip("10.0.0.1")).unwrap_err(),
            Rejection::PendingHandshakesPerPeer
        );
        let other = a.handshake(ip("10.0.0.2")).unwrap();
        assert_eq!(a.held(), (3, 0, 2));
        drop(held);
        drop(other);
        assert_eq!(a.held(), (0, 0, 0), "slots and peer entries are returned");
        assert_eq!(
            a.metrics().rejections(Rejection::PendingHandshakesPerPeer),
            1
        );
    }

    #[test]
    fn global_caps_hold() {
        let a = Admission::new(caps(), ConnectionMetrics::default());
        let mut held = Vec::new();
        for i in 0..5 {
            held.push(a.handshake(ip(&format!("10.0.1.{i}"))).unwrap());
        }
        assert_eq!(
            a.handshake(ip("10.0.2.1")).unwrap_err(),
            Rejection::PendingHandshakes
        );
        let mut conns = Vec::new();
        for t in held.drain(..4) {
            conns.push(t.establish().unwrap());
        }
        let last = held.pop().unwrap();
        assert_eq!(last.establish().unwrap_err(), Rejection::Connections);
        assert_eq!(a.held(), (0, 4, 4));
        drop(conns);
        assert_eq!(a.held(), (0, 0, 0));
    }

    #[test]
    fn per_peer_connection_cap() {
        let a = Admission::new(caps(), ConnectionMetrics::default());
        let mut conns = Vec::new();
        for _ in 0..3 {
            conns.push(a.handshake(ip("10.0.0.1")).unwrap().establish().unwrap());
        }
        let t = a.handshake(ip("10.0.0.1")).unwrap();
        assert_eq!(t.establish().unwrap_err(), Rejection::ConnectionsPerPeer);
        assert_eq!(a.held(), (0, 3, 1));
    }

    #[test]
    fn ipv6_peers_are_counted_by_64_prefix() {
        assert_eq!(
            PeerKey::of(ip("2001:db8:1:2::1")),
            PeerKey::of(ip("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(
            PeerKey::of(ip("2001:db8:1:2::1")),
            PeerKey::of(ip("2001:db8:1:3::1"))
        );
        assert_eq!(
            PeerKey::of(ip("::ffff:10.0.0.1")),
            PeerKey::of(ip("10.0.0.1"))
        );
    }
}
