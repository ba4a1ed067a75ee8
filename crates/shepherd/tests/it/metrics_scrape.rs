//! `/metrics` of `shepherd run` after a demo-sized simulated run, parsed with a Prometheus
//! text-format parser: the design.md §16 counters carry the right labels and agree with the work
//! history, the provider counters with what was created, the fleet gauges with the BMDB.

use crate::common;

use std::collections::HashMap;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{announced, signal, sim_replica, ChildGuard, Pace};
use shepherd_bmdb::{testing, Bmdb, Process, StatusCounts, WorkEvent};

const MACHINES: usize = 1000;

/// Reads the child's stdout until it names its metrics address.
fn metrics_url(child: &mut Child) -> String {
    announced(child, "shepherd run: metrics at ")
}

/// One sample: metric name and labels → value.
type Samples = HashMap<(String, Vec<(String, String)>), f64>;

async fn scrape(url: &str) -> Samples {
    let response = reqwest::get(url).await.unwrap();
    assert!(response.status().is_success());
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(content_type.contains("openmetrics-text"), "{content_type}");
    let body = response.text().await.unwrap();
    let lines = body.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("parses as Prometheus text");
    let mut out = Samples::new();
    for s in scrape.samples {
        let value = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => continue,
        };
        let mut labels: Vec<(String, String)> = s
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.sort();
        out.insert((s.metric, labels), value);
    }
    out
}

fn get(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut key: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    key.sort();
    *samples
        .get(&(name.to_string(), key.clone()))
        .unwrap_or_else(|| {
            let mut names: Vec<_> = samples
                .keys()
                .filter(|(n, _)| n == name)
                .map(|(_, l)| l)
                .collect();
            names.sort();
            panic!("{name}{key:?} not scraped; with that name: {names:?}")
        })
}

async fn counts(db: &Bmdb) -> StatusCounts {
    db.status_counts().await.unwrap()
}

