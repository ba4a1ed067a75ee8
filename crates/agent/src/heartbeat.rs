//! Agent mode: heartbeat forever, report hardware once, install when asked.

use std::process::ExitCode;
use std::time::Duration;

use shepherd_proto::bmaas::agent_callback_client::AgentCallbackClient;
use shepherd_proto::bmaas::{
    os_installation_report, os_installation_request, HeartbeatRequest, OsInstallationReport,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::{hardware, identity, install, state, RunArgs};

/// Delay before retry `attempt` (1-based): exponential from 1 s, capped at 60 s, 50–100 % jitter.
pub fn retry_delay(attempt: u32) -> Duration {
    let cap = Duration::from_secs(1)
        .saturating_mul(1 << attempt.saturating_sub(1).min(6))
        .min(Duration::from_secs(60));
    cap.mul_f64(0.5 + rand::random::<f64>() / 2.0)
}

fn channel(
    endpoint: &str,
    ca_der: &[u8],
    cert_pem: &str,
    key_pem: &str,
) -> Result<Channel, String> {
    let host = endpoint
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or(endpoint)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let mut tls = ClientTlsConfig::new()
        .domain_name(host)
        .identity(Identity::from_pem(cert_pem, key_pem));
    tls = if ca_der.is_empty() {
        tls.with_webpki_roots()
    } else {
        tls.ca_certificate(Certificate::from_pem(identity::der_to_pem(ca_der)))
    };
    Ok(Endpoint::from_shared(format!("https://{endpoint}"))
        .map_err(|e| format!("BMaaS endpoint {endpoint:?}: {e}"))?
        .tls_config(tls)
        .map_err(|e| format!("TLS settings: {e}"))?
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(30))
        .connect_lazy())
}

/// Runs the agent until killed.
pub async fn run(args: RunArgs) -> ExitCode {
    match run_inner(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shepherd-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run_inner(args: RunArgs) -> Result<(), String> {
    let mut st = state::load(&args.state)?;
    let init = st.init.clone().ok_or("state has no init message")?;
    let (cert_pem, key_pem) =
        identity::client_certificate(&st.private_key_pkcs8, &init.machine_id)?;
    let mut client = AgentCallbackClient::new(channel(
        &init.bmaas_endpoint,
        &init.ca_certificate,
        &cert_pem,
        &key_pem,
    )?);
    let mut hardware_report = Some(hardware::report());
    let mut installation_report: Option<OsInstallationReport> = None;
    let mut reboot_after_ack = false;
    let mut failures = 0u32;
    loop {
        let request = HeartbeatRequest {
            machine_id: init.machine_id.clone(),
            hardware_report: hardware_report.clone(),
            installation_report: installation_report.clone(),
        };
        match client.heartbeat(request).await {
            Ok(response) => {
                failures = 0;
                hardware_report = None;
                installation_report = None;
                if reboot_after_ack {
                    reboot_after_ack = false;
                    install::reboot(&args.reboot_command).await;
                }
                if let Some(req) = response.into_inner().installation_request {
                    if req.generation > st.installed_generation {
                        let outcome = match &req.r#type {
                            Some(os_installation_request::Type::Image(image)) => {
                                install::install(image).await
                            }
                            Some(os_installation_request::Type::Metropolis(_)) => Err(
                                "Metropolis installation requests are not supported by this agent"
                                    .into(),
                            ),
                            None => Err("installation request names no installation type".into()),
                        };
                        st.installed_generation = req.generation;
                        if let Err(e) = state::save(&args.state, &st) {
                            eprintln!("shepherd-agent: saving state: {e}");
                        }
                        reboot_after_ack = outcome.is_ok();
                        installation_report = Some(OsInstallationReport {
                            generation: req.generation,
                            result: Some(match outcome {
                                Ok(()) => os_installation_report::Result::Success(
                                    os_installation_report::Success {},
                                ),
                                Err(error) => os_installation_report::Result::Error(
                                    os_installation_report::Error { error },
                                ),
                            }),
                        });
                        continue; // report right away
                    }
                }
                tokio::time::sleep(args.heartbeat_interval).await;
            }
            Err(status) => {
                failures += 1;
                let delay = retry_delay(failures);
                eprintln!(
                    "shepherd-agent: heartbeat failed ({}: {}); retrying in {delay:?}",
                    status.code(),
                    status.message()
                );
                tokio::time::sleep(delay).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_grow_are_capped_and_jittered() {
        for attempt in 1..100 {
            let d = retry_delay(attempt);
            assert!(
                d >= Duration::from_millis(500) && d <= Duration::from_secs(60),
                "{attempt}: {d:?}"
            );
        }
        assert!(retry_delay(1) <= Duration::from_secs(1));
        assert!(retry_delay(20) >= Duration::from_secs(30));
        let samples: std::collections::BTreeSet<_> = (0..20).map(|_| retry_delay(5)).collect();
        assert!(samples.len() > 1, "no jitter");
    }
}
