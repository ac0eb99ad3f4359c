//! `shareguard rollout`: lists each device's stage, or moves one device, or every device
//! of a DeviceClass, to a stage.

use std::process::ExitCode;

use anyhow::bail;
use shareguard_proto::v1 as pb;

use shareguard_proto::v1::node_agent_client::NodeAgentClient;
use tonic::transport::Channel;

/// `rollout`'s arguments as given: `rollout`, `rollout DEVICE STAGE`, or
/// `rollout --class CLASS STAGE`.
pub struct RolloutArgs {
    pub class: Option<String>,
    pub first: Option<String>,
    pub second: Option<String>,
}

/// What the arguments ask for.
#[derive(Debug, PartialEq, Eq)]
enum Ask {
    List,
    Set(pb::SetStageRequest),
}

fn ask(a: RolloutArgs) -> anyhow::Result<Ask> {
    Ok(match (a.class, a.first, a.second) {
        (None, None, None) => Ask::List,
        (None, Some(device), Some(stage)) => Ask::Set(pb::SetStageRequest {
            device,
            stage,
            device_class: String::new(),
        }),
        (Some(device_class), Some(stage), None) => Ask::Set(pb::SetStageRequest {
            device: String::new(),
            stage,
            device_class,
        }),
        (Some(_), _, _) => bail!("rollout --class CLASS takes STAGE alone"),
        _ => bail!("rollout takes DEVICE and STAGE together, or --class CLASS STAGE, or nothing"),
    })
}

pub async fn run(
    c: &mut NodeAgentClient<Channel>,
    a: RolloutArgs,
    json: bool,
) -> anyhow::Result<ExitCode> {
    match ask(a)? {
        Ask::Set(req) => {
            let r = c.set_stage(req).await?.into_inner();
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                for ch in &r.changes {
                    println!(
                        "{}: {} -> {} ({} shares changed, {} failed)",
                        ch.device, ch.previous, ch.stage, ch.shares_changed, ch.shares_failed
                    );
                }
            }
            if r.shares_failed > 0 {
                return Ok(ExitCode::FAILURE);
            }
        }
        Ask::List => {
            let r = c
                .list_devices(pb::ListDevicesRequest {})
                .await?
                .into_inner();
            if json {
                let v: Vec<serde_json::Value> = r
                    .devices
                    .iter()
                    .map(|d| {
                        serde_json::json!({
                            "device": d.name,
                            "class": d.device_class,
                            "stage": d.stage,
                            "mechanism": d.mechanism,
                            "liveShares": d.live_shares,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string(&v)?);
            } else {
                println!(
                    "{:<20} {:<26} {:<8} {:<16} {:>6}",
                    "DEVICE", "CLASS", "STAGE", "MECHANISM", "SHARES"
                );
                for d in &r.devices {
                    println!(
                        "{:<20} {:<26} {:<8} {:<16} {:>6}",
                        d.name, d.device_class, d.stage, d.mechanism, d.live_shares
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(class: Option<&str>, first: Option<&str>, second: Option<&str>) -> RolloutArgs {
        RolloutArgs {
            class: class.map(str::to_owned),
            first: first.map(str::to_owned),
            second: second.map(str::to_owned),
        }
    }

    #[test]
    fn arguments_name_a_device_or_a_class_never_both() {
        assert_eq!(ask(args(None, None, None)).unwrap(), Ask::List);
        let Ask::Set(r) = ask(args(None, Some("nic0"), Some("observe"))).unwrap() else {
            panic!("a device and a stage set a stage");
        };
        assert_eq!((r.device.as_str(), r.device_class.as_str()), ("nic0", ""));
        let Ask::Set(r) = ask(args(Some("c"), Some("enforce"), None)).unwrap() else {
            panic!("a class and a stage set a stage");
        };
        assert_eq!((r.device.as_str(), r.device_class.as_str()), ("", "c"));
        assert_eq!(r.stage, "enforce");
        assert!(ask(args(Some("c"), Some("nic0"), Some("observe"))).is_err());
        assert!(ask(args(Some("c"), None, None)).is_err());
        assert!(ask(args(None, Some("nic0"), None)).is_err());
    }
}