async fn history_counts(db: &Bmdb) -> HashMap<(Process, WorkEvent), f64> {
    let mut out = HashMap::new();
    for h in testing::all_history(db).await {
        *out.entry((h.process, h.event)).or_insert(0.0) += 1.0;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_the_work_history() {
    let t = testing::sqlite().await;
    let pace = Pace {
        workers: 8,
        claim_rate: "1ms,16",
        reconcile_rate: "100ms,1",
        ..Pace::default()
    };
    // Killed when the test ends, whether it passes or panics.
    let mut replica = ChildGuard(Some(
        sim_replica(&t.url, MACHINES, "1ms", pace)
            .args(["--sim-connect-failure-rate=0.05", "--stats-interval=200ms"])
            .arg("--metrics-listen=127.0.0.1:0")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ));
    let child = replica.child();
    let url = metrics_url(child);

    // Quiescent: every machine was provided and then either taken over or failed into a
    // 5-minute backoff, and nothing holds work.
    let deadline = Instant::now() + Duration::from_secs(180);
    let settled = loop {
        assert!(child.try_wait().unwrap().is_none(), "shepherd run exited");
        let c = counts(&t.db).await;
        let backoffs: i64 = c.backoffs.iter().map(|(_, n)| n).sum();
        let work: i64 = c.work.iter().map(|(_, n)| n).sum();
        if c.provided == MACHINES as i64
            && c.agent_started + backoffs == MACHINES as i64
            && work == 0
        {
            break c;
        }
        assert!(Instant::now() < deadline, "no convergence: {c:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let failed_machines: i64 = settled.backoffs.iter().map(|(_, n)| n).sum();
    assert!(
        failed_machines > 0,
        "5% injected connect failures left no trace"
    );

    // The gauges refresh every 200 ms: within 30 s a scrape must show the settled state, every
    // started agent and every backoff the BMDB counts. Started agents alone do not tell: a
    // refresh read while the last failing takeover still held its work already had every
    // started agent, but one backoff less (seen on CI).
    let deadline = Instant::now() + Duration::from_secs(30);
    let backoffs_gauge = (
        "shepherd_fleet_active_backoffs".to_string(),
        vec![("process".to_string(), "ShepherdAgentStart".to_string())],
    );
    let samples = loop {
        let s = scrape(&url).await;
        let seen = (
            s.get(&("shepherd_fleet_machines_agent_started".into(), vec![]))
                .copied(),
            s.get(&backoffs_gauge).copied(),
        );
        if seen
            == (
                Some(settled.agent_started as f64),
                Some(failed_machines as f64),
            )
        {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "gauges never caught up: {seen:?}, the BMDB: {} started, {failed_machines} backoffs",
            settled.agent_started
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let history = history_counts(&t.db).await;
    let h = |p, e| history.get(&(p, e)).copied().unwrap_or(0.0);
    let start = Process::ShepherdAgentStart;

    // design.md §16 counters, exact names and labels, equal to the audit history.
    let work = [
        ("processor", "shepherd-initializer"),
        ("process", "ShepherdAgentStart"),
    ];
    assert_eq!(
        get(&samples, "bmdb_work_started_total", &work),
        h(start, WorkEvent::Started)
    );
    for (result, event) in [
        ("finished", WorkEvent::Finished),
        ("failed", WorkEvent::Failed),
    ] {
        let labels = [work[0], work[1], ("result", result)];
        assert_eq!(
            get(&samples, "bmdb_work_finished_total", &labels),
            h(start, event),
            "{result}"
        );
    }
    assert_eq!(h(start, WorkEvent::Finished), settled.agent_started as f64);
    assert_eq!(h(start, WorkEvent::Failed), failed_machines as f64);
    for processor in ["shepherd-initializer", "shepherd-provisioner"] {
        let p = [("processor", processor)];
        assert!(get(&samples, "bmdb_session_started_total", &p) >= 1.0);
        assert!(get(&samples, "bmdb_transaction_executed_total", &p) >= 1.0);
        // A label set appears once used; no transaction is expected to fail here.
        let failed = samples
            .get(&(
                "bmdb_transaction_failed_total".to_string(),
                vec![("processor".into(), processor.into())],
            ))
            .copied()
            .unwrap_or(0.0);
        assert_eq!(failed, 0.0, "failed transactions of {processor}");
    }
    assert_eq!(
        get(
            &samples,
            "bmdb_session_started_total",
            &[("processor", "shepherd-initializer")]
        ),
        8.0,
        "one session per initializer worker"
    );

    // Provider calls: every machine was created once; histograms count the same calls.
    assert_eq!(
        get(
            &samples,
            "shepherd_provider_calls_total",
            &[("call", "create"), ("result", "ok")]
        ),
        MACHINES as f64
    );
    assert_eq!(
        get(
            &samples,
            "shepherd_provider_call_duration_seconds_count",
            &[("call", "create")]
        ),
        MACHINES as f64
    );
    assert!(
        get(
            &samples,
            "shepherd_provider_calls_total",
            &[("call", "list"), ("result", "ok")]
        ) >= 1.0
    );

    // Fleet statistics gauges agree with the BMDB.
    assert_eq!(
        get(&samples, "shepherd_fleet_machines", &[]),
        MACHINES as f64
    );
    assert_eq!(
        get(
            &samples,
            "shepherd_fleet_machines_provided",
            &[("provider", "Sim")]
        ),
        MACHINES as f64
    );
    assert_eq!(
        get(
            &samples,
            "shepherd_fleet_machines_eligible",
            &[("process", "ShepherdAgentStart")]
        ),
        0.0,
        "everything not started is in backoff"
    );
    for gauge in [
        "shepherd_fleet_machines_maintenance",
        "shepherd_fleet_machines_decommissioned",
    ] {
        assert_eq!(get(&samples, gauge, &[]), 0.0, "{gauge}");
    }
    let heartbeating = get(&samples, "shepherd_fleet_machines_heartbeating", &[]);
    assert!(heartbeating <= settled.agent_started as f64);

    signal(child, "TERM");
    assert!(child.wait().unwrap().success());
    t.cleanup().await;
}
