//! The claim statements, pinned two ways: their text, as a snapshot a reviewer sees change
//! (`EXPECTORATE=overwrite cargo test -p shepherd-bmdb --test claim_statements` rewrites it),
//! and on Postgres their query plans over a fleet large enough that the planner would rather
//! scan a table than probe an index it cannot use. Before this test only the benchmark noticed
//! a claim that had stopped using the indexes.

use shepherd_bmdb::testing;
use shepherd_bmdb::{Processor, ProviderKind, SessionConfig};

#[test]
fn claim_statements_match_their_snapshot() {
    let mut text = String::new();
    for (name, sql) in testing::claim_statements(ProviderKind::Static) {
        text.push_str(&format!("-- {name}\n"));
        for line in sql
            .lines()
            .map(str::trim_end)
            .filter(|l| !l.trim().is_empty())
        {
            text.push_str(line);
            text.push('\n');
        }
        text.push('\n');
    }
    expectorate::assert_contents("tests/snapshots/claim_statements.txt", &text);
}

/// Machines in the fleet the plans are made for.
const FLEET: i64 = 20_000;

/// Builds `FLEET` machines of the Static provider in every state a claim looks at, with
/// set-based SQL (seconds, not minutes), and refreshes the planner's statistics.
async fn seed_fleet(url: &str) {
    let pool = sqlx::PgPool::connect(url).await.expect("connect");
    for statement in [
        "INSERT INTO machines (machine_id)
         SELECT gen_random_uuid() FROM generate_series(1, $1)",
        "INSERT INTO machine_provided (machine_id, provider, provider_id)
         SELECT machine_id, 'Static', 'box-' || row_number() OVER () FROM machines",
        // Half the fleet has an agent; most of those heartbeat, some went silent long ago.
        "INSERT INTO machine_agent_started (machine_id, started_at, public_key)
         SELECT machine_id, now() - interval '2 hours', sha256(uuid_send(machine_id))
           FROM machines WHERE get_byte(uuid_send(machine_id), 0) < 128",
        "INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at)
         SELECT machine_id, CASE WHEN get_byte(uuid_send(machine_id), 1) < 16
                                 THEN now() - interval '1 hour' ELSE now() END
           FROM machine_agent_started",
        // Half the fleet came bare: almost all of it is done, a few machines are on their way.
        "INSERT INTO machine_bare_metal (machine_id, phase, phase_at, install_generation)
         SELECT machine_id,
                CASE WHEN get_byte(uuid_send(machine_id), 4) < 4 THEN
                     (ARRAY['Bare', 'LiveBoot', 'Installing', 'DiskBoot'])[1 + get_byte(uuid_send(machine_id), 5) % 4]
                     ELSE 'Done' END,
                now() - interval '5 minutes', 1
           FROM machines WHERE get_byte(uuid_send(machine_id), 3) < 128",
        // A few machines in backoff for each process.
        "INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
         SELECT machine_id, p, now() + interval '1 hour', 'seeded', 60
           FROM machines, unnest(ARRAY['ShepherdAgentStart', 'ShepherdRecovery', 'ShepherdBareMetal']) AS p
          WHERE get_byte(uuid_send(machine_id), 2) < 8",
        "ANALYZE",
    ] {
        let q = sqlx::query(statement);
        let q = if statement.contains("$1") {
            q.bind(FLEET)
        } else {
            q
        };
        q.execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    pool.close().await;
}

/// Tables whose every row a claim must never read: the fleet-sized ones.
const FLEET_TABLES: [&str; 6] = [
    "machines",
    "machine_provided",
    "machine_agent_started",
    "machine_agent_heartbeat",
    "work_backoff",
    "machine_bare_metal",
];

/// Rows a window or hinted search may touch in one plan step: its window of 64 index entries,
/// with room for the planner's choice of how to walk them.
const WINDOW_ROWS: u64 = 256;

/// The most rows one step of an executed plan produced, over all its loops.
fn rows_touched(plan: &str) -> u64 {
    plan.lines()
        .filter_map(|line| {
            let actual = line.split("actual rows=").nth(1)?;
            let rows: u64 = actual.split_whitespace().next()?.parse().ok()?;
            let loops: u64 = actual
                .split("loops=")
                .nth(1)?
                .trim_end_matches(')')
                .parse()
                .ok()?;
            Some(rows * loops)
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn claims_use_the_indexes_on_postgres() {
    let Some(t) = testing::postgres().await else {
        return;
    };
    seed_fleet(&t.url).await;
    let session =
        t.db.start_session(SessionConfig::new("plans", Processor::ShepherdInitializer))
            .await
            .expect("session");
    let plans = testing::explain_claims(&t.db, session.id(), ProviderKind::Static)
        .await
        .expect("explain");
    assert_eq!(
        plans.len(),
        18,
        "three searches, for a batch and for a lone request, for each of three rules"
    );
    for (name, plan) in &plans {
        let plan = plan.join("\n");
        // The full search may read the fleet's tag tables through anti-joins (that is what
        // keeps it cheap when eligible machines are rare), but it walks `machine_provided` in
        // id order from the start point through an index, so it stops at its limit.
        let scanned: Vec<&str> = FLEET_TABLES
            .iter()
            .copied()
            .filter(|table| plan.contains(&format!("Seq Scan on {table} ")))
            .filter(|table| !name.contains("everywhere") || *table == "machine_provided")
            .collect();
        assert!(
            scanned.is_empty(),
            "{name} reads every row of {scanned:?}:\n{plan}"
        );
        assert!(
            plan.contains("Index") && plan.contains("machine_provided"),
            "{name} does not reach machine_provided through an index:\n{plan}"
        );
        // The hinted and window searches probe a few machines each: no step of their plan may
        // touch more rows than a window holds, whatever the fleet's size.
        if !name.contains("everywhere") {
            let widest = rows_touched(&plan);
            assert!(
                widest <= WINDOW_ROWS,
                "{name} touches {widest} rows in one step:\n{plan}"
            );
        }
    }
    session.close().await.expect("close");
    t.cleanup().await;
}
