//! Counters and latency histograms of calls to the outside world (provider APIs, SSH), so an
//! operator can tell a slow or failing provider from a slow database.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use shepherd_bmdb::{Lease, ProviderKind, Session};

use crate::{HandBack, Provider, ProviderError, ProviderMachine, Rebooter, Recorded};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    call: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LatencyLabels {
    call: &'static str,
}

/// How a call ended, for the `result` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    /// It worked.
    Ok,
    /// The provider answered that the machine does not exist (an answer, not a failure).
    NotFound,
    /// Anything else.
    Error,
}

impl CallResult {
    fn label(self) -> &'static str {
        match self {
            CallResult::Ok => "ok",
            CallResult::NotFound => "not_found",
            CallResult::Error => "error",
        }
    }
}

fn latency_histogram() -> Histogram {
    // 1 ms … ~33 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Calls of one kind of remote (a provider, SSH), counted by call and result, timed by call.
#[derive(Debug)]
pub struct CallMetrics {
    calls: Family<CallLabels, Counter>,
    latency: Family<LatencyLabels, Histogram, fn() -> Histogram>,
}

impl Default for CallMetrics {
    fn default() -> Self {
        CallMetrics {
            calls: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
        }
    }
}

impl CallMetrics {
    /// Adds `<prefix>_calls_total{call,result}` and `<prefix>_call_duration_seconds{call}`.
    pub fn register(&self, registry: &mut Registry, prefix: &str, what: &str) {
        registry.register(
            format!("{prefix}_calls"),
            format!("{what} calls, by call and result"),
            self.calls.clone(),
        );
        registry.register(
            format!("{prefix}_call_duration_seconds"),
            format!("{what} call latency, by call"),
            self.latency.clone(),
        );
    }

    /// Records one call.
    pub fn observe(&self, call: &'static str, result: CallResult, elapsed: Duration) {
        self.calls
            .get_or_create(&CallLabels {
                call,
                result: result.label(),
            })
            .inc();
        self.latency
            .get_or_create(&LatencyLabels { call })
            .observe(elapsed.as_secs_f64());
    }

    /// How many `call`s ended with `result` so far.
    pub fn count(&self, call: &'static str, result: CallResult) -> u64 {
        self.calls
            .get_or_create(&CallLabels {
                call,
                result: result.label(),
            })
            .get()
    }

    /// Runs `fut` and records it; `classify` maps its outcome to a result label.
    pub async fn time<T, E>(
        &self,
        call: &'static str,
        classify: impl FnOnce(&Result<T, E>) -> CallResult,
        fut: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let started = Instant::now();
        let out = fut.await;
        self.observe(call, classify(&out), started.elapsed());
        out
    }
}

fn provider_result<T>(r: &Result<T, ProviderError>) -> CallResult {
    match r {
        Ok(_) => CallResult::Ok,
        Err(ProviderError::NotFound(_)) => CallResult::NotFound,
        Err(_) => CallResult::Error,
    }
}

/// A provider whose every call is counted and timed (`shepherd_provider_*` metrics).
pub struct InstrumentedProvider<P: ?Sized> {
    inner: Arc<P>,
    metrics: Arc<CallMetrics>,
}

/// Registers `family` as `name` with `help`, its series for each of `labels` created first,
/// so that they are exported at zero before anything is counted.
pub fn register_at_zero<L, M>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    family: &Family<L, M>,
    labels: impl IntoIterator<Item = L>,
) where
    L: Clone + std::hash::Hash + Eq,
    M: Default,
    Family<L, M>: prometheus_client::registry::Metric + Clone,
{
    for l in labels {
        let _ = family.get_or_create(&l);
    }
    registry.register(name, help, family.clone());
}

impl<P: ?Sized> InstrumentedProvider<P> {
    /// Wraps `inner`, recording into `metrics`.
    pub fn new(inner: Arc<P>, metrics: Arc<CallMetrics>) -> Self {
        InstrumentedProvider { inner, metrics }
    }
}

impl<P: ?Sized> InstrumentedProvider<P> {
    /// Runs a provider call, counted and timed as `call`.
    async fn timed<T>(
        &self,
        call: &'static str,
        done: impl std::future::Future<Output = Result<T, ProviderError>>,
    ) -> Result<T, ProviderError> {
        self.metrics.time(call, provider_result, done).await
    }
}

#[async_trait]
impl<P: Provider + ?Sized> Provider for InstrumentedProvider<P> {
    fn kind(&self) -> ProviderKind {
        self.inner.kind()
    }

    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        self.timed("list", self.inner.list_machines()).await
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        self.timed("get", self.inner.get_machine(id)).await
    }

    fn id_once_created<'m>(&self, unused: &'m ProviderMachine) -> Option<&'m str> {
        self.inner.id_once_created(unused)
    }

    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        let created = self.inner.create_machine(session, unused);
        self.timed("create", created).await
    }

    async fn hand_back(
        &self,
        lease: &Lease,
        machine: &ProviderMachine,
        tear_down: bool,
    ) -> Result<HandBack, ProviderError> {
        let handed_back = self.inner.hand_back(lease, machine, tear_down);
        self.timed("hand_back", handed_back).await
    }
}

#[async_trait]
impl<P: Rebooter + ?Sized> Rebooter for InstrumentedProvider<P> {
    async fn reboot(&self, lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError> {
        self.timed("reboot", self.inner.reboot(lease, machine))
            .await
    }

    async fn can_reboot(&self) -> bool {
        self.inner.can_reboot().await
    }

    fn reboot_wait(&self) -> std::time::Duration {
        self.inner.reboot_wait()
    }

    async fn bare_plan(&self, machine: &ProviderMachine) -> Result<crate::BarePlan, ProviderError> {
        self.inner.bare_plan(machine).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[tokio::test]
    async fn calls_are_counted_and_timed_by_result() {
        let m = CallMetrics::default();
        let ok: Result<u8, ProviderError> = m.time("get", provider_result, async { Ok(1) }).await;
        assert!(ok.is_ok());
        let _ = m
            .time("get", provider_result, async {
                Err::<u8, _>(ProviderError::NotFound("x".into()))
            })
            .await;
        let _ = m
            .time("get", provider_result, async {
                Err::<u8, _>(ProviderError::Incomplete("an answer"))
            })
            .await;
        assert_eq!(m.count("get", CallResult::Ok), 1);
        assert_eq!(m.count("get", CallResult::NotFound), 1);
        assert_eq!(m.count("get", CallResult::Error), 1);
        let mut r = Registry::default();
        m.register(&mut r, "shepherd_provider", "Provider API");
        let mut text = String::new();
        encode(&mut text, &r).unwrap();
        assert!(
            text.contains(r#"shepherd_provider_calls_total{call="get",result="not_found"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"shepherd_provider_call_duration_seconds_count{call="get"} 3"#),
            "{text}"
        );
    }
}
