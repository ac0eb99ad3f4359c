//! Each device's health as kubelet hears it (`DRAResourceHealth`, served by
//! `kubelet/resource_health.rs`): HEALTHY while the agent says the device can hold its
//! shares, UNHEALTHY with the agent's reason when it cannot (its NIC's link down or
//! gone, its limiter unavailable, its GPU not answering the driver), UNKNOWN while the
//! agent does not answer. kubelet writes it into the status of every pod using the
//! device (`allocatedResourcesStatus`).

use std::{
    collections::BTreeSet,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use shareguard_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::debug;

use crate::{agent::Agent, driver::Driver};

/// How often the agent is asked while kubelet listens: a fault reaches kubelet within
/// this plus one call, well inside the 30 s the design allows.
pub const PERIOD: Duration = Duration::from_secs(5);
/// How long kubelet keeps a device's health without news before it calls it unknown:
/// six periods, so that a slow answer or two never flips a pod's status.
pub const TIMEOUT_SECONDS: i64 = 30;
/// kubelet cuts a longer message; cut here, on a character boundary, instead.
pub const MAX_MESSAGE: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    Unknown,
    Healthy,
    Unhealthy,
}

/// One device's health at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealth {
    pub pool: String,
    pub device: String,
    pub health: Health,
    pub message: String,
    /// Unix seconds.
    pub at: i64,
}

/// The health of `driver`'s devices from one answer of the agent's `ListDevices`, or
/// from its failure (`Err`, the reason): then every device in `known` is UNKNOWN.
/// `known` is the driver's devices as last seen and is kept up to date here, so that a
/// device the agent stops listing is not reported again.
pub fn judge(
    driver: &str,
    answer: Result<&pb::ListDevicesResponse, &str>,
    known: &mut BTreeSet<(String, String)>,
    at: i64,
) -> Vec<DeviceHealth> {
    let r = match answer {
        Ok(r) => r,
        Err(why) => {
            let message = cut(&format!("the shareguard agent does not answer: {why}"));
            return known
                .iter()
                .map(|(pool, device)| DeviceHealth {
                    pool: pool.clone(),
                    device: device.clone(),
                    health: Health::Unknown,
                    message: message.clone(),
                    at,
                })
                .collect();
        }
    };
    known.clear();
    r.devices
        .iter()
        .filter(|d| d.driver == driver)
        .map(|d| {
            known.insert((d.pool.clone(), d.name.clone()));
            let (health, message) = if d.fault.is_empty() {
                let mut m = format!("mechanism {}", d.mechanism);
                if d.stage == "observe" {
                    m.push_str("; stage observe: shares are measured, not limited");
                }
                (Health::Healthy, m)
            } else {
                (Health::Unhealthy, cut(&d.fault))
            };
            DeviceHealth {
                pool: d.pool.clone(),
                device: d.name.clone(),
                health,
                message,
                at,
            }
        })
        .collect()
}

fn cut(s: &str) -> String {
    if s.len() <= MAX_MESSAGE {
        return s.to_owned();
    }
    let mut end = MAX_MESSAGE - 3;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// One kubelet stream: the driver's devices' health now and every [`PERIOD`], until
/// kubelet closes it. Each message lists every device (kubelet reconciles the whole
/// list), so it is also the heartbeat that keeps kubelet from timing them out.
pub fn watch(agent: Arc<Agent>, driver: Arc<Driver>) -> ReceiverStream<Vec<DeviceHealth>> {
    let (tx, rx) = mpsc::channel(1);
    let mut known: BTreeSet<(String, String)> = driver
        .devices_now()
        .devices
        .devices
        .keys()
        .cloned()
        .collect();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let health = match agent.list_devices().await {
                Ok(r) => judge(driver.name(), Ok(&r), &mut known, unix_now()),
                Err(e) => judge(driver.name(), Err(&e.to_string()), &mut known, unix_now()),
            };
            if tx.send(health).await.is_err() {
                debug!(driver = %driver.name(), "kubelet closed the health stream");
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(driver: &str, name: &str, fault: &str, stage: &str) -> pb::DeviceStatus {
        pb::DeviceStatus {
            name: name.into(),
            driver: driver.into(),
            pool: "node-a".into(),
            mechanism: "htb-ebpf".into(),
            stage: stage.into(),
            fault: fault.into(),
            ..Default::default()
        }
    }

    fn answer(devices: Vec<pb::DeviceStatus>) -> pb::ListDevicesResponse {
        pb::ListDevicesResponse {
            devices,
            ..Default::default()
        }
    }

    #[test]
    fn a_fault_is_unhealthy_with_its_reason_and_the_rest_healthy() {
        let mut known = BTreeSet::new();
        let r = answer(vec![
            device("d.example.com", "nic-0", "", "enforce"),
            device(
                "d.example.com",
                "nic-1",
                "interface eth1 is down",
                "enforce",
            ),
            device("d.example.com", "nic-2", "", "observe"),
            device("other.example.com", "gpu-0", "", "enforce"),
        ]);
        let h = judge("d.example.com", Ok(&r), &mut known, 7);
        let got: Vec<_> = h
            .iter()
            .map(|d| (d.device.as_str(), d.health, d.message.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("nic-0", Health::Healthy, "mechanism htb-ebpf"),
                ("nic-1", Health::Unhealthy, "interface eth1 is down"),
                (
                    "nic-2",
                    Health::Healthy,
                    "mechanism htb-ebpf; stage observe: shares are measured, not limited"
                ),
            ],
            "another driver's device is not this driver's to report"
        );
        assert!(h.iter().all(|d| d.at == 7 && d.pool == "node-a"));
        assert_eq!(known.len(), 3);
    }

    #[test]
    fn no_answer_makes_every_known_device_unknown_and_a_dropped_one_is_forgotten() {
        let mut known = BTreeSet::new();
        let r = answer(vec![
            device("d", "nic-0", "", "enforce"),
            device("d", "nic-1", "", "enforce"),
        ]);
        judge("d", Ok(&r), &mut known, 1);
        let h = judge("d", Err("connection refused"), &mut known, 2);
        assert_eq!(h.len(), 2);
        for d in &h {
            assert_eq!(d.health, Health::Unknown);
            assert_eq!(
                d.message,
                "the shareguard agent does not answer: connection refused"
            );
        }
        // The agent comes back without nic-1: it is not reported any more.
        let r = answer(vec![device("d", "nic-0", "", "enforce")]);
        judge("d", Ok(&r), &mut known, 3);
        let h = judge("d", Err("timed out"), &mut known, 4);
        let names: Vec<_> = h.iter().map(|d| d.device.as_str()).collect();
        assert_eq!(names, ["nic-0"]);
    }

    #[test]
    fn a_long_reason_is_cut_to_what_kubelet_keeps() {
        let mut known = BTreeSet::new();
        // Multi-byte characters across the cut: it must land on a boundary.
        let long = "é".repeat(MAX_MESSAGE);
        let r = answer(vec![device("d", "nic-0", &long, "enforce")]);
        let h = judge("d", Ok(&r), &mut known, 1);
        assert!(h[0].message.len() <= MAX_MESSAGE, "{}", h[0].message.len());
        assert!(h[0].message.ends_with("..."));
    }
}
