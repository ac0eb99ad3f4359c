//! `/healthz` and `/readyz` for the kubelet's probes (`--health-addr`).
//!
//! Readiness is what a rolling update waits for before it stops the instance this one
//! replaces: the agent's epoch held, and every driver registered with kubelet (kubelet
//! calls the newest registered instance). A fenced instance is not ready: a newer one
//! serves, and this one only passes calls on to it.

use std::sync::{Arc, OnceLock};

use axum::{Router, extract::State, http::StatusCode, routing::get};
use tokio::sync::watch;

use crate::{agent::Agent, kubelet::RegistrationState};

/// What readiness is judged on; filled in as the plugin starts.
#[derive(Default)]
pub struct Readiness {
    agent: OnceLock<Arc<Agent>>,
    registrations: OnceLock<Vec<(String, watch::Receiver<RegistrationState>)>>,
}

impl Readiness {
    pub fn set_agent(&self, agent: Arc<Agent>) {
        let _ = self.agent.set(agent);
    }

    pub fn set_registrations(&self, regs: Vec<(String, watch::Receiver<RegistrationState>)>) {
        let _ = self.registrations.set(regs);
    }

    /// Ok when ready, or why not.
    pub fn check(&self) -> Result<(), String> {
        let Some(agent) = self.agent.get() else {
            return Err("waiting for the node agent".into());
        };
        if agent.is_fenced() {
            return Err(format!(
                "fenced: a newer instance took the agent's epoch (this one had {})",
                agent.epoch()
            ));
        }
        if agent.epoch() == 0 {
            return Err("taking the agent's epoch".into());
        }
        let Some(regs) = self.registrations.get() else {
            return Err("starting kubelet's registration".into());
        };
        for (driver, state) in regs {
            match &*state.borrow() {
                RegistrationState::Registered => {}
                RegistrationState::Waiting => {
                    return Err(format!("waiting for kubelet to register driver {driver}"));
                }
                RegistrationState::Refused(e) => {
                    return Err(format!("kubelet refused driver {driver}: {e}"));
                }
            }
        }
        Ok(())
    }
}

pub fn router(readiness: Arc<Readiness>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(readiness)
}

async fn readyz(State(r): State<Arc<Readiness>>) -> (StatusCode, String) {
    match r.check() {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_ready_until_the_agent_is_there() {
        let r = Readiness::default();
        assert!(r.check().unwrap_err().contains("node agent"));
    }
}
