//! Small statistics helpers for benchmark reports, and the peak memory of a process.

use std::time::Duration;

/// The `q` quantile (0..=1) of `samples` by nearest rank; zero for no samples.
pub fn quantile(samples: &mut [Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1]
}

/// Milliseconds with two decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

/// The peak resident set size of a live process, in KiB (`VmHWM`).
pub fn vm_hwm_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM")
}

/// A size in KiB from a live process's `/proc/PID/status` (`VmRSS`, `VmHWM`, …).
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile(&mut v, 0.5), Duration::from_millis(50));
        assert_eq!(quantile(&mut v, 0.99), Duration::from_millis(99));
        assert_eq!(quantile(&mut [], 0.5), Duration::ZERO);
    }
}
